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
import json
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
    # The buffer changed between queueing and the wait: a race on NCCL, whose kernel reads it when it runs.
    reused = dist.all_reduce(value, async_op=True)
    value.add_(1.0)
    try:
        reused.wait()
        seen.append("read")
    except RuntimeError as exc:
        seen.append("refused" if "changed after the collective was queued" in str(exc) else str(exc))
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
    # A buffer changed before the wait is refused.
    assert out.read_text() == repr([True, 1.0, 1.0, 1.0, 3.0, "refused"])


def _neighbours(rank: int, port: int, out: str) -> None:
    _init(rank, port, timeout_s=3)
    peer = 1 - rank
    hidden = torch.full((64, 16), float(rank))  # 4 KiB: more than a send completes without its receive
    received = torch.empty(64, 16)
    for work in comm.exchange(sends=[(hidden, peer)], receives=[(received, peer)]):
        work.wait()
    batched = float(received[0, 0])
    started = time.monotonic()
    dist.isend(hidden, peer)  # each neighbour queues its send first, as the 1F1B loop did
    dist.recv(received, peer)  # returns when the watchdog ends it, as NCCL's host read does
    outcome = f"after {time.monotonic() - started:.0f} s: read {float(received[0, 0])}; {comm.failure()}"
    Path(out).with_suffix(f".{rank}").write_text(f"{batched}\n{outcome}")


def test_neighbours_that_both_send_first_wait_on_each_other_and_one_batch_goes_through(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    out = tmp_path / "p2p"
    spawn(_neighbours, 2, str(out))
    for rank in (0, 1):
        batched, outcome = out.with_suffix(f".{rank}").read_text().splitlines()
        assert float(batched) == float(1 - rank)
        # The watchdog ended the receive at the timeout: the buffer holds NaN, the group says TIMEOUT.
        assert outcome.startswith("after 3 s: read nan; ") and "TIMEOUT" in outcome, outcome


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
    threading.Timer(0.5, group.abort).start()  # as ugro's watcher aborts the communicator
    started = time.monotonic()
    work.wait()  # returns once aborted, as NCCL's stream wait and host read do: no error, no result
    outcome = f"returned after {time.monotonic() - started:.1f} s holding {float(value)}"
    try:
        work.wait(datetime.timedelta(seconds=5))  # NCCL's blocking wait raises for an aborted communicator
    except dist.DistBackendError as exc:
        outcome += f"; a blocking wait raised: {exc}"
    Path(out).write_text(f"{hung}\n{outcome}")


def test_a_lost_peer_hangs_a_collective_until_the_group_is_aborted(tmp_path: Path, spawn: Callable[..., None]) -> None:
    out = tmp_path / "lost"
    spawn(_lost_peer, 2, str(out))
    hung, outcome = out.read_text().splitlines()
    assert hung == "True"
    assert outcome.startswith("returned after 0.") and "holding nan" in outcome, outcome
    assert "a blocking wait raised" in outcome and "aborted" in outcome, outcome


def _never_joins(rank: int, port: int, out: str) -> None:
    """Rank 1 is alive (its store answers, its heartbeat would beat) but never joins the collective."""
    _init(rank, port, timeout_s=2)
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    value = torch.full((4,), 3.0)
    work = dist.all_reduce(value, async_op=True)
    started = time.monotonic()
    handed = comm.then(work, lambda: value.tolist())  # as DDP's hook: its future's value becomes the gradients
    seen = [f"the hook handed on {handed.wait()} after {time.monotonic() - started:.0f} s"]
    work.wait()
    seen.append(f"a wait returned holding {value.tolist()}")
    try:
        comm.result(None, lambda: None)
        seen.append("comm.result took it for a result")
    except comm.CollectiveFailed as exc:
        seen.append(f"comm.result: CollectiveFailed: {exc}")
    try:
        GroupHealth().committable(torch.device("cpu"))
        seen.append("the step committed")
    except comm.CollectiveFailed as exc:
        seen.append(f"commit point: {type(exc).__name__}")
    Path(out).write_text("\n".join(seen))
    os._exit(0)  # the aborted group's threads: nothing left to shut down


def test_a_collective_the_watchdog_ended_is_never_read_as_a_result(tmp_path: Path, spawn: Callable[..., None]) -> None:
    """As NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=2): at the timeout the watchdog records TIMEOUT in the group and aborts
    it, and a wait without timeout returns with whatever the buffer held; only the group's recorded error tells."""
    out = tmp_path / "never"
    spawn(_never_joins, 2, str(out))
    hook, wait, result, commit = out.read_text().splitlines()
    assert hook == "the hook handed on [nan, nan, nan, nan] after 2 s", hook
    assert wait == "a wait returned holding [nan, nan, nan, nan]", wait
    assert result.startswith("comm.result: CollectiveFailed: ") and "TIMEOUT" in result, result
    assert commit == "commit point: CollectiveFailed", commit


def _two_hung(rank: int, port: int, out: str) -> None:
    """A hung collective on a subgroup (a pipeline's gradient sync) and on the default group, then the group fails."""
    _init(rank, port, timeout_s=20)
    subgroup = dist.new_group([0, 1])
    if rank == 1:
        time.sleep(6)  # alive, never joins either collective
        os._exit(0)
    waits = [
        dist.all_reduce(torch.ones(1), group=subgroup, async_op=True),
        dist.all_reduce(torch.ones(1), async_op=True),
    ]
    health = GroupHealth()
    health.watched = True
    started = time.monotonic()
    health.fail("a peer was lost")  # from the watcher's thread in a rank: here on the rank's own
    seen = f"fail returned after {time.monotonic() - started:.0f} s"
    for work in waits:
        work.wait()
    Path(out).write_text(f"{seen}; waits returned after {time.monotonic() - started:.0f} s")
    os._exit(0)


def test_the_aborts_of_several_hung_communicators_do_not_wait_on_each_other(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    """``ncclCommAbort`` of one communicator waits while another has a hung kernel (pytorch#119797): aborted one after
    another, a rank that lost a peer would wait until the other's collective ends (here when the peer exits, after 6 s)
    or its watchdog's timeout (20 s). In one group call, as torch's
    ``_abort_process_group`` makes them (train/dist/comm.py ``abort_all``), every wait ends at once."""
    out = tmp_path / "hung"
    spawn(_two_hung, 2, str(out))
    assert out.read_text() == "fail returned after 0 s; waits returned after 0 s"


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


def test_the_gpu_benchs_multirank_part_runs_dry_on_cpu_and_says_what_a_gpu_would_show(tmp_path: Path) -> None:
    """`python -m bench.gpu OUT multirank` on a machine without CUDA: three ranks on the NCCL-like backend (the step's
    exchange, a hook's average, a collective the watchdog ended refused), and what the GPU parts would show."""
    import subprocess

    from helpers import PYTHON, REPO, run_env

    done = subprocess.run([PYTHON, "-m", "bench.gpu", str(tmp_path), "multirank"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "gpu.jsonl").read_text().splitlines()[-1])
    assert record["dry"] is True and set(record["not_run"]) == {"stream", "hook", "ranks"}, record
    ranks = record["results"]["ranks"]
    assert [r["exchange_tokens"] for r in ranks] == [6, 6] and [r["hook_average"] for r in ranks] == [2.0, 2.0]
    assert all(r["watchdog"].startswith("refused, buffer [nan, nan]") and "TIMEOUT" in r["watchdog"] for r in ranks)
