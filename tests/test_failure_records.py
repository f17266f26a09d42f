"""Every ending of a rank is recorded with its cause, and a lost peer is noticed in bounded time.

Real torchrun on this machine (2 ranks, gloo); the faults are real signals to real rank processes.
The recovery policy (which failure is the cause, who is left out) is tested on recorded states.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import PYTHON, REPO, run_env, write_job

from train.config import ConfigError
from train.dist.comm import BrokenGroup
from train.dist.health import GroupLost
from train.metrics import read_metrics
from train.recovery.failure import NonFiniteError, Stopped, kind_of
from ugro.run import follow, recovery

HOST = os.uname().nodename


def _start(
    torchrun_cmd: Callable[..., list[str]], tmp_path: Path, **overrides: object
) -> tuple[subprocess.Popen[str], Path]:
    job = write_job(tmp_path / "job.yaml", train={"max_steps": 400, "global_batch_size": 4, "log_every": 50},
                    **overrides)  # type: ignore[arg-type]  # fmt: skip
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(torchrun_cmd(job, run_dir, nproc=2), cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):  # two steps done
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.2)
    return proc, run_dir


def _records(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "hosts" / HOST / "failures.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_frozen_peer_is_noticed_within_the_collective_timeout_and_recorded(
    tmp_path: Path, torchrun_cmd: Callable[..., list[str]]
) -> None:
    proc, run_dir = _start(torchrun_cmd, tmp_path, distributed={"timeout_s": 5})
    frozen = int((run_dir / "hosts" / HOST / "worker-rank1.pid").read_text().split()[0])  # "pid start"
    os.kill(frozen, signal.SIGSTOP)  # alive, holding its sockets open, answering nothing: a hung peer
    began = time.monotonic()
    try:
        deadline = began + 90
        while not any(r["rank"] == 0 for r in _records(run_dir)):
            assert time.monotonic() < deadline, "rank 0 still waits for its frozen peer after 90 s"
            time.sleep(0.2)
        noticed = time.monotonic() - began
    finally:
        os.kill(frozen, signal.SIGCONT)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    first = next(r for r in _records(run_dir) if r["rank"] == 0)
    assert first["kind"] == "collective", first
    assert first["host"] == HOST and isinstance(first["step"], int) and first["step"] >= 1
    assert noticed < 60, f"the lost peer was noticed after {noticed:.0f} s (timeout_s 5)"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["state"] == "failed" and record["cause"]["kind"] == "collective", record
    assert proc.returncode != 0


def test_a_peer_that_never_joins_a_collective_fails_the_step_it_is_never_applied(
    tmp_path: Path, torchrun_cmd: Callable[..., list[str]]
) -> None:
    """Rank 1 stays alive but does not join step 3's exchange (tests/fixtures/faulty_worker.py UGRO_TEST_STALL). As on
    NCCL, the watchdog ends rank 0's wait at the timeout with NaN in the buffer (the test backend's) and no error: the
    rank asks the group's recorded error before it reads (train/dist/comm.py ``failure``) and records a failed
    collective naming the timeout, not a bad token count from NaN, and step 3 is never applied. (Stalled in the
    gradient all-reduce instead, the step's loss all-reduce that follows is refused on the aborted communicator.)"""
    job = write_job(tmp_path / "job.yaml", train={"max_steps": 6, "global_batch_size": 4, "log_every": 1},
                    distributed={"timeout_s": 5}, checkpoint={"every": 100})  # fmt: skip
    run_dir = tmp_path / "run"
    argv = [("tests.fixtures.faulty_worker" if part == "train.worker" else part)
            for part in torchrun_cmd(job, run_dir, nproc=2)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, env=run_env() | {"UGRO_TEST_STALL": "1:3:25:exchange"},
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    first = next((r for r in _records(run_dir) if r["rank"] == 0), None)
    logs = "".join(f"--- {p.name}:\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert first is not None and first["kind"] == "collective", f"{first}\n{logs}"
    assert "timed out" in str(first["message"]), first
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2], logs
    assert done.returncode != 0


def test_a_stopped_run_records_stopped_on_every_rank(tmp_path: Path, torchrun_cmd: Callable[..., list[str]]) -> None:
    proc, run_dir = _start(torchrun_cmd, tmp_path)
    os.kill(proc.pid, signal.SIGTERM)  # what `make stop` sends torchrun (through the launch script)
    out, _ = proc.communicate(timeout=120)
    kinds = {r["rank"]: r["kind"] for r in _records(run_dir)}
    logs = "".join(f"--- {p.name}:\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert kinds == {0: "stopped", 1: "stopped"}, f"{kinds}\n{logs}--- torchrun:\n{out[-3000:]}"
    assert json.loads((run_dir / "run.json").read_text())["state"] == "stopped"


WAITS_FOR_A_PEER = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from train.dist.health import GroupHealth
from train.recovery import failure
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
failure.stop_on_signals()
if rank == 1:
    time.sleep(120)  # never joins the collective, as a peer that a stop already ended
print("waiting", flush=True)
try:
    GroupHealth().wait(dist.all_reduce(torch.zeros(1), async_op=True))
except failure.Stopped as exc:
    print(f"stopped: {exc}", flush=True)
    os._exit(0)  # the pending collective would hold the process group's shutdown
"""


def test_a_rank_waiting_in_a_collective_turns_a_stop_into_its_record_at_once(tmp_path: Path) -> None:
    """SIGTERM reaches a rank while it waits for a peer in a collective (make stop ends the peer first, or under
    load later): the rank raises Stopped within seconds, so it records the stop, instead of waiting until the peer's
    exit fails the collective, the collective timeout, or torchrun's kill after its grace period."""
    argv = [[PYTHON, "-c", WAITS_FOR_A_PEER, str(rank), str(tmp_path / "store")] for rank in (0, 1)]
    ranks = [subprocess.Popen(a, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for a in argv]  # fmt: skip
    try:
        assert ranks[0].stdout is not None and ranks[0].stdout.readline().strip() == "waiting"
        time.sleep(1.0)  # in the wait by now
        sent = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        out, _ = ranks[0].communicate(timeout=30)
        assert "stopped: SIGTERM received" in out and time.monotonic() - sent < 10, out
    finally:
        for proc in ranks:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (MemoryError(), "oom"),
        (dist.DistBackendError("NCCL communicator was aborted"), "collective"),
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), "collective"),
        (RuntimeError("Timed out waiting 5000ms for recv operation to complete"), "collective"),
        # The group declared broken (a peer the heartbeat lost, a membership that left this host out): a consequence of
        # another host's fault, never the root cause the controller names (ugro/run/recovery.py root_cause).
        (GroupLost("tb1 stopped answering the heartbeat"), "collective"),
        (GroupLost("no regroup store is known for the new main host tb3"), "collective"),
        (BrokenGroup("the group was declared broken"), "collective"),
        (ConfigError("jobs/x.yaml, line 3: key 'lr' must be > 0"), "config"),
        (NonFiniteError("step 4: loss=nan"), "non_finite"),
        (Stopped("SIGTERM received"), "stopped"),
        (ValueError("something else"), "error"),
    ],
)
def test_each_exception_gets_its_kind(exc: BaseException, kind: str) -> None:
    assert kind_of(exc) == kind


