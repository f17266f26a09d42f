"""The controller's follow loop (ugro/run/supervisor.py), one transition at a time: each state's method is driven
alone from a loop state built for it, with the playbooks scripted (a launch that succeeds or fails where, a follow
that ends with given job states, a regroup or a stop some host does not answer), and the next state, the loop's
hosts, counters and fault, the restarts recorded and the playbooks asked for are checked. The whole path with real
hosts and faults is tests/test_recovery.py (the test cluster)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import small_job
from rich.console import Console

from train.config import JobConfig
from ugro.hosts.inventory import Cluster
from ugro.hosts.playbook import PlaybookRun
from ugro.run.attach import Supervision
from ugro.run.follow import Pacer, Statuses
from ugro.run.records import Cause, Restart
from ugro.run.supervisor import Fault, LaunchError, Loop, State, Supervisor

HOSTS = ["h1", "h2", "h3"]
# A host whose ranks train (the whole model each), as its job state reads at a poll (ugro_jobstate.status).
WORKING = {"state": "running", "step": 7, "total_steps": 30, "loss": 2.5, "tokens_per_s": 900.0, "eta_s": 20.0,
           "pids": {"launcher": 10, "worker0": 11}, "parts": {"0": "the whole model"}}  # fmt: skip


def _launched(failures: dict[str, str] | None = None) -> PlaybookRun:
    status = "failed" if failures else "successful"
    return PlaybookRun(runner=SimpleNamespace(status=status), failures=dict(failures or {}))


class Scripted(Supervisor):
    """A supervisor whose playbooks and polls are scripted: every call is recorded in ``calls``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.calls: list[tuple[Any, ...]] = []
        self.launch_failures: list[dict[str, str]] = []  # one per launch, in order (none left: the launch succeeds)
        self.polls: list[Statuses] = []  # one follow's job states, poll after poll
        self.follows: list[list[Statuses]] = []  # the polls of the follows after this one
        self.regroup_unanswered: dict[str, str] = {}
        self.stop_unanswered: dict[str, str] = {}
        self.placed_step: int | None = 20

    def _launch(self, attempt: int, hosts: list[str], main: str, resume: bool) -> PlaybookRun:
        self.calls.append(("launch", attempt, list(hosts), main, resume))
        return _launched(self.launch_failures.pop(0) if self.launch_failures else None)

    def _source(self, hosts: list[str], main: str) -> tuple[Callable[[], Statuses], Pacer]:
        """The scripted polls of one follow, in order (the real follow and its verdicts run over them)."""
        self.calls.append(("follow", list(hosts), main))
        polls = iter(self.polls)
        self.polls = self.follows.pop(0) if self.follows else []

        def poll() -> Statuses:
            statuses = next(polls, None)
            assert statuses is not None, "polled past the script: the follow should have ended"
            return statuses

        return poll, Pacer(0.0)

    def _regroup(self, hosts: list[str], main: str, generation: int) -> dict[str, str]:
        self.calls.append(("regroup", list(hosts), main, generation))
        return dict(self.regroup_unanswered)

    def _stop(self, hosts: list[str], main: str) -> dict[str, str]:
        self.calls.append(("stop", list(hosts), main))
        return {h: m for h, m in self.stop_unanswered.items() if h in hosts}

    def place(self, hosts: list[str], main: str) -> tuple[int | None, dict[str, str]]:
        self.calls.append(("place", list(hosts), main))
        return self.placed_step, {}


def _supervisor(tmp_path: Path, **job: Any) -> tuple[Scripted, io.StringIO]:
    out = io.StringIO()
    supervisor = Scripted(
        JobConfig.model_validate(small_job(**job)), Cluster(list(HOSTS), "h1", remote=False),
        tmp_path / "inventory.yml", tmp_path / "runs" / "states-20270101-000000", {}, Console(file=out, width=250),
        poll_s=1.0,
    )  # fmt: skip
    supervisor.copies.place = supervisor.place  # type: ignore[method-assign]
    return supervisor, out


