"""A job's state on one host, and stopping exactly its processes: ``python -m train.jobstate``.

The launch script records the job's process group (``hosts/<host>/launch.pid``); every rank records
its own pid (``hosts/<host>/worker-rank<N>.pid``: torchrun starts workers in sessions of their own).
A recorded pid counts as the job's only while its command line still names the run directory, so
a pid reused by another process after the job ended is never signalled.

    python -m train.jobstate status RUN_DIR HOST [--main]
    python -m train.jobstate stop RUN_DIR HOST [--grace SECONDS]

Both print one JSON object; ``stop`` exits 1 when a process of the job survived.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from train.metrics import STATUS, last_metrics

STOPPED_MARK = "stopped"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _belongs(pid: int, run_dir: Path) -> bool:
    """The process exists and its command line names this run (so it is this job's, not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return str(run_dir) in cmdline


def job_pids(run_dir: Path, host: str) -> dict[str, int]:
    """The job's recorded processes on this host that are still alive: name -> pid."""
    host_dir = run_dir / "hosts" / host
    found: dict[str, int] = {}
    launcher = _read_int(host_dir / "launch.pid")
    if launcher is not None and _belongs(launcher, run_dir):
        found["launcher"] = launcher
    for pid_file in sorted(host_dir.glob("worker-rank*.pid")):
        pid = _read_int(pid_file)
        if pid is not None and _belongs(pid, run_dir):
            found[pid_file.stem] = pid
    return found


def status(run_dir: Path, host: str, main: bool) -> dict[str, Any]:
    host_dir = run_dir / "hosts" / host
    result: dict[str, Any] = {"host": host, "run_dir": str(run_dir)}
    if not host_dir.is_dir():
        return result | {"state": "absent"}
    pids = job_pids(run_dir, host)
    exit_code = _read_int(host_dir / "exit_code")
    if pids:
        state = "running"
    elif exit_code == 0:
        state = "finished"
    elif (host_dir / STOPPED_MARK).exists():
        state = "stopped"
    elif exit_code is not None:
        state = "failed"
    else:
        state = "lost"  # no process and no exit code: killed with SIGKILL or the host rebooted
    result |= {"state": state, "exit_code": exit_code, "pids": pids}
    if main:
        last = last_metrics(run_dir)
        if last is not None:
            result |= {k: last[k] for k in ("step", "total_steps", "loss", "tokens_per_s", "eta_s")}
        if (run_dir / STATUS).is_file():
            run = json.loads((run_dir / STATUS).read_text())
            result |= {"run_state": run.get("state"), "error": run.get("error")}
    return result


def _signal(pids: dict[str, int], sig: signal.Signals) -> None:
    for name, pid in pids.items():
        try:
            if name == "launcher":
                os.killpg(pid, sig)  # the launch script leads its own process group: torchrun is in it
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(run_dir: Path, host: str, seconds: float) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    remaining = job_pids(run_dir, host)
    while remaining and time.monotonic() < deadline:
        time.sleep(0.2)
        remaining = job_pids(run_dir, host)
    return remaining


def stop(run_dir: Path, host: str, grace: float) -> dict[str, Any]:
    """SIGTERM the job's own processes, SIGKILL what is left after ``grace`` seconds, confirm."""
    host_dir = run_dir / "hosts" / host
    targets = job_pids(run_dir, host)
    if targets:
        (host_dir / STOPPED_MARK).write_text(f"{time.time()}\n")
    _signal(targets, signal.SIGTERM)
    remaining = _wait_gone(run_dir, host, grace)
    killed = dict(remaining)
    _signal(remaining, signal.SIGKILL)
    remaining = _wait_gone(run_dir, host, 10)
    active = run_dir.parent / "active-job"
    if not remaining and active.is_file() and active.read_text().split()[:1] == [run_dir.name]:
        active.unlink()
    return {"host": host, "signalled": targets, "killed": killed, "remaining": remaining}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.jobstate", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["status", "stop"])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("host")
    parser.add_argument("--main", action="store_true", help="this host keeps the run's metrics")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if args.action == "status":
        print(json.dumps(status(run_dir, args.host, args.main)))
        return 0
    result = stop(run_dir, args.host, args.grace)
    print(json.dumps(result))
    return 1 if result["remaining"] else 0


if __name__ == "__main__":
    sys.exit(main())
