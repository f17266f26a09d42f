"""The token-weighted distributed step equals the single-process step on the union batch."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from helpers import REPO, small_job

from train.balance.step import backward, label_tokens, summed_loss
from train.config import JobConfig
from train.dist import distributed
from train.model.load import load_model

JOB = small_job(lora={"dropout": 0.0}, data={"seq_len": 24, "packing": False})


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    """Unequal shares, micro-batch sizes and accumulation counts, and unequal label counts per sequence.

    Rank 0: five sequences in micro-batches of 2 + 2 + 1; rank 1: three in one micro-batch;
    rank 2: one sequence.
    """
    gen = torch.Generator().manual_seed(0)

    def batch(n: int, lengths: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.randint(4, 400, (n, 24), generator=gen)
        mask = torch.zeros(n, 24, dtype=torch.long)
        labels = torch.full((n, 24), -100)
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
            labels[row, 3:length] = ids[row, 3:length]
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return [
        [batch(2, [24, 10]), batch(2, [5, 19]), batch(1, [17])],
        [batch(3, [24, 24, 8])],
        [batch(1, [6])],
    ]


WORLD = len(_batches())


CPU = torch.device("cpu")


def _model(device: torch.device = CPU) -> torch.nn.Module:
    model, _, _ = load_model(JobConfig.model_validate(JOB), REPO, device)
    return model


def _step(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], device: torch.device = CPU
) -> dict[str, torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1.0)  # SGD: the update is the gradient itself, nothing hides an error
    backward(model, [{k: v.to(device) for k, v in mb.items()} for mb in micro_batches], device)
    opt.step()
    return {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _rank(rank: int, port: int, out: str, compress: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0"
    )
    torch.set_num_threads(1)
    info, _ = distributed.init(timeout_s=120)
    model = _model(info.device)  # as a rank loads it: on its device (the checker's, on CPU)
    after = _step(distributed.wrap(model, info, compress=compress), _batches()[rank], info.device)
    if rank == 0:
        torch.save(after, out)
    # As a worker ends: wait for every rank, so none tears gloo down under a peer (which can abort it).
    distributed.wait_for_all("every rank has written its result", 60)
    distributed.shutdown()


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict) -> float:
    worst = 0.0
    for name in a:
        delta_a, delta_b = a[name] - start[name], b[name] - start[name]
        scale = delta_b.abs().max().item()
        if scale > 0:
            worst = max(worst, (delta_a - delta_b).abs().max().item() / scale)
    return worst


def _distributed_step(spawn: Callable[..., None], tmp_path: Path, compress: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"rank0-{compress}.pt"
    spawn(_rank, WORLD, str(out), compress)
    return dict(torch.load(out))


def test_unequal_shares_micro_batches_and_accumulation_equal_the_union_step(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    torch.set_num_threads(1)
    start = {n: p.detach().clone() for n, p in _model().named_parameters() if p.requires_grad}
    distributed_after = _distributed_step(spawn, tmp_path, "none")

    union = [mb for rank in _batches() for mb in rank]
    single_after = _step(_model(), union)
    assert _max_relative_difference(distributed_after, single_after, start) <= 1e-5

    # The check has teeth: averaging each micro-batch's mean loss (what naive accumulation does) differs.
    naive = _model()
    for mb in union:
        (summed_loss(naive, mb) / label_tokens(mb) / len(union)).backward()
    torch.optim.SGD([p for p in naive.parameters() if p.requires_grad], lr=1.0).step()
    naive_after = {n: p.detach() for n, p in naive.named_parameters() if p.requires_grad}
    assert _max_relative_difference(naive_after, single_after, start) > 1e-3


def test_bf16_compressed_all_reduce_stays_close_to_the_exact_step(tmp_path: Path, spawn: Callable[..., None]) -> None:
    """bf16 keeps 8 bits of mantissa: the update moves by well under 1 %, but it does move."""
    torch.set_num_threads(1)
    start = {n: p.detach().clone() for n, p in _model().named_parameters() if p.requires_grad}
    compressed = _distributed_step(spawn, tmp_path, "bf16")
    exact = _step(_model(), [mb for rank in _batches() for mb in rank])
    assert 0 < _max_relative_difference(compressed, exact, start) < 1e-2