def _status(state: str, failures: list[dict[str, object]] | None = None, ranks: list[int] | None = None) -> dict:
    return {"state": state, "failures": failures or [], "ranks": ranks or []}


def test_the_cause_is_the_first_failure_not_its_consequences() -> None:
    hosts = ["a", "b", "c"]
    peer_lost = {"kind": "collective", "message": "Connection closed by peer", "rank": 0, "host": "a", "time": 1.0}
    oom = {"kind": "oom", "message": "CUDA out of memory", "rank": 2, "host": "c", "time": 2.0}
    statuses = {"a": _status("failed", [peer_lost], [0]), "b": _status("running"), "c": _status("failed", [oom], [2])}
    assert recovery.root_cause(statuses, hosts, []) == recovery.Cause("oom", "CUDA out of memory", "c", 2)
    # A rank that left no record on a failed host is the cause, before its peers' collective errors.
    statuses = {"a": _status("failed", [peer_lost], [0]), "b": _status("failed", [], [1]), "c": _status("running")}
    cause = recovery.root_cause(statuses, hosts, [])
    assert (cause.kind, cause.host, cause.rank) == ("vanished", "b", 1) if cause else False
    assert recovery.blamed(statuses, hosts, []) == []  # its launcher lives: restarted in place
    # A host whose every process vanished, and one that stopped answering, are left out of the relaunch.
    statuses = {"a": _status("running"), "b": _status("lost"), "c": {"state": "unreachable", "error": "timeout"}}
    assert recovery.root_cause(statuses, hosts, ["c"]).kind == "unreachable"  # type: ignore[union-attr]
    assert recovery.blamed(statuses, hosts, ["c"]) == ["b", "c"]
    assert recovery.main_host_for(["b", "c"], "a") == "b" and recovery.main_host_for(["a", "c"], "a") == "a"


def test_one_silent_poll_is_not_a_fault_two_are() -> None:
    watch = recovery.Watch(["a", "b"])
    running = {"a": _status("running"), "b": _status("running")}
    silent = {"a": _status("running"), "b": {"state": "unreachable", "error": "timeout"}}
    for statuses, verdict in [(running, "running"), (silent, "running"), (running, "running"), (silent, "running"),
                              (silent, "fault")]:  # fmt: skip
        watch.note(statuses)
        assert watch.verdict(statuses) == verdict
    # `make stop` ends every host: stopped, not a fault, once every host has ended.
    watch = recovery.Watch(["a", "b"])
    stopping = {"a": _status("stopped"), "b": _status("running")}
    watch.note(stopping)
    assert watch.verdict(stopping) == "running"
    assert watch.verdict({"a": _status("stopped"), "b": _status("failed")}) == "stopped"


