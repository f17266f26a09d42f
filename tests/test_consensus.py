"""Survivors decide who is left when no controller follows the run (train/recovery/consensus.py).

Real sockets on loopback (as tests/test_heartbeat.py: a TCPStore answers, a closed port refuses, a listener with a
full queue drops the connect as a cut link does), a real TCPStore for the agreement, and the status code a
controller's poll runs on a host (the exporter's HTTP application and the fact module's ``status``) for the record
of who follows. The whole path with real ranks is tests/test_regroup.py; with the real controller gone and coming
back, tests/test_recovery.py.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import closed_port, unanswering_port

from train.dist.health import GroupHealth
from train.recovery import consensus, watch
from train.recovery.consensus import View
from train.recovery.group import Group
from ugro.module_utils import ugro_exporter, ugro_jobstate


def test_probe_tells_a_host_whose_job_is_gone_from_one_that_does_not_answer() -> None:
    live = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    held: list[socket.socket] = []
    try:
        view = consensus.probe({
            "h2": f"127.0.0.1:{live.port}",
            "h3": f"127.0.0.1:{closed_port()}",
            "h4": f"127.0.0.1:{unanswering_port(held)}",
        })  # fmt: skip
    finally:
        for sock in held:
            sock.close()
    assert view == View(down=frozenset({"h3"}), silent=frozenset({"h4"}))


@pytest.mark.parametrize(
    ("hosts", "main", "down", "silent", "expected"),
    [
        # A job killed on one of five hosts: the four others go on, the main host stays.
        (("h1", "h2", "h3", "h4", "h5"), "h1", {"h2"}, set(), (("h1", "h3", "h4", "h5"), "h1")),
        # The main host cut off from two others: they are two of three, and the first of them keeps the run.
        (("h1", "h2", "h3"), "h1", set(), {"h1"}, (("h2", "h3"), "h2")),
        # The lone host cut off sees the two others silent: one of three is no majority, it waits.
        (("h1", "h2", "h3"), "h1", set(), {"h2", "h3"}, None),
        # Two hosts that lose each other: either could be the one cut off; a controller decides.
        (("h1", "h2"), "h1", set(), {"h2"}, None),
        # Two hosts, the other one's job gone (its host refuses): it cannot train apart, this one goes on.
        (("h1", "h2"), "h1", {"h1"}, set(), (("h2",), "h2")),
        # Everyone answers (a frozen rank, a crash whose host's store still listens): the controller's to judge.
        (("h1", "h2", "h3"), "h1", set(), set(), None),
    ],
)
def test_the_survivors_go_on_only_as_a_majority_and_keep_the_main_host_where_they_can(
    hosts: tuple[str, ...], main: str, down: set[str], silent: set[str], expected: tuple[tuple[str, ...], str] | None
) -> None:
    proposal = consensus.propose(_group(hosts, main, 2), View(frozenset(down), frozenset(silent)))
    if expected is None:
        assert proposal is None
    else:
        assert proposal is not None and (proposal.generation, proposal.members, proposal.main) == (3, *expected)


def _group(hosts: tuple[str, ...], main: str, generation: int = 0, attempt: int = 0) -> Group:
    """A group of one rank per host, each host's store at a made-up address."""
    stores = tuple((h, f"10.0.0.{i + 1}:4000") for i, h in enumerate(hosts))
    return Group(attempt, generation, hosts, main, stores, "ab" * 32)


def _next(hosts: tuple[str, ...], main: str, generation: int) -> Group:
    return _group(("h1", "h2", "h3", "h4"), "h1").survivors(generation, hosts, main)


