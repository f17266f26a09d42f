"""A step through pipeline stages, alone or beside a data-parallel replica, equals one process on the union batch."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import REPO, small_job
from test_token_weighted import _batches, _max_relative_difference

from train.balance.step import StepClock, backward
from train.config import JobConfig
from train.dist import distributed
from train.layout import pipeline, stagemodel, topology
from train.model.load import load_model

JOB = JobConfig.model_validate(small_job(lora={"dropout": 0.0}, data={"seq_len": 24, "packing": False}))
CPU = torch.device("cpu")
LAYERS = 4  # models/tiny-llama
HIDDEN = 128
MAX_NORM = 0.05  # small enough that clipping acts: the clipped update must match too


def _union() -> list[dict[str, torch.Tensor]]:
    return [mb for rank in _batches() for mb in rank]


def _replica_batches(replicas: int) -> list[list[dict[str, torch.Tensor]]]:
    """One replica: every micro-batch; two: 5 sequences (2 + 2 + 1) and 4 (3 + 1), unequal shares."""
    parts = _batches()
    return [_union()] if replicas == 1 else [parts[0], parts[1] + parts[2]]


def _whole_model(device: torch.device = CPU) -> Any:
    model, _, _ = load_model(JOB, REPO, device)
    stagemodel.seed_lora(model, JOB.train.seed)
    return model


def _single_process() -> tuple[dict[str, torch.Tensor], float]:
    model = _whole_model()
    params = [p for p in model.parameters() if p.requires_grad]
    backward(model, _union(), torch.device("cpu"))
    norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    torch.optim.SGD(params, lr=1.0).step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, norm


def _rank(rank: int, port: int, groups: list[list[int]], out: str, scratch: str) -> None:
    world = sum(len(g) for g in groups)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    torch.set_num_threads(1)
    info, _ = distributed.init(timeout_s=120)
    layout = topology.fixed(LAYERS, [f"h{r}" for r in range(world)], groups)
    where, stage = layout.where(rank), layout.stage(rank)
    if where.stages == 1:
        model = _whole_model(info.device)
    else:
        model, _ = stagemodel.load_stage(JOB, REPO, stage, where.first, where.last, info.device, Path(scratch))
    named = pipeline.named_trainable(model, stage.start)
    sync = pipeline.GradSync(named, rank, world)
    run = pipeline.StageRunner(model, where, HIDDEN, torch.float32, info.device)
    batches = [{k: v.to(info.device) for k, v in mb.items()} for mb in _replica_batches(len(groups))[where.replica]]
    run.step(batches, StepClock())
    sync.all_reduce()
    norm = sync.clip(MAX_NORM)
    assert norm > MAX_NORM
    torch.optim.SGD([p for _, p in named], lr=1.0).step()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, ({n: p.detach().clone() for n, p in named}, norm))
    if rank == 0:
        torch.save(everyone, out)
    distributed.wait_for_all("every rank has written its result", 60)
    distributed.shutdown()


@pytest.mark.parametrize(
    "groups",
    [
        # A pipeline alone (first and last stage), and one with a middle stage beside a whole-model replica with
        # unequal shares: the 3-stage pipeline alone and the 2-stage one beside a replica checked nothing these two
        # do not (19 + 37 CPU-s of the four's 114; docs/results.md "CI time").
        pytest.param([[2, 2]], id="2-stages"),
        pytest.param([[4], [2, 1, 1]], id="whole-beside-3-stages"),
    ],
)
def test_a_pipeline_step_equals_the_single_process_step(
    groups: list[list[int]], tmp_path: Path, spawn: Callable[..., None]
) -> None:
    torch.set_num_threads(1)
    world = sum(len(g) for g in groups)
    out = tmp_path / "params.pt"
    spawn(_rank, world, groups, str(out), str(tmp_path / "scratch"))
    results: list[tuple[dict[str, torch.Tensor], float]] = torch.load(out)
    per_rank = [params for params, _ in results]

    single, single_norm = _single_process()
    # Clipping hides a wrongly scaled gradient (it rescales any gradient to the same norm): the norm before
    # clipping must be the single process's on every rank.
    for _, norm in results:
        assert abs(norm - single_norm) <= 1e-5 * single_norm
    start = {n: p.detach().clone() for n, p in _whole_model().named_parameters() if p.requires_grad}
    merged: dict[str, torch.Tensor] = {}
    for params in per_rank:
        for name, value in params.items():
            if name in merged:  # held by another replica too: replicas must agree exactly after the step
                assert torch.equal(merged[name], value), name
            merged[name] = value
    assert set(merged) == set(single), "every LoRA weight of the whole model is trained by some stage"
    assert _max_relative_difference(merged, single, start) <= 1e-5
    # Each stage holds only its layers: the first stage of the last pipeline has none of the later layers.
    first_of_pipeline = per_rank[len(groups[0])] if len(groups) > 1 else per_rank[0]
    layers = {stagemodel.layer_of(n) for n in first_of_pipeline} - {None}
    cut = groups[-1][0]
    assert layers == set(range(cut))
