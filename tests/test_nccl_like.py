"""The test backend behaves as NCCL does where a CPU test can see it, and train/ reads through it what NCCL writes.

Two ranks spawned on this machine with ``UGRO_NCCL_LIKE=1`` (train/dist/nccl_like.py). First the backend's own
contract: a collective's future is complete when it is queued while its result lands only at ``work.wait()``; two
neighbours that each send first wait on each other until the timeout, where one batch of the send and the receive
goes through; a lost peer hangs a collective until the group is aborted. Then what train/ does on it: the step's
token total and compute times are every rank's (``exchange``), and a wait on a collective whose peer is gone ends as
soon as the group is declared broken, not at the collective timeout and not with the rank's own figures.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from train.balance.step import StepClock, exchange
from train.dist import comm, nccl_like
from train.dist.health import GroupHealth, GroupLost


def _init(rank: int, port: int, timeout_s: float = 30) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    os.environ[nccl_like.ENV] = "1"
    backend = nccl_like.install()
    assert backend == nccl_like.NAME
    dist.init_process_group(backend, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout_s))


def _completion(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    value = torch.tensor([rank + 1.0])
    work = dist.all_reduce(value, async_op=True)
    assert work is not None
    seen = [work.get_future().done(), float(work.get_future().value()[0]), float(value)]
    # A future made by hand that passes the result on, as the watcher did: complete, and the result is not there.
    by_hand: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    work.get_future().add_done_callback(lambda f: by_hand.set_result(f.value()))
    seen.append(float(by_hand.wait()[0]))
    work.wait()
    seen.append(float(value))
    if rank == 0:
        Path(out).write_text(repr(seen))
    dist.barrier()
    dist.destroy_process_group()


def test_a_result_lands_at_the_works_wait_not_when_its_future_completes(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    out = tmp_path / "seen"
    spawn(_completion, 2, str(out))
    # Complete at once, rank 0's own 1.0 read through the future, the future by hand and the tensor; 3.0 after wait.
    assert out.read_text() == repr([True, 1.0, 1.0, 1.0, 3.0])


def _neighbours(rank: int, port: int, out: str) -> None:
    _init(rank, port, timeout_s=3)
    peer = 1 - rank
    hidden = torch.full((64, 16), float(rank))  # 4 KiB: more than a send completes without its receive
    received = torch.empty(64, 16)
    for work in comm.exchange(sends=[(hidden, peer)], receives=[(received, peer)]):
        work.wait()
    batched = float(received[0, 0])
    started = time.monotonic()
    try:
        dist.isend(hidden, peer)  # each neighbour queues its send first, as the 1F1B loop did
        dist.recv(received, peer)
        outcome = "both went through"
    except dist.DistBackendError as exc:
        outcome = f"after {time.monotonic() - started:.0f} s: {exc}"
    Path(out).with_suffix(f".{rank}").write_text(f"{batched}\n{outcome}")


def test_neighbours_that_both_send_first_wait_on_each_other_and_one_batch_goes_through(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    out = tmp_path / "p2p"
    spawn(_neighbours, 2, str(out))
    for rank in (0, 1):
        batched, outcome = out.with_suffix(f".{rank}").read_text().splitlines()
        assert float(batched) == float(1 - rank)
        assert outcome.startswith("after 3 s: ") and "timed out" in outcome, outcome


def _lost_peer(rank: int, port: int, out: str) -> None:
    _init(rank, port, timeout_s=60)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # the host is gone: gloo underneath hears a reset, NCCL would not
    time.sleep(0.5)
    value = torch.ones(1)
    work = dist.all_reduce(value, async_op=True)
    assert work is not None
    time.sleep(2.0)
    hung = not work.is_completed()  # still waiting: no error reached the rank
    group = dist.group.WORLD
    threading.Timer(0.5, group.abort).start()  # as NCCL's watchdog (or ugro's watcher) aborts the communicator
    started = time.monotonic()
    try:
        work.wait()
        outcome = "returned"
    except dist.DistBackendError as exc:
        outcome = f"raised after {time.monotonic() - started:.1f} s: {exc}"
    Path(out).write_text(f"{hung}\n{outcome}")


def test_a_lost_peer_hangs_a_collective_until_the_group_is_aborted(tmp_path: Path, spawn: Callable[..., None]) -> None:
    out = tmp_path / "lost"
    spawn(_lost_peer, 2, str(out))
    hung, outcome = out.read_text().splitlines()
    assert hung == "True"
    assert outcome.startswith("raised after 0.") and "aborted" in outcome, outcome


def _step_totals(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    clock = type("Clock", (StepClock,), {"last_compute_s": 1.0 + rank})()  # this rank's last step took 1 or 2 s
    clock.last_tokens = 100 * (rank + 1)
    total = exchange(10 * (rank + 1), clock)
    Path(out).with_suffix(f".{rank}").write_text(repr((total, clock.gathered, clock.gathered_tokens)))
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_plans_with_every_ranks_tokens_and_times(tmp_path: Path, spawn: Callable[..., None]) -> None:
    """The step's token total (the loss scale), compute times and tokens are the sums NCCL wrote, on every rank."""
    out = tmp_path / "totals"
    spawn(_step_totals, 2, str(out))
    for rank in (0, 1):
        assert out.with_suffix(f".{rank}").read_text() == repr((30, [1.0, 2.0], [100.0, 200.0]))


def _broken_wait(rank: int, port: int, out: str, run_dir: str) -> None:
    _init(rank, port, timeout_s=60)
    health = GroupHealth()
    health.watched = True  # as a rank's membership sets it where several hosts run
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
        os._exit(0)
    value = torch.ones(1)
    threading.Timer(2.0, health.fail, args=("the controller named a new membership",)).start()
    started = time.monotonic()
    try:
        health.wait(dist.all_reduce(value, async_op=True))
        outcome = f"read {float(value)}"
    except GroupLost as exc:
        outcome = f"GroupLost after {time.monotonic() - started:.0f} s: {exc}"
    Path(out).write_text(outcome)


def test_a_wait_on_a_lost_peer_ends_when_the_group_is_declared_broken(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    """Not with this rank's own figure at once (the watcher's hand-made future), not at the collective timeout."""
    out = tmp_path / "broken"
    for host in ("h0", "h1"):
        (tmp_path / "run" / "hosts" / host).mkdir(parents=True)
    spawn(_broken_wait, 2, str(out), str(tmp_path / "run"))
    outcome = out.read_text()
    assert outcome.startswith(("GroupLost after 1 s", "GroupLost after 2 s")), outcome
    assert "new membership" in outcome


@pytest.fixture(autouse=True)
def _spawned_ranks_use_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nccl_like.ENV, "1")