def test_every_rank_takes_the_first_proposal_that_reached_the_new_main_hosts_store() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    first = _next(("h1", "h3", "h4"), "h1", 1)
    late = _next(("h1", "h3"), "h1", 1)  # a rank whose probe missed h4 for a moment
    current, key = _group(("h1", "h2", "h3", "h4"), "h1"), bytes(range(32))
    assert consensus.agree(first, client, current, key) == first
    assert consensus.agree(late, server, current, key) == first
    # The next generation, and another launch, are agreed anew.
    relaunched = _group(("h1", "h2", "h3", "h4"), "h1", attempt=1)
    assert consensus.agree(late, client, relaunched, key) == relaunched.survivors(1, ("h1", "h3"), "h1")
    alone = _next(("h1",), "h1", 2)
    assert consensus.agree(alone, server, current, key) == alone


@pytest.mark.parametrize(
    "planted",
    [
        '{"generation": 1, "hosts": [], "main": "h1"}',  # nobody
        '{"generation": 1, "hosts": ["h1"], "main": "h1"}',  # well formed (h3 left out), but not proven
        '{"generation": 1, "hosts": ["h1", "guest"], "main": "guest"}',  # a host that was never a member
        '{"generation": 7, "hosts": ["h1"], "main": "h1"}',  # another generation
        '{"generation": 1, "hosts": ["h3", "h1"], "main": "h1"}',  # out of the run's order
        "not json",
    ],
)
def test_a_membership_planted_in_the_store_before_the_survivors_is_refused_and_they_still_agree(
    planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who reaches the new main host's store could write the membership key first (``compare_set`` takes
    the first value): the survivors refuse what none of them could have proposed, say so, and agree on the next key."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
    current = _group(("h1", "h2", "h3"), "h1")
    server.set("ugro-membership-0-1", planted)
    # A store's set gets no answer: read it back on the same connection, so that it is there before any survivor asks.
    assert bytes(server.get("ugro-membership-0-1")) == planted.encode()
    mine, theirs = current.survivors(1, ("h1", "h3"), "h1"), current.survivors(1, ("h1",), "h1")
    key = bytes(range(32))
    with caplog.at_level("WARNING"):
        assert consensus.agree(mine, client, current, key) == mine
        assert consensus.agree(theirs, server, current, key) == mine  # the same key skipped, the same one taken
    assert "refused the membership under ugro-membership-0-1" in caplog.text, caplog.text


def _exporter_poll(runs: Path, query: str) -> dict[str, Any]:
    """A poll of h1's exporter from the controller (10.0.0.1), which keeps its marks in runs/exporter/followed."""
    marks = ugro_exporter.FollowMarks(runs / "exporter", "h1", ["10.0.0.1"])
    app = ugro_exporter.application(lambda environ, start: [b""], runs, "h1", marks)
    answer: list[str] = []
    environ = {"PATH_INFO": "/job/job-1", "QUERY_STRING": query, "REMOTE_ADDR": "10.0.0.1"}
    body = app(environ, lambda code, headers: answer.append(code))
    assert answer == ["200 OK"]
    return dict(json.loads(b"".join(body)))


def test_a_host_knows_whether_a_controller_follows_the_run_from_its_polls(tmp_path: Path) -> None:
    run_dir = tmp_path / "job-1"
    (run_dir / "hosts" / "h1").mkdir(parents=True)
    # The exporter's record of the controller's polls (its own directory: tests/test_exporter_security.py).
    marks = tmp_path / "exporter" / ugro_exporter.FOLLOWED_DIR
    # `make status` and the dashboards ask without following: the ranks would wait for nobody.
    _exporter_poll(tmp_path, "main=1")
    ugro_jobstate.status(run_dir, "h1", main=True)
    assert not consensus.controller_follows(run_dir, "h1", marks=marks)
    # The following controller's poll, over HTTP every 2 s.
    assert _exporter_poll(tmp_path, "main=1&follow=2")["follow"] == "recorded"
    assert consensus.controller_follows(run_dir, "h1", marks=marks)
    # It stopped asking (Ctrl-C, a sleeping laptop): after three polls and the grace, the ranks decide themselves.
    later = time.time() + 3 * 2 + consensus.FOLLOW_GRACE_S + 1
    assert not consensus.controller_follows(run_dir, "h1", now=later, marks=marks)
    # The fact module's poll (through Ansible, as the job's user) records it in the run.
    ugro_jobstate.status(run_dir, "h1", main=False, follow_poll_s=30)
    assert consensus.controller_follows(run_dir, "h1", now=later, marks=marks)
    # A query that is not a number follows nothing.
    (run_dir / "hosts" / "h1" / ugro_jobstate.FOLLOWED).unlink()
    (marks / "job-1" / "h1.json").unlink()
    _exporter_poll(tmp_path, "follow=soon")
    assert not consensus.controller_follows(run_dir, "h1", marks=marks)