def _fault(kind: str = "lost", host: str = "h3", gone: list[str] | None = None, checkpoint: int | None = 5) -> Fault:
    return Fault(Cause(kind, "gone", host), ["h3"] if gone is None else gone, 1000.0, 7, checkpoint)


def _restart(how: str) -> Restart:
    return Restart(attempt=1, time=1.0, cause=Cause("lost", "gone", "h3"), hosts_before=list(HOSTS),
                   hosts_after=["h1", "h2"], left_out=["h3"], main_host="h1", checkpoint_step=5, last_step_seen=7,
                   how=how)  # fmt: skip


# -- begin --------------------------------------------------------------------------------------------------------


def test_a_new_run_begins_launching_on_every_host_and_a_resumed_one_places_its_checkpoint_first(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    loop = supervisor.begin(False)
    assert (loop.state, loop.hosts, loop.main, loop.attempt, loop.generation) == (State.LAUNCHING, HOSTS, "h1", 0, 0)
    assert supervisor.calls == []
    written = Supervision.read(supervisor.run_dir)  # the record a later `make follow` continues from
    assert written is not None and (written.hosts, written.main) == (HOSTS, "h1")
    resumed, _ = _supervisor(tmp_path / "resumed")
    assert resumed.begin(True).resume and resumed.calls == [("place", HOSTS, "h1")]


def test_an_attached_run_begins_following_from_its_record(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    relaunched, regrouped = _restart("relaunch"), _restart("regroup")
    record = Supervision(["h1", "h2"], "h2", [relaunched, regrouped], ["a copy failed"])
    loop = supervisor.begin(False, attached=record)
    assert (loop.state, loop.hosts, loop.main, loop.attempt, loop.generation) == (
        State.FOLLOWING, ["h1", "h2"], "h2", 1, 1,
    )  # fmt: skip
    assert supervisor.restarts == [relaunched, regrouped] and supervisor.copy_failures == ["a copy failed"]
    assert supervisor.calls == []  # neither launched nor placed: its ranks run


# -- launching ----------------------------------------------------------------------------------------------------


def test_the_first_launch_that_starts_goes_to_following_and_says_it_started_once(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    started: list[int] = []
    loop = Loop(list(HOSTS), "h1", on_started=lambda: started.append(1))
    assert supervisor.launching(loop) is State.FOLLOWING
    assert supervisor.calls == [("launch", 0, HOSTS, "h1", False)] and started == [1]
    assert supervisor.first_launch is not None
    # A relaunch resumes, times its launch into the restart it belongs to, and does not call on_started again.
    supervisor.restarts.append(_restart("relaunch"))
    loop.attempt = 1
    assert supervisor.launching(loop) is State.FOLLOWING
    assert supervisor.calls[-1] == ("launch", 1, HOSTS, "h1", True) and started == [1]
    assert supervisor.restarts[-1].launch_s is not None


def test_a_first_launch_that_fails_raises_and_a_failed_relaunch_is_a_fault_of_its_hosts(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    supervisor.launch_failures = [{"h2": "unreachable: ssh timed out\nmore"}]
    with pytest.raises(LaunchError) as raised:
        supervisor.launching(Loop(list(HOSTS), "h1"))
    assert raised.value.run.failures == {"h2": "unreachable: ssh timed out\nmore"}
    supervisor.launch_failures = [{"h2": "unreachable: ssh timed out\nmore"}]
    loop = Loop(list(HOSTS), "h1", attempt=1)
    assert supervisor.launching(loop) is State.REGROUPING
    assert loop.fault is not None
    assert (loop.fault.cause, loop.fault.gone, loop.fault.last_checkpoint) == (
        Cause("launch", "unreachable: ssh timed out", "h2"), ["h2"], None,
    )  # fmt: skip
    assert loop.statuses == {"h2": {"state": "unreachable", "error": "unreachable: ssh timed out\nmore"}}
    assert "failure: launch on h2: unreachable: ssh timed out" in out.getvalue()


# -- following ----------------------------------------------------------------------------------------------------


def test_a_run_that_finishes_or_is_stopped_ends_with_that_outcome(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    done = {h: {"state": "finished"} for h in HOSTS}
    supervisor.polls = [{h: dict(WORKING) for h in HOSTS}, done]
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert supervisor.following(loop) is State.FINISHED
    assert loop.outcome is not None and (loop.outcome.state, loop.outcome.hosts) == ("finished", HOSTS)
    assert [c[0] for c in supervisor.calls] == ["follow"]  # nothing to stop: no regroup left agents waiting
    stopped = {"h1": {"state": "stopped"}, "h2": {"state": "stopped"}, "h3": {"state": "finished"}}
    supervisor.polls = [stopped]
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert supervisor.following(loop) is State.FINISHED
    assert loop.outcome is not None and loop.outcome.state == "stopped"


def test_after_a_regroup_a_finished_run_stops_the_agents_that_wait_for_the_lost_host(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    waiting = {"state": "running", "run_state": "finished", "pids": {"launcher": 10}}
    supervisor.polls = [{"h1": dict(waiting), "h2": {"state": "running", "run_state": "finished"}}]
    loop = Loop(["h1", "h2"], "h1", state=State.FOLLOWING, generation=1)
    assert supervisor.following(loop) is State.FINISHED
    assert loop.outcome is not None and loop.outcome.state == "finished"
    assert supervisor.calls[-1] == ("stop", ["h1"], "h1")  # only where a process still runs


def test_a_lost_host_is_a_fault_with_its_cause_the_hosts_gone_and_the_main_hosts_checkpoint(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    main = dict(WORKING, step=12, last_checkpoint="/opt/ugro/runs/x/checkpoints/step-000010")
    supervisor.polls = [{h: dict(WORKING) for h in HOSTS}, {"h1": main, "h2": dict(WORKING), "h3": {"state": "lost"}}]
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert supervisor.following(loop) is State.REGROUPING
    assert loop.fault is not None and loop.outcome is None
    assert (loop.fault.cause.kind, loop.fault.cause.host, loop.fault.gone) == ("lost", "h3", ["h3"])
    assert (loop.fault.last_step, loop.fault.last_checkpoint) == (12, 10)
    assert loop.statuses["h3"] == {"state": "lost"}
    assert "failure: lost on h3" in out.getvalue()


def test_a_host_slow_to_answer_one_poll_is_not_left_out_with_a_lost_one(tmp_path: Path) -> None:
    """On a loaded controller a host that misses one poll (its answer came late) is not gone: where another host's job
    vanished, only that host is left out, and the one that missed a poll stays in the group. (Dropped with it, the main
    host h1 trained no more, and a later fault of its own had nothing to name.)"""
    supervisor, _ = _supervisor(tmp_path)
    supervisor.polls = [{h: dict(WORKING) for h in HOSTS}, {"h1": {"state": "unreachable", "error": "timed out"},
                                                            "h2": dict(WORKING), "h3": {"state": "lost"}}]  # fmt: skip
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert supervisor.following(loop) is State.REGROUPING
    assert loop.fault is not None and (loop.fault.cause.kind, loop.fault.cause.host, loop.fault.gone) == (
        "lost", "h3", ["h3"])  # fmt: skip
    # A host silent on the last poll is the fault where nothing else explains it (a cut link hangs its SSH session
    # while the others' collectives fail), and so is one its peers cannot reach either.
    alone, _ = _supervisor(tmp_path / "alone")
    failed = dict(WORKING, state="failed", pids={"launcher": 10})
    alone.polls = [{h: dict(WORKING) for h in HOSTS}, {"h1": {"state": "unreachable"}, "h2": failed, "h3": failed}]
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert alone.following(loop) is State.REGROUPING
    assert loop.fault is not None and loop.fault.gone == ["h1"] and loop.fault.cause.host == "h1", loop.fault
    vouched, _ = _supervisor(tmp_path / "vouched")
    peers = dict(WORKING, silent_peers=["h1"])
    gone: Statuses = {"h1": {"state": "unreachable"}, "h2": peers, "h3": {"state": "lost"}}
    vouched.polls = [{h: dict(WORKING) for h in HOSTS}, gone]
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert vouched.following(loop) is State.REGROUPING
    assert loop.fault is not None and loop.fault.gone == ["h1", "h3"], loop.fault


def test_regroups_the_ranks_agreed_on_themselves_are_adopted_and_followed(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    agreed = {"attempt": 0, "generation": 1, "hosts": ["h1", "h3"], "main": "h1", "from_step": 9, "time": 5.0}
    older = {"attempt": 0, "generation": 1, "hosts": ["h1"], "main": "h1"}  # an earlier launch's: not this one's
    supervisor.polls = [{"h1": dict(WORKING, rank_regrouped=agreed), "h2": {"state": "unreachable"},
                         "h3": dict(WORKING, regroups=[dict(older, attempt=3)])}]  # fmt: skip
    loop = Loop(list(HOSTS), "h1", state=State.FOLLOWING)
    assert supervisor.following(loop) is State.ADOPTING
    assert loop.agreed == [agreed] and loop.fault is None
    assert supervisor.adopting(loop) is State.FOLLOWING
    assert (loop.hosts, loop.main, loop.generation, loop.agreed) == (["h1", "h3"], "h1", 1, [])
    (restart,) = supervisor.restarts
    assert (restart.how, restart.decided_by, restart.hosts_after, restart.steps_redone) == (
        "regroup", "survivors", ["h1", "h3"], 0,
    )  # fmt: skip
    written = Supervision.read(supervisor.run_dir)
    assert written is not None and written.hosts == ["h1", "h3"] and written.generation == 1
    assert "regrouped by the survivors themselves" in out.getvalue()


def test_the_ranks_record_of_a_relaunchs_resume_settles_its_restart_while_following(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    supervisor.restarts.append(_restart("relaunch"))
    resumed = {"attempt": 1, "from_step": 5, "last_step_logged": 8}
    supervisor.polls = [{"h1": dict(WORKING, resumed=resumed), "h2": dict(WORKING)},
                        {h: {"state": "finished"} for h in ["h1", "h2"]}]  # fmt: skip
    loop = Loop(["h1", "h2"], "h1", state=State.FOLLOWING, attempt=1)
    assert supervisor.following(loop) is State.FINISHED
    restart = supervisor.restarts[-1]
    assert (restart.resumed_from_step, restart.steps_redone, restart.steps_redone_estimated) == (5, 3, False)


# -- regrouping ---------------------------------------------------------------------------------------------------


def _faulted(state: State, fault: Fault | None = None, generation: int = 0) -> Loop:
    statuses: Statuses = {"h1": dict(WORKING), "h2": dict(WORKING), "h3": {"state": "lost"}}
    return Loop(list(HOSTS), "h1", state=state, statuses=statuses, fault=fault or _fault(), generation=generation)


def test_the_survivors_of_a_lost_host_are_told_who_is_left_and_followed_without_a_relaunch(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    loop = _faulted(State.REGROUPING, generation=1)
    assert supervisor.regrouping(loop) is State.FOLLOWING
    assert supervisor.calls == [("regroup", ["h1", "h2"], "h1", 2)]
    assert (loop.hosts, loop.main, loop.attempt, loop.generation, loop.fault) == (["h1", "h2"], "h1", 0, 2, None)
    (restart,) = supervisor.restarts
    assert (restart.how, restart.hosts_before, restart.hosts_after, restart.left_out, restart.last_step_seen) == (
        "regroup", HOSTS, ["h1", "h2"], ["h3"], 7,
    )  # fmt: skip
    assert restart.membership_s is not None and restart.time == 1000.0
    assert "restart 1/3: the ranks on h1, h2 go on without h3 (no relaunch)" in out.getvalue()
    written = Supervision.read(supervisor.run_dir)
    assert written is not None and written.hosts == ["h1", "h2"]


def test_where_the_main_host_is_lost_the_first_survivor_keeps_the_records(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    statuses: Statuses = {"h1": {"state": "unreachable"}, "h2": dict(WORKING), "h3": dict(WORKING)}
    loop = Loop(list(HOSTS), "h1", state=State.REGROUPING, statuses=statuses, fault=_fault("unreachable", "h1", ["h1"]))
    assert supervisor.regrouping(loop) is State.FOLLOWING
    assert (loop.hosts, loop.main) == (["h2", "h3"], "h2")
    assert supervisor.calls == [("regroup", ["h2", "h3"], "h2", 1)]
    assert "h2 keeps the run's records now" in out.getvalue()


def test_a_host_whose_crashed_ranks_restart_is_left_out_until_they_are_back(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    crashed = {"state": "running", "rejoining": {"why": "rank 2 was killed"}, "pids": {"launcher": 30}}
    statuses: Statuses = {"h1": dict(WORKING), "h2": dict(WORKING), "h3": crashed}
    loop = Loop(list(HOSTS), "h1", state=State.REGROUPING, statuses=statuses, fault=_fault("crashed", gone=[]))
    assert supervisor.regrouping(loop) is State.FOLLOWING
    assert supervisor.calls == [("regroup", ["h1", "h2"], "h1", 1)]
    assert "h3 rejoins them once its ranks are up again" in out.getvalue()


@pytest.mark.parametrize(
    ("why", "change"),
    [
        ("regroups are off", lambda s, loop: setattr(s, "job", JobConfig.model_validate(
            small_job(distributed={"regroup_timeout_s": 0})))),
        ("a survivor does not run whole", lambda s, loop: loop.statuses.__setitem__("h2", {"state": "failed"})),
        ("no host is gone", lambda s, loop: setattr(loop, "fault", _fault("error", "h2", gone=[]))),
        ("the fault would come again", lambda s, loop: setattr(loop, "fault", _fault("config", "h2"))),
        ("a survivor was not told", lambda s, loop: setattr(s, "regroup_unanswered", {"h2": "no answer"})),
    ],
)  # fmt: skip
def test_a_fault_no_regroup_covers_goes_to_relaunching(
    tmp_path: Path, why: str, change: Callable[[Scripted, Loop], None]
) -> None:
    supervisor, _ = _supervisor(tmp_path)
    loop = _faulted(State.REGROUPING)
    change(supervisor, loop)
    assert supervisor.regrouping(loop) is State.RELAUNCHING, why
    assert (loop.hosts, loop.generation, supervisor.restarts) == (HOSTS, 0, [])
    assert loop.fault is not None  # relaunching recovers from the same fault


# -- relaunching --------------------------------------------------------------------------------------------------


def test_a_relaunch_stops_what_is_left_and_launches_the_next_attempt_from_the_main_hosts_checkpoint(
    tmp_path: Path,
) -> None:
    supervisor, out = _supervisor(tmp_path)
    loop = _faulted(State.RELAUNCHING, generation=2)
    loop.statuses["h2"] = {"state": "failed"}  # ended, no process left: nothing to stop there
    assert supervisor.relaunching(loop) is State.LAUNCHING
    assert supervisor.calls == [("stop", ["h1"], "h1")]  # the main host keeps its own checkpoint: nothing placed
    assert (loop.hosts, loop.main, loop.attempt, loop.generation, loop.fault) == (["h1", "h2"], "h1", 1, 0, None)
    (restart,) = supervisor.restarts
    assert (restart.how, restart.checkpoint_step, restart.hosts_after, restart.left_out, restart.main_host) == (
        "relaunch", 5, ["h1", "h2"], ["h3"], "h1",
    )  # fmt: skip
    assert "relaunching on h1, h2 (main host h1) from checkpoint step 5" in out.getvalue()


def test_a_relaunch_without_the_main_host_places_the_newest_checkpoint_on_the_next_one(tmp_path: Path) -> None:
    supervisor, out = _supervisor(tmp_path)
    supervisor.placed_step = None
    supervisor.stop_unanswered = {"h3": "no answer"}  # a host that cannot be stopped is left out too
    statuses: Statuses = {"h1": {"state": "unreachable"}, "h2": dict(WORKING), "h3": dict(WORKING)}
    loop = Loop(
        list(HOSTS), "h1", state=State.RELAUNCHING, statuses=statuses, fault=_fault("unreachable", "h1", ["h1"])
    )
    assert supervisor.relaunching(loop) is State.LAUNCHING
    assert supervisor.calls == [("stop", ["h2", "h3"], "h1"), ("place", ["h2"], "h2")]
    assert (loop.hosts, loop.main, loop.attempt) == (["h2"], "h2", 1)
    assert supervisor.restarts[-1].checkpoint_step is None
    assert "from step 0 (no intact checkpoint)" in out.getvalue()


@pytest.mark.parametrize(
    ("job", "kind", "restarts", "problem"),
    [
        ({"train": {"max_restarts": 1}}, "lost", 1, "restarts exhausted (1 of train.max_restarts=1)"),
        ({"train": {"min_hosts": 3}}, "lost", 0, "only 2 host(s) left (h1, h2), fewer than train.min_hosts=3"),
        ({}, "non_finite", 0, "a non_finite failure would happen again on a relaunch"),
    ],
)
def test_a_run_that_cannot_relaunch_fails_with_its_cause(
    tmp_path: Path, job: dict[str, Any], kind: str, restarts: int, problem: str
) -> None:
    supervisor, out = _supervisor(tmp_path, **job)
    supervisor.restarts = [_restart("relaunch")] * restarts
    loop = _faulted(State.RELAUNCHING, _fault(kind))
    assert supervisor.relaunching(loop) is State.FAILED
    assert loop.outcome is not None
    assert (loop.outcome.state, loop.outcome.cause, loop.outcome.hosts) == ("failed", loop.fault.cause, HOSTS)
    assert f"not restarting: {problem}" in out.getvalue()
    assert loop.attempt == 0 and len(supervisor.restarts) == restarts
    assert supervisor.calls == [("stop", ["h1", "h2"], "h1")]  # what is left stops either way


def test_recovering_without_a_fault_and_advancing_past_the_end_are_refused(tmp_path: Path) -> None:
    supervisor, _ = _supervisor(tmp_path)
    with pytest.raises(ValueError, match="no fault"):
        supervisor.regrouping(Loop(list(HOSTS), "h1", state=State.REGROUPING))
    with pytest.raises(ValueError, match="has ended"):
        supervisor.advance(Loop(list(HOSTS), "h1", state=State.FAILED))


# -- the whole loop -----------------------------------------------------------------------------------------------


def test_run_goes_through_a_regroup_a_relaunch_and_a_failed_relaunch_to_the_end(tmp_path: Path) -> None:
    """launching -> following -> regrouping -> following -> regrouping -> relaunching -> launching (fails on h2)
    -> regrouping -> relaunching -> launching -> following -> finished."""
    supervisor, _ = _supervisor(tmp_path)
    everyone = {h: dict(WORKING) for h in HOSTS}
    supervisor.polls = [everyone, {"h1": dict(WORKING), "h2": dict(WORKING), "h3": {"state": "lost"}}]
    supervisor.follows = [
        [{"h1": dict(WORKING), "h2": {"state": "failed", "exit_code": 1, "ranks": [1]}}],
        [{"h1": dict(WORKING), "h3": dict(WORKING)}, {"h1": {"state": "finished"}, "h3": {"state": "finished"}}],
    ]
    supervisor.launch_failures = [{}, {"h2": "cannot start"}]
    outcome = supervisor.run(False)
    assert outcome.state == "finished" and outcome.hosts == ["h1", "h3"]
    assert [(r.how, r.cause.kind, r.hosts_after) for r in outcome.restarts] == [
        ("regroup", "lost", ["h1", "h2"]),
        ("relaunch", "vanished", ["h1", "h2", "h3"]),  # h3 may come back: a relaunch asks every host again
        ("relaunch", "launch", ["h1", "h3"]),
    ]
    launches = [c for c in supervisor.calls if c[0] == "launch"]
    assert launches == [("launch", 0, HOSTS, "h1", False), ("launch", 1, HOSTS, "h1", True),
                        ("launch", 2, ["h1", "h3"], "h1", True)]  # fmt: skip
    written = Supervision.read(supervisor.run_dir)
    assert written is not None and (written.attempt, written.generation) == (2, 0)
