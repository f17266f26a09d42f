"""DDP start-up (train/dist/distributed.py ``wrap``): every rank starts from rank 0's trainable weights, the frozen
base is never broadcast, gradients are still averaged, and ranks whose trainable parameters differ in layout
fail on every rank with one message naming the host; a DDP whose synchronization is off stops the first step."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from train.config import ConfigError
from train.dist import distributed
from train.dist.health import GroupHealth

WORLD = 2


class _Adapted(torch.nn.Module):
    """A frozen base layer, a trainable adapter, and a buffer, each filled with its rank's own values."""

    def __init__(self, rank: int, adapter_width: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(4, 4)
        self.base.requires_grad_(False)
        self.adapter = torch.nn.Linear(4, adapter_width, bias=False)
        self.register_buffer("table", torch.zeros(4))
        with torch.no_grad():
            self.base.weight.fill_(10.0 + rank)
            self.adapter.weight.fill_(1.0 + rank)
            self.table.fill_(float(rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.base(x) + self.table)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0",
        UGRO_HOST=f"host{rank}",
    )  # fmt: skip
    torch.set_num_threads(1)
    info, _ = distributed.init(timeout_s=60)
    model = _Adapted(rank)
    ddp = distributed.wrap(model, info)
    started = {"adapter": model.adapter.weight.detach().clone(), "base": model.base.weight.detach().clone()}
    started["table"] = model.table.detach().clone()
    ddp(torch.full((2, 4), float(rank + 1))).sum().backward()  # a different batch on every rank
    assert model.adapter.weight.grad is not None
    started["grad"] = model.adapter.weight.grad.detach().clone()
    distributed.check_gradients_agree(
        [model.adapter.weight], info, "hf", GroupHealth()
    )  # all-reduced: they agree, no error

    # A library that turns DDP's synchronization off (as unsloth once did): each rank keeps its own gradient.
    model.adapter.weight.grad = None
    ddp.require_backward_grad_sync = False
    ddp(torch.full((2, 4), float(rank + 1))).sum().backward()
    try:
        distributed.check_gradients_agree([model.adapter.weight], info, "unsloth", GroupHealth())
        started["unsynchronized"] = "no error"  # type: ignore[assignment]
    except ConfigError as exc:
        started["unsynchronized"] = str(exc)  # type: ignore[assignment]
    ddp.require_backward_grad_sync = True

    # Rank 1 built its adapter wider: one error, the same on every rank, and nobody left waiting.
    try:
        distributed.wrap(_Adapted(rank, adapter_width=8 if rank == 1 else 4), info)
        started["error"] = "no error"  # type: ignore[assignment]
    except ConfigError as exc:
        started["error"] = str(exc)  # type: ignore[assignment]
    torch.save(started, Path(out, f"rank{rank}.pt"))
    # As a worker ends: wait for every rank, so none tears gloo down under a peer (which can abort it).
    distributed.wait_for_all("every rank has written its result", 60)
    distributed.shutdown()


@pytest.mark.parametrize("backend", ["nccl-like", "gloo"])
def test_ranks_start_from_rank_0s_trainable_weights_and_keep_their_own_base(
    tmp_path: Path, spawn: Callable[..., None], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the backend that behaves as NCCL does, and on plain gloo, which CPU hosts run: there the all-reduce's
    future completes on gloo's own thread, where the hook must not wait on the work (it would wait on itself)."""
    monkeypatch.setenv("UGRO_NCCL_LIKE", "1" if backend == "nccl-like" else "0")
    spawn(_rank, WORLD, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, seen in enumerate(ranks):
        assert torch.equal(seen["adapter"], torch.full((4, 4), 1.0)), (rank, seen["adapter"])  # rank 0's
        assert torch.equal(seen["base"], torch.full((4, 4), 10.0 + rank)), rank  # never broadcast
        assert torch.equal(seen["table"], torch.full((4,), float(rank))), rank  # buffers neither
        assert torch.equal(seen["grad"], ranks[0]["grad"]), rank  # DDP still averages the gradients
    assert not torch.equal(ranks[0]["grad"], torch.zeros(4, 4))
    refusal = ranks[0]["unsynchronized"]
    assert refusal == ranks[1]["unsynchronized"] and refusal.startswith("model.backend: unsloth: "), refusal
    assert "host0 (rank 0): " in refusal and "host1 (rank 1): " in refusal and "did not all-reduce" in refusal
    messages = {seen["error"] for seen in ranks}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "trainable parameters differ from host0's (rank 0: 1 tensors) on host1 (rank 1: 1 tensors)" in message