def test_one_silent_poll_is_a_fault_when_the_hosts_that_answer_cannot_reach_it_either() -> None:
    watch = recovery.Watch(["a", "b", "c"])
    cut = {"state": "unreachable", "error": "timeout"}
    vouch = {"a": _status("running") | {"silent_peers": ["b"]}, "b": cut, "c": _status("running")}
    watch.note(vouch)
    assert watch.unreachable() == ["b"] and watch.verdict(vouch) == "fault"
    # Peers that cannot reach a host that answers the controller: not a fault (their own link, or a slow host).
    watch = recovery.Watch(["a", "b", "c"])
    answers = vouch | {"b": _status("running")}
    watch.note(answers)
    assert watch.unreachable() == [] and watch.verdict(answers) == "running"
    # A silent host nobody vouches for still needs a second silent poll; the silent host's own word counts for
    # nothing (it did not answer).
    watch = recovery.Watch(["a", "b"])
    alone = {"a": _status("running"), "b": cut | {"silent_peers": ["a"]}}
    watch.note(alone)
    assert watch.unreachable() == [] and watch.verdict(alone) == "running"


def test_a_host_that_stops_answering_is_asked_again_at_once_but_only_once() -> None:
    """The poll that saw the silence already waited out its timeout; the next one decides (vouched or not), and a
    host that stays silent does not turn the follow into a busy loop of playbooks."""
    cut = {"state": "unreachable", "error": "timeout"}
    running = {"a": _status("running"), "b": _status("running")}
    pacer = follow.Pacer(2.0)
    waits = [pacer.pause(statuses) for statuses in (running, running | {"b": cut}, running | {"b": cut},
                                                     running, running | {"b": cut}, {"a": cut, "b": cut})]  # fmt: skip
    assert waits == [2.0, 0.0, 2.0, 2.0, 0.0, 0.0]


def test_while_the_ranks_start_a_remote_cluster_is_polled_less_often() -> None:
    """Until the first step a poll through Ansible has nothing to show and takes the starting ranks' CPU; a step, a
    failed start or a silent host brings the usual pace back, and polls that read the exporters keep it."""
    starting = {"a": _status("running"), "b": _status("running")}
    stepping = starting | {"a": _status("running") | {"step": 1}}
    pacer = follow.Pacer(2.0, start_s=follow.START_POLL_S)
    waits = [pacer.pause(statuses) for statuses in (starting, starting | {"b": _status("failed")}, stepping,
                                                     starting | {"b": {"state": "unreachable"}})]  # fmt: skip
    assert waits == [follow.START_POLL_S, 2.0, 2.0, 0.0]
    assert follow.Pacer(10.0, start_s=follow.START_POLL_S).pause(starting) == 10.0
    assert follow.Pacer(2.0, start_s=follow.START_POLL_S, costly=lambda: False).pause(starting) == 2.0


def _alive(parts: dict[str, str] | None = None) -> dict:
    return _status("running") | {"pids": {"launcher": 10, "worker-rank0": 11}, "parts": parts or {}}


def test_the_survivors_of_a_lost_host_regroup_unless_the_fault_needs_a_relaunch() -> None:
    hosts = ["a", "b", "c"]
    whole = {"0": "the whole model"}
    statuses = {"a": _alive(whole), "b": _status("lost"), "c": _alive(whole)}
    assert recovery.regroup_survivors(statuses, hosts, "a", ["b"]) == ["a", "c"]
    # The main host gone: the survivors go on, and the first of them takes up the run's records.
    assert recovery.regroup_survivors(statuses, hosts, "b", ["b"]) == ["a", "c"]
    assert recovery.main_host_for(["a", "c"], "b") == "a"
    # No host gone (a rank crashed on a host that stays up: restarted in place), a survivor whose job is not
    # whole, or pipeline stages: a relaunch.
    assert recovery.regroup_survivors(statuses, hosts, "a", []) is None
    half = statuses | {"c": _status("running") | {"pids": {"launcher": 10}}}
    assert recovery.regroup_survivors(half, hosts, "a", ["b"]) is None
    staged = statuses | {"c": _alive({"2": "stage 2/2 of replica 0, layers 4-7"})}
    assert recovery.regroup_survivors(staged, hosts, "a", ["b"]) is None


