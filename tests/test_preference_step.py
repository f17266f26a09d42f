"""The preference step over unequal shares equals the one-process step on the union of the items (dpo, orpo, kto).

Three gloo ranks, DDP as a run wraps the model (train/dist/distributed.py ``wrap``, no gradient compression), with
unequal shares and micro-batches: rank 0 three items in micro-batches of 2 + 1, rank 1 two items in one, rank 2 one.
Every rank ends with the loss and the LoRA gradients one process computes on all six items at once, in the ranks'
order: dpo (sigmoid), orpo (its chosen NLL a mean over every rank's tokens) and kto (its KL estimate the mean over
every rank's KL rows, the KL rows TRL's rotation over the whole batch).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers import REPO
from preference_helpers import (
    example_batch,
    lora_grads,
    pair_batch,
    preference_job,
    random_examples,
    random_pairs,
    randomize_lora_b,
)

from train.config import JobConfig
from train.model.load import load_model

CPU = torch.device("cpu")
WIDTH = 24
SHARES = [[[0, 1], [2]], [[3, 4]], [[5]]]  # each rank's micro-batches, as global item indices
WORLD = len(SHARES)
UNION = [item for rank in SHARES for mb in rank for item in mb]  # the global order: the ranks' items in rank order

# Six items of unequal prompt and answer lengths; four desirable examples, two not.
PAIRS = random_pairs(21, [(3, 5, 2), (6, 2, 7), (2, 9, 4), (5, 4, 4), (8, 3, 6), (4, 7, 1)])
EXAMPLES = random_examples(22, [(3, 5), (6, 2), (2, 9), (5, 4), (8, 3), (4, 7)], [True, False, True, True, False, True])

METHODS: dict[str, dict[str, Any]] = {
    "dpo": preference_job("dpo", loss="sigmoid", beta=0.5),
    "orpo": preference_job("orpo", data={"train_on": "all"}, beta=0.5),
    "kto": preference_job(
        "kto", data={"format": "unpaired"}, loss="kto", beta=0.5, desirable_weight=1.0, undesirable_weight=1.33
    ),
}
TOLERANCE = 1e-5


def _batch(method: str, items: list[int]) -> dict[str, torch.Tensor]:
    return example_batch(EXAMPLES, items, WIDTH) if method == "kto" else pair_batch(PAIRS, items, WIDTH)


def _model(device: torch.device = CPU) -> torch.nn.Module:
    model, _, _ = load_model(JobConfig.model_validate(METHODS["dpo"]), REPO, device)
    randomize_lora_b(model, seed=9, scale=0.1)  # the same on every rank (and DDP broadcasts rank 0's anyway)
    return model


def _steps(model: torch.nn.Module, shares: list[list[int]], device: torch.device) -> dict[str, Any]:
    """Each method's step on the micro-batches ``shares``: its loss, figures and LoRA gradients."""
    from train.preference.objective import Objective
    from train.preference.step import backward

    out: dict[str, Any] = {}
    for method, job in METHODS.items():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()  # in place: DDP's gradients are views of its buckets
        figures: dict[str, float] = {}
        objective = Objective.from_job(JobConfig.model_validate(job))
        batches = [{k: v.to(device) for k, v in _batch(method, mb).items()} for mb in shares]
        loss, _ = backward(model, batches, device, objective, figures=figures)
        out[method] = {"loss": loss, "figures": figures, "grads": lora_grads(model)}
    return out


def _rank(rank: int, port: int, out_dir: str) -> None:
    from train.dist import distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0"
    )
    torch.set_num_threads(1)
    info, _ = distributed.init(timeout_s=120)
    model = distributed.wrap(_model(info.device), info, compress="none")
    torch.save(_steps(model, SHARES[rank], info.device), Path(out_dir) / f"rank{rank}.pt")
    distributed.wait_for_all("every rank has written its result", 60)
    distributed.shutdown()


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference of a parameter's gradients, relative to that parameter's largest (as
    tests/test_token_weighted.py measures the update), and where."""
    worst, where = 0.0, ""
    assert a.keys() == b.keys()
    for name in b:
        scale = b[name].abs().max().item()
        assert scale > 0, f"{name} has no gradient in the one-process step"
        diff = (a[name] - b[name]).abs().max().item() / scale
        if diff >= worst:
            worst, where = diff, name
    return worst, where


def test_unequal_shares_equal_the_one_process_step(tmp_path: Path, spawn: Callable[..., None]) -> None:
    torch.set_num_threads(1)
    spawn(_rank, WORLD, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model = _model()  # its LoRA B seeded so that the batch's KL estimate is above 0, each rank's own another
    single = _steps(model, [UNION], CPU)  # one process, one micro-batch of all six items

    for method, one in single.items():
        for r, got in enumerate(ranks):
            loss_diff = abs(got[method]["loss"] - one["loss"])
            grad_diff, where = _relative_difference(got[method]["grads"], one["grads"])
            print(f"{method} rank {r}: loss {got[method]['loss']:.8f} vs one process {one['loss']:.8f} "
                  f"(|diff| {loss_diff:.2e}); max relative gradient difference {grad_diff:.2e} at {where}")  # fmt: skip
            assert loss_diff <= TOLERANCE, f"{method} rank {r}: loss {got[method]['loss']} vs {one['loss']}"
            assert grad_diff <= TOLERANCE, f"{method} rank {r}: gradients differ by {grad_diff:.3e} at {where}"

    # kto's KL estimate is in play (above 0: not TRL's clamp) and is the whole batch's: every rank's own KL rows
    # give another one, so a rank that took its own would compute another loss.
    kl = single["kto"]["figures"]["kl"]
    assert kl > 0.05, kl
    for r, got in enumerate(ranks):
        assert abs(got["kto"]["figures"]["kl"] - kl) <= 1e-6, (r, got["kto"]["figures"]["kl"], kl)
    own = [_own_kl(model, rank) for rank in SHARES]
    assert max(abs(k - kl) for k in own) > 0.05, (own, kl)

    # The check has teeth: the mean of the ranks' own mean losses (each rank scaling by its own share) differs.
    for method, one in single.items():
        naive = sum(_steps(model, rank, CPU)[method]["loss"] for rank in SHARES) / WORLD
        assert abs(naive - one["loss"]) > 1e-3, (method, naive, one["loss"])


def _own_kl(model: torch.nn.Module, shares: list[list[int]]) -> float:
    """The KL estimate of one rank's KL rows alone, unclamped."""
    from train.preference.objective import Objective
    from train.preference.step import prepare

    objective = Objective.from_job(JobConfig.model_validate(METHODS["kto"]))
    prepared = [prepare(model, _batch("kto", mb), objective) for mb in shares]
    return sum(p.kl_sum for p in prepared) / sum(p.kl_rows for p in prepared)