def test_under_a_batch_scheduler_the_survivors_never_decide_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    """scancel ends every rank at nearly the same moment; the last one must not take the run over
    (tests/test_slurm.py's scancel, then a resume, checks the run's records stay whole)."""
    for variable in watch.SCHEDULERS:
        monkeypatch.delenv(variable, raising=False)
    assert watch.scheduler() is None
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert watch.scheduler() == "SLURM"


def test_a_peer_whose_job_is_gone_breaks_the_group_at_once(tmp_path: Path) -> None:
    """No collective waits out its timeout for a peer the heartbeat found gone (a cut link sends no reset)."""
    (tmp_path / "hosts" / "h1").mkdir(parents=True)
    health = GroupHealth()
    beat = watch.Heartbeat(tmp_path, "h1", {"h2": f"127.0.0.1:{closed_port()}"}, health)
    try:
        deadline = time.monotonic() + 5
        while health.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        beat.stop()
    assert health.broken == "cannot reach the regroup store of h2"


def test_a_controller_that_comes_back_records_the_regroups_the_survivors_agreed_on() -> None:
    """`make follow` after the survivors went on twice without a controller: both regroups become restarts, from
    the main rank's history and the ranks' own records, and the run is followed on the hosts and main host left."""
    from ugro.run import recovery
    from ugro.run.attach import Supervision

    def record(generation: int, hosts: list[str], main: str, step: int) -> dict[str, Any]:
        return {"generation": generation, "attempt": 1, "from_step": step, "seconds": 1.4, "hosts": hosts,
                "main": main, "decided_by": "survivors", "time": 1_800_000_000.0 + step}  # fmt: skip

    first, second = record(1, ["tb1", "tb3", "tb4"], "tb1", 14), record(2, ["tb3", "tb4"], "tb3", 21)
    statuses = {
        "tb3": {"state": "running", "rank_regrouped": second, "regroups": [first, second]},  # the main now
        "tb4": {"state": "running", "rank_regrouped": second},
        "tb1": {"state": "unreachable"},
        "tb2": {"state": "lost", "rank_regrouped": record(1, ["tb1", "tb2"], "tb1", 3) | {"attempt": 0}},
    }
    agreed = recovery.survivors_regroups(statuses, attempt=1, generation=0)
    assert [r["generation"] for r in agreed] == [1, 2]  # the earlier launch's record is not this one's
    assert recovery.survivors_regroups(statuses, attempt=1, generation=2) == []  # seen already
    restarts, (hosts, main, generation) = recovery.adopted(agreed, ["tb1", "tb2", "tb3", "tb4"],
                                                           ["tb1", "tb2", "tb3", "tb4"], restarts_before=1)  # fmt: skip
    assert (hosts, main, generation) == (["tb3", "tb4"], "tb3", 2)
    assert [(r.attempt, r.cause.host, r.hosts_after, r.main_host) for r in restarts] == [
        (2, "tb2", ["tb1", "tb3", "tb4"], "tb1"), (3, "tb1", ["tb3", "tb4"], "tb3")]  # fmt: skip
    assert all(r.steps_redone == 0 and r.decided_by == "survivors" for r in restarts)
    assert restarts[1].line().startswith("restart 3: lost on tb1: ")
    assert "-> regrouped by the survivors themselves on tb3, tb4 from step 21 (0 steps redone)" in restarts[1].line()
    # A controller that takes the run up later counts the same membership generation (ugro/run/attach.py).
    assert Supervision(hosts, main, restarts, []).generation == 2