def test_after_a_regroup_the_run_is_finished_once_the_main_rank_says_so_and_no_rank_runs() -> None:
    """The survivors' torchrun agents wait at their exit barrier for the lost host's agent: only their launchers
    are left, and the controller must not wait for them."""
    watch = recovery.Watch(["a", "c"], main="a", regrouped=True)
    agents_only = {"a": _status("running") | {"pids": {"launcher": 10}, "run_state": "finished"},
                   "c": _status("running") | {"pids": {"launcher": 12}}}  # fmt: skip
    assert watch.verdict(agents_only) == "finished"
    ranks_left = agents_only | {"c": _status("running") | {"pids": {"launcher": 12, "worker-rank1": 13}}}
    assert watch.verdict(ranks_left) == "running"
    assert recovery.Watch(["a", "c"], main="a").verdict(agents_only) == "running"  # no regroup: torchrun ends


def test_a_host_whose_crashed_ranks_come_back_is_left_out_until_they_do_then_taken_back_in() -> None:
    """Its launcher runs and notes the rejoin (ugro/module_utils/ugro_jobstate.py ``rejoining``): a fault whose
    cause is the crash, the others regroup without it (no relaunch), and the ranks' record of taking it back in
    becomes a restart that does not count against train.max_restarts."""
    hosts = ["a", "b", "c"]
    whole = {"0": "the whole model"}
    note = {"why": "rank 2 killed by signal 9", "rejoin": 1, "of": 2, "attempt": 0}
    statuses = {"a": _alive(whole), "b": _alive(whole),
                "c": _status("running") | {"pids": {"launcher": 10}, "rejoining": note}}  # fmt: skip
    assert recovery.rejoining(statuses, hosts) == ["c"]
    assert recovery.Watch(hosts, main="a").verdict(statuses) == "fault"
    cause = recovery.root_cause(statuses, hosts, [])
    assert cause is not None and (cause.kind, cause.host) == ("crashed", "c")
    assert "rank 2 killed by signal 9" in cause.message
    assert recovery.blamed(statuses, hosts, []) == []  # not left out of a later relaunch
    assert recovery.regroup_survivors(statuses, hosts, "a", ["c"]) == ["a", "b"]
    back = {"generation": 2, "attempt": 0, "from_step": 11, "seconds": 0.9, "hosts": ["a", "b", "c"], "main": "a",
            "decided_by": "rejoin", "time": 1_800_000_000.0, "cause": "c came back"}  # fmt: skip
    after = {"a": _alive(whole) | {"regroups": [back]}, "b": _alive(whole), "c": _alive(whole)}
    assert recovery.rejoining(after, hosts) == []
    # A controller that takes the run up only now, with no answer from the main host, finds the regroup before the
    # rejoin in any rank's status file (its ``earlier`` regroups).
    left = {"generation": 1, "attempt": 0, "from_step": 9, "hosts": ["a", "b"], "main": "a", "decided_by": "survivors"}
    ranks_only = {"b": _alive(whole) | {"rank_regrouped": back | {"earlier": [left]}}}
    assert [r["generation"] for r in recovery.survivors_regroups(ranks_only, attempt=0, generation=0)] == [1, 2]
    restarts, (members, main, generation) = recovery.adopted(
        recovery.survivors_regroups(after, attempt=0, generation=1), ["a", "b"], hosts, restarts_before=1
    )
    assert (members, main, generation) == (["a", "b", "c"], "a", 2)
    assert (restarts[0].cause.kind, restarts[0].cause.host, restarts[0].decided_by) == ("rejoined", "c", "rejoin")
    assert "-> taken back in on a, b, c from step 11 (0 steps redone)" in restarts[0].line()


STOPPED_IN_A_CALLBACK = """
import os, signal, sys, time
from pathlib import Path
import torch
from train.recovery import failure
signals = failure.stop_on_signals()

def landed(_):  # as DDP's communication hook waits on its work, in the thread that completed the future
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)

queued = torch.futures.Future()
chained = queued.then(landed)
queued.set_result(None)
try:
    chained.wait()
except (Exception, failure.Stopped) as exc:
    print(type(exc).__name__, flush=True)
    failure.record(Path(sys.argv[1]), exc, "vm", 0, 3, signals)
"""


def test_a_stop_during_a_futures_callback_is_recorded_as_a_stop(tmp_path: Path) -> None:
    """SIGTERM while the rank runs a future's callback (DDP's hook waiting on its all-reduce): torch hands the
    handler's Stopped on as a RuntimeError; the record still says the rank was stopped, not that a peer was lost."""
    out = subprocess.run([PYTHON, "-c", STOPPED_IN_A_CALLBACK, str(tmp_path)], cwd=REPO, env=run_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    assert out.strip() == "RuntimeError", out  # what torch raises for the callback's Stopped
    records = [json.loads(line) for line in (tmp_path / "hosts" / "vm" / "failures.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["message"]) for r in records] == [("stopped", "Stopped: SIGTERM received")], records
