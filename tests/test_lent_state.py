"""What people see of a host taken back from its job (train/recovery/lending.py), and what the controller decides of
it: the host's job state, the exporter's series and the dashboard's parse of them, `make status`'s line, the refusals
of `make release` / `make lend`, and the restarts a following controller records."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed import planted as planted_run
from train.recovery import lending
from ugro.commands.status import _state
from ugro.module_utils import ugro_exporter, ugro_jobstate
from ugro.monitoring import monitor
from ugro.run import lending as decide
from ugro.run import recovery

HOST = "node4070"


@pytest.fixture()
def lent_host(tmp_path: Path) -> Iterator[Path]:
    """A planted run on HOST whose ranks left after step 7 for its owner; its launcher lives on, waiting."""
    runs = tmp_path / "runs"
    runs.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(runs / planted_run.JOB_ID)])
    try:
        run = planted_run.plant_run(runs, HOST, launcher.pid)
        host_dir = run / "hosts" / HOST
        for pid_file in host_dir.glob("worker-rank*.pid"):
            pid_file.unlink()  # the ranks ended
        (host_dir / "launch.pid").write_text(f"{launcher.pid}\n")
        asked = lending.ask(host_dir, lending.BY_OWNER, "process 4242 (game) uses 3100 MiB of GPU 0")
        lending.record_left(host_dir, lending.Lent(time.time(), 7, 0, 1, "master", asked))
        yield runs
    finally:
        launcher.kill()
        launcher.wait()


def test_a_lent_host_says_so_in_its_state_the_exporter_and_make_status(lent_host: Path) -> None:
    run = lent_host / planted_run.JOB_ID
    status = ugro_jobstate.status(run, HOST, main=False)
    assert status["state"] == "lent" and status["lent"]["step"] == 7, status
    assert status["wanted_back"]["by"] == "owner"
    # It was the main host: it handed the records on when it left (the exporter then serves no job totals).
    (run / "run.json").write_text('{"state": "running", "records_moved_to": {"host": "master", "step": 7}}')
    gpus = ugro_exporter.Gpus(nvml=None, watch_xid=False)
    text = ugro_exporter.exposition(ugro_exporter.Collector(HOST, lent_host, gpus))
    sample = monitor.parse(text)
    assert sample.job_states == {planted_run.JOB_ID: "lent"}
    assert sample.lent is not None and sample.lent[1:] == ("owner", "process 4242 (game) uses 3100 MiB of GPU 0")
    assert sample.job is None  # the host that keeps the run is another
    line = _state(status, failed=False)
    assert line.startswith("lent since ") and "after step 7 (by owner: process 4242 (game)" in line, line
    # Lent again: the request gone, its ranks back (a rank's pid file), the state is running again.
    lending.withdraw(run / "hosts" / HOST)
    (run / "hosts" / HOST / "worker-rank0.pid").write_text(f"{status['pids']['launcher']}\n")
    again = ugro_jobstate.status(run, HOST, main=False)
    assert again["state"] == "running" and again["lent"] is None and again["wanted_back"] is None, again


def _statuses(**states: dict[str, Any]) -> dict[str, dict[str, Any]]:
    training = {"state": "running", "pids": {"launcher": 1, "worker-rank0": 2}, "parts": {"0": "the whole model"}}
    return {host: training | extra for host, extra in states.items()}


def test_make_release_refuses_what_would_stop_the_run_and_says_what_to_do() -> None:
    job = "default-1"
    hosts = _statuses(master={}, node4070={}, node3070={})
    assert decide.release_refusal(hosts, "node4070", job) is None
    assert "not a host of the inventory" in str(decide.release_refusal(hosts, "laptop", job))
    alone = _statuses(master={}, node4070={"state": "lent", "pids": {"launcher": 1}})
    refusal = str(decide.release_refusal(alone, "master", job))
    assert "last host" in refusal and "make stop" in refusal and "RESUME=auto" in refusal, refusal
    assert "already taken back" in str(decide.release_refusal(alone, "node4070", job))
    staged = _statuses(master={"parts": {"0": "stage 1/2, layers 0-15"}}, node4070={"parts": {"1": "stage 2/2"}})
    refusal = str(decide.release_refusal(staged, "node4070", job))
    assert "pipeline stages" in refusal and "re-cuts the stages" in refusal, refusal
    asked = _statuses(master={}, node4070={"wanted_back": {"by": "hand"}})
    assert "last host" in str(decide.release_refusal(asked, "master", job))  # the other one is leaving already
    assert decide.lend_refusal(alone, "node4070", job) is None
    assert "nothing to lend" in str(decide.lend_refusal(alone, "master", job))


def test_a_following_controller_records_a_host_taken_back_and_lent_again_as_restarts_of_no_fault() -> None:
    records = [
        {"attempt": 0, "generation": 1, "hosts": ["master", "node3070"], "main": "master", "from_step": 12,
         "decided_by": "released", "cause": "node4070 taken back by its owner", "time": 1.0, "seconds": 0.1},
        {"attempt": 0, "generation": 2, "hosts": ["master", "node3070", "node4070"], "main": "master",
         "from_step": 30, "decided_by": "rejoin", "cause": "node4070 came back", "time": 2.0, "seconds": 0.5},
    ]  # fmt: skip
    hosts = ["master", "node4070", "node3070"]
    restarts, (after, _, _) = recovery.adopted(records, hosts, hosts, 0)
    assert [(r.cause.kind, r.cause.host, r.decided_by) for r in restarts] == [
        ("lent", "node4070", "released"), ("rejoined", "node4070", "rejoin"),
    ]  # fmt: skip
    assert "by its owner" in restarts[0].cause.message and "lent to the run again" in restarts[1].cause.message
    assert [r.steps_redone for r in restarts] == [0, 0] and after == ["master", "node3070", "node4070"]
    assert restarts[0].line().endswith("went on on master, node3070 from step 12 (0 steps redone)")
    # A crashed host that comes back is told apart: it was never taken back.
    crashed, _ = recovery.adopted(records[1:], ["master", "node3070"], hosts, 0)
    assert "crashed" in crashed[0].cause.message
