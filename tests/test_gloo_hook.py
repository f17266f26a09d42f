"""DDP's gradient all-reduce on plain gloo (CPU hosts), where nothing aborts a pending collective: a peer that stops
answering (its link cut, its machine frozen) sends no reset, and DDP waits on its hook's future in C++ where no signal
or Python check reaches it. So the hook's future ends as soon as the group is declared broken (the heartbeat, the
controller's word), and a collective that fails is never handed on as a reduced gradient."""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from train.dist import distributed
from train.dist.distributed import RankInfo
from train.dist.health import GroupHealth


def _ddp_step(rank: int, port: int, out: str, timeout_s: float, break_after_s: float | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    os.environ.pop("UGRO_NCCL_LIKE", None)  # plain gloo, as on a CPU host
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout_s))
    info = RankInfo(rank, 0, 2, f"h{rank}", torch.device("cpu"), 0, ("h0", "h1"))
    health = GroupHealth()
    health.watched = True
    model = torch.nn.Linear(4, 1)
    ddp = distributed.wrap(model, info, health=health)
    dist.barrier()
    if rank == 1:  # answers nothing and resets nothing (a frozen host, a cut link) until rank 0 has its answer
        deadline = time.monotonic() + timeout_s + 5
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    if break_after_s is not None:
        threading.Timer(break_after_s, health.fail, args=("cannot reach the regroup store of h1",)).start()
    started = time.monotonic()
    try:
        ddp(torch.ones(2, 4)).sum().backward()
        outcome = f"returned after {time.monotonic() - started:.0f} s"
    except Exception as exc:  # what ended the wait is the test's answer
        outcome = f"{type(exc).__name__} after {time.monotonic() - started:.0f} s: {str(exc).splitlines()[0]}"
    Path(out).write_text(outcome)
    os._exit(0)  # the pending collective would hold the process group's shutdown


def test_a_broken_group_ends_ddps_wait_on_plain_gloo_at_once(tmp_path: Path, spawn: Callable[..., None]) -> None:
    """Declared broken 1 s into the wait: the backward ends then, not at the 60-s collective timeout."""
    out = tmp_path / "outcome"
    spawn(_ddp_step, 2, str(out), 60.0, 1.0)
    outcome = out.read_text()
    assert outcome.startswith(("RuntimeError after 1 s", "RuntimeError after 2 s")), outcome
    assert "cannot reach the regroup store of h1" in outcome, outcome


def test_a_failed_all_reduce_is_not_handed_on_as_a_reduced_gradient(tmp_path: Path, spawn: Callable[..., None]) -> None:
    """gloo's all-reduce times out (nobody declared the group broken): the backward raises, it does not return with
    this rank's own gradient as if it were the sum."""
    out = tmp_path / "outcome"
    spawn(_ddp_step, 2, str(out), 3.0, None)
    outcome = out.read_text()
    assert outcome.startswith("RuntimeError after"), outcome
