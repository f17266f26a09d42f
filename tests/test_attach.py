"""What a controller needs to take up a run it did not launch or left (ugro/run/attach.py): the record of where the
run is, and whether some process follows it now. The whole path (Ctrl-C, `make status`, `make follow`) runs in
tests/test_make_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ugro.run.attach import FOLLOWER, Launch, Supervision, follower, following
from ugro.run.records import Cause, Restart


def _restart(attempt: int, how: str, hosts: list[str]) -> Restart:
    return Restart(attempt=attempt, time=1.0, cause=Cause("lost", "gone", "tb2"), hosts_before=["tb1", "tb2", "tb3"],
                   hosts_after=hosts, left_out=[], main_host=hosts[0], checkpoint_step=None, last_step_seen=3,
                   how=how)  # fmt: skip


def test_the_record_gives_the_attempt_and_the_membership_generation_a_controller_continues_with(
    tmp_path: Path,
) -> None:
    restarts = [_restart(1, "regroup", ["tb1", "tb3"]), _restart(2, "relaunch", ["tb1", "tb3"]),
                _restart(3, "regroup", ["tb3"]), _restart(4, "regroup", ["tb3"])]  # fmt: skip
    Supervision(["tb3"], "tb3", restarts, ["checkpoint step-4: the copy failed"]).write(tmp_path)
    found = Supervision.read(tmp_path)
    assert found is not None and (found.hosts, found.main) == (["tb3"], "tb3")
    # One relaunch so far (attempt 1); two regroups since it (their generation numbers go on from 2).
    assert (found.attempt, found.generation) == (1, 2)
    assert [r.how for r in found.restarts] == ["regroup", "relaunch", "regroup", "regroup"]
    assert found.copy_failures == ["checkpoint step-4: the copy failed"]
    assert Supervision.read(tmp_path / "elsewhere") is None
    Launch("/x/jobs/a.yaml", "/x/inventory/c.yml", {"ugro_job_id": "a-1"}, 5.0).write(tmp_path)
    assert Launch.read(tmp_path) == Launch("/x/jobs/a.yaml", "/x/inventory/c.yml", {"ugro_job_id": "a-1"}, 5.0)


def test_a_follower_counts_while_it_lives_and_not_after(tmp_path: Path) -> None:
    assert follower(tmp_path) is None
    with following(tmp_path):
        mark = follower(tmp_path)
        assert mark is not None and mark["pid"] == os.getpid()
    assert follower(tmp_path) is None and not (tmp_path / ".control" / FOLLOWER).exists()
    # A follower that was killed leaves its mark behind: a dead process does not count.
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    (tmp_path / ".control" / FOLLOWER).write_text(
        json.dumps({"pid": dead, "start_time": "1", "machine": os.uname()[1]})
    )
    assert follower(tmp_path) is None
    # Nor a live process that only took a dead follower's pid (its start time differs).
    (tmp_path / ".control" / FOLLOWER).write_text(
        json.dumps({"pid": os.getpid(), "start_time": "1", "machine": os.uname()[1]})
    )
    assert follower(tmp_path) is None
