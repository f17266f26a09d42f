"""Who follows a run, and what a controller needs to take it up again (`make follow`).

A run does not need its controller to go on: the hosts run it. What only the controller does (relaunching after
a fault, copying checkpoints and results to ``runs/<job-id>/``) waits until one follows the run again. Three
files in the run's ``.control/`` make that possible:

- ``launch.json``: how the run was launched (job file, inventory, the launch's variables, poll interval), written
  once by ``make train``;
- ``supervision.json``: the controller's record as it goes (hosts, main host, every restart and regroup,
  failed checkpoint copies), rewritten at each change, so a controller that comes later continues it;
- ``follower.json``: the process that follows the run now (its pid and start time, this machine's name), removed
  when it stops following; a follower that died leaves it behind, and ``follower`` tells it apart from a live one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ugro.run.records import Restart

LAUNCH = "launch.json"
SUPERVISION = "supervision.json"
FOLLOWER = "follower.json"


def _control(run_dir: Path) -> Path:
    return run_dir / ".control"


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Launch:
    """How ``make train`` launched the run: what a controller that re-attaches relaunches with."""

    job_file: str
    inventory: str
    extravars: dict[str, Any]
    poll_s: float

    def write(self, run_dir: Path) -> None:
        _write(_control(run_dir) / LAUNCH, asdict(self))

    @classmethod
    def read(cls, run_dir: Path) -> Launch | None:
        data = _read(_control(run_dir) / LAUNCH)
        if data is None:
            return None
        try:
            return cls(str(data["job_file"]), str(data["inventory"]), dict(data["extravars"]), float(data["poll_s"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class Supervision:
    """Where the controller left the run: its hosts now, its main host, the restarts so far."""

    hosts: list[str]
    main: str
    restarts: list[Restart]
    copy_failures: list[str]

    @property
    def attempt(self) -> int:
        """The launch attempt running now: one more for every relaunch."""
        return sum(1 for r in self.restarts if r.how != "regroup")

    @property
    def generation(self) -> int:
        """The survivors' membership generation since the last launch: one more for every regroup after it."""
        count = 0
        for restart in reversed(self.restarts):
            if restart.how != "regroup":
                break
            count += 1
        return count

    def write(self, run_dir: Path) -> None:
        _write(_control(run_dir) / SUPERVISION, {
            "hosts": self.hosts, "main_host": self.main, "copy_failures": self.copy_failures,
            "restarts": [r.to_dict() for r in self.restarts], "written": round(time.time(), 3),
        })  # fmt: skip

    @classmethod
    def read(cls, run_dir: Path) -> Supervision | None:
        data = _read(_control(run_dir) / SUPERVISION)
        if data is None or not data.get("hosts"):
            return None
        restarts = [Restart.from_dict(r) for r in data.get("restarts") or [] if isinstance(r, dict)]
        main = data.get("main_host") or data.get("rendezvous") or data["hosts"][0]  # "rendezvous": its former key
        return cls([str(h) for h in data["hosts"]], str(main), restarts,
                   [str(line) for line in data.get("copy_failures") or []])  # fmt: skip


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@contextlib.contextmanager
def following(run_dir: Path) -> Iterator[None]:
    """Mark this process as the run's follower while the block runs."""
    pid = os.getpid()
    mark = {"pid": pid, "start_time": _start_time(pid), "machine": socket.gethostname(), "since": round(time.time())}
    path = _control(run_dir) / FOLLOWER
    _write(path, mark)
    try:
        yield
    finally:
        if (_read(path) or {}).get("pid") == pid:
            path.unlink(missing_ok=True)


def follower(run_dir: Path) -> dict[str, Any] | None:
    """The process that follows the run now (``pid``, ``machine``, ``since``), or None when none does: no mark, or
    the marked process is gone (a closed terminal, a killed controller). A mark from another machine is taken
    as it is: this machine cannot see that machine's processes."""
    mark = _read(_control(run_dir) / FOLLOWER)
    if mark is None:
        return None
    if mark.get("machine") != socket.gethostname():
        return mark
    pid = int(mark.get("pid") or 0)
    alive = pid > 0 and _start_time(pid) is not None and _start_time(pid) == mark.get("start_time")
    return mark if alive else None
