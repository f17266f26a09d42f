"""A job's state on one host, and stopping exactly its processes.

Shared by the host modules ``library/ugro_host_facts.py`` (the job's state) and ``library/ugro_job.py``
(stopping it), which import it as ``ansible.module_utils.ugro_jobstate``, and by the controller's
``ugro/run/follow.py``, which reads a run written into its own checkout (``ugro.module_utils.ugro_jobstate``).
Standard library and psutil only (Debian's ``python3-psutil`` on a host).

The launch script records the job's process group (``runs/<job>/hosts/<host>/launch.pid``); every rank
records its own pid (``worker-rank<N>.pid``: on a GPU host torchrun starts workers in sessions of their own;
ranks forked by train/launcher.py are in the launch's process group). A
recorded pid counts as the job's only while its command line still names the run directory, so a pid
reused by another process after the job ended is never signalled. ``runs/active-job`` holds
"<job id> <process group>" while a job runs on the host.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import psutil

    HAS_PSUTIL = True
except ImportError:  # the host modules report it, naming the host and the fix
    HAS_PSUTIL = False

# The files rank 0 writes (train/metrics.py METRICS and STATUS) and the launch leaves behind.
METRICS = "metrics.jsonl"
STATUS = "run.json"
STOPPED_MARK = "stopped"
ACTIVE_JOB = "active-job"
# Written by the launch script: which launch of the run this is (0 first, then one more per relaunch).
ATTEMPT = "attempt"
# Each failed rank's cause, one JSON line each (train/recovery/failure.py FAILURES).
FAILURES = "failures.jsonl"
# The hosts this host's ranks cannot reach (train/recovery/watch.py Heartbeat).
PEERS = "peers.json"
# When a controller that follows the run last asked this host, and how often it asks: while it is recent the ranks
# leave a lost host to the controller's word, after it they agree among themselves (train/recovery/consensus.py).
FOLLOWED = "followed.json"
# hosts/<host>/rejoin.json: this host's ranks crashed and its launcher started them again to rejoin the others
# (train/recovery/comeback.py MARK); removed once the group took them back in.
REJOIN = "rejoin.json"
# The host was taken back by its owner (train/recovery/lending.py): the request, and the ranks' note that they left.
LEND_REQUEST = "release.json"
LENT = "lent.json"
# The launch: its script, its process group (written by the script itself), torchrun's log, its exit status.
LAUNCH_SCRIPT = "launch.sh"
LAUNCH_PID = "launch.pid"
LAUNCH_START = "launch.start"  # ``pid start`` of the launch script, recorded by ``start``
START_SLACK_S = 0.05  # psutil's start times are the kernel's clock ticks (10 ms), converted
LAUNCH_LOG = "torchrun.log"
EXIT_CODE = "exit_code"
PROGRESS_KEYS = ("step", "total_steps", "loss", "tokens_per_s", "eta_s")
# A job id as the controller makes them (default-20261121-190000): one path component.
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
RUN_KEYS = ("last_checkpoint", "resumed", "regrouped", "regroups", "cause", "phases")


def digest() -> str:
    """This file's hash. The node exporter serves job states with it, and the controller trusts those of an
    exporter whose copy is its own (role exporter installs it on ``make provision``; a host module is always
    sent the controller's copy)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def psutil_missing(host: str, module: str) -> str:
    """The one message of a host module whose Python lacks psutil."""
    return (
        f"{host}: the Python that runs Ansible modules there ({sys.executable}, ansible_python_interpreter) cannot "
        f"import psutil, which {module} needs. Fix: install it on the host (Debian/Ubuntu: apt install python3-psutil; "
        f"`make provision` does), or set ansible_python_interpreter of {host} to a Python that has it."
    )


READ_LIMIT = 1 << 20  # bytes: every file read here is a few lines, or the end of a log


def read_file(path: Path, limit: int = READ_LIMIT, tail: bool = False) -> bytes:
    """A regular file's first ``limit`` bytes (its last, with ``tail``). Opened without following a link at its last
    step and without waiting on a FIFO: the run directory is the job user's, and what it planted there (a FIFO, a link
    to /dev/zero or to root's files) must neither hang nor exhaust a reader that runs as root (the exporter, a host
    module with become); OSError for anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file: {path}")
        if tail and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: Path, limit: int = READ_LIMIT) -> str:
    return read_file(path, limit).decode("utf-8", errors="replace")


def _read_int(path: Path) -> int | None:
    """A file's first number (a pid, an exit code, an attempt)."""
    return _read_pid(path)[0]


def _read_pid(path: Path) -> tuple[int | None, float | None]:
    """A pid file's pid and, where it recorded one, the process's start time (``pid start``)."""
    try:
        fields = read_text(path).split()
        return int(fields[0]), (float(fields[1]) if len(fields) > 1 else None)
    except (OSError, ValueError, IndexError):
        return None, None


def belongs(pid: int, run_dir: Path, started: float | None = None) -> bool:
    """The process is this job's: alive, run by the run directory's owner (the job's user: its pid files are that
    user's to write, so they can name no other user's process), started when its pid file says (not a reused pid),
    and its command line names this run."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.uids().real != run_dir.stat().st_uid:
            return False
        if started is not None and abs(proc.create_time() - started) > START_SLACK_S:
            return False
        return str(run_dir) in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return False


def record_pid(path: Path, pid: int) -> None:
    """``pid start`` into ``path``, renamed into place (a reader never sees it half written)."""
    started = psutil.Process(pid).create_time()
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(f"{pid} {started:.3f}\n")
    os.replace(partial, path)


def job_pids(run_dir: Path, host: str) -> dict[str, int]:
    """The job's recorded processes on this host that are still alive: name -> pid."""
    host_dir = run_dir / "hosts" / host
    found: dict[str, int] = {}
    launcher = _read_int(host_dir / LAUNCH_PID)
    _, launched = _read_pid(host_dir / LAUNCH_START)
    if launcher is not None and belongs(launcher, run_dir, launched):
        found["launcher"] = launcher
    for pid_file in sorted(host_dir.glob("worker-rank*.pid")):
        pid, started = _read_pid(pid_file)
        if pid is not None and belongs(pid, run_dir, started):
            found[pid_file.stem] = pid
    return found


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The newest complete row of metrics.jsonl, reading only the end of the file (it is polled)."""
    try:
        lines = read_file(run_dir / METRICS, 4096, tail=True).splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return dict(json.loads(line))
        except ValueError:
            continue  # a line being written right now, or the cut-off first line
    return None


def failures(run_dir: Path, host: str, attempt: int | None) -> list[dict[str, Any]]:
    """The failure records the ranks of this host wrote during launch ``attempt`` (all when None)."""
    path = run_dir / "hosts" / host / FAILURES
    found: list[dict[str, Any]] = []
    try:
        lines = read_text(path).splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (attempt is None or record.get("attempt") == attempt):
            found.append(record)
    return found


def ranks(run_dir: Path, host: str) -> list[int]:
    """The ranks this host's workers of the current launch ran (their pid files)."""
    host_dir = run_dir / "hosts" / host
    numbers = [p.stem[len("worker-rank") :] for p in host_dir.glob("worker-rank*.pid")]
    return sorted(int(n) for n in numbers if n.isdigit())


def rank_records(run_dir: Path, host: str) -> list[dict[str, Any]]:
    """This host's rank status files (``hosts/<host>/rank<N>.json``), those that read whole."""
    found: list[dict[str, Any]] = []
    for path in sorted((run_dir / "hosts" / host).glob("rank*.json")):
        try:
            record = json.loads(read_text(path))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def parts(records: list[dict[str, Any]]) -> dict[str, str]:
    """What each rank computes (rank -> "the whole model" or its pipeline stage), from its status."""
    return {str(r.get("rank")): str(r["part"]) for r in records if r.get("part")}


def silent_peers(run_dir: Path, host: str) -> list[str]:
    """The other hosts this host's first rank has not reached in its last connects to their regroup stores."""
    try:
        found = json.loads(read_text(run_dir / "hosts" / host / PEERS)).get("silent")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(h) for h in found] if isinstance(found, list) else []


def rejoining(run_dir: Path, host: str, attempt: int | None) -> dict[str, Any] | None:
    """The launcher's note that this host's ranks are coming back into the group (why, which time of how many), where
    it is this launch's (``attempt``) and the ranks have not been taken back in yet."""
    try:
        found = json.loads(read_text(run_dir / "hosts" / host / REJOIN))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("attempt") == attempt else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(read_text(path))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def rank_regrouped(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest regroup the ranks went through (their status files' ``regrouped``), or None."""
    found = [r["regrouped"] for r in records if isinstance(r.get("regrouped"), dict)]
    return max(found, key=lambda r: (r.get("attempt") or 0, r.get("generation") or 0), default=None)


def mark_followed(host_dir: Path, poll_s: float) -> None:
    """A following controller asked now, and asks again within ``poll_s`` seconds (this host's own clock)."""
    partial = host_dir / f"{FOLLOWED}.tmp{os.getpid()}"
    try:
        partial.write_text(json.dumps({"time": round(time.time(), 3), "poll_s": poll_s}), encoding="utf-8")
        os.replace(partial, host_dir / FOLLOWED)
    except OSError:
        partial.unlink(missing_ok=True)  # a full disk: the ranks then count the controller as gone


def status(run_dir: Path, host: str, main: bool, follow_poll_s: float = 0.0) -> dict[str, Any]:
    """state: running / lent / finished / failed / stopped / lost / absent, exit code, live pids (``lent``: the host
    was taken back, its ranks left the run and its launcher waits to be lent again; ``lent`` then says since when and
    why, ``wanted_back`` the request while it stands); on the main host
    (the one that keeps the metrics) the last step, loss, tokens/s and ETA, and run.json's state and error.
    ``follow_poll_s`` > 0: the controller that follows the run asks, every that many seconds (``mark_followed``);
    ``make status`` and the dashboards ask with 0."""
    host_dir = run_dir / "hosts" / host
    result: dict[str, Any] = {"host": host, "run_dir": str(run_dir), "job": run_dir.name}
    if not host_dir.is_dir():
        return {**result, "state": "absent"}
    if follow_poll_s > 0:
        mark_followed(host_dir, follow_poll_s)
    pids = job_pids(run_dir, host)
    exit_code = _read_int(host_dir / EXIT_CODE)
    lent = _read_json(host_dir / LENT)
    if pids and lent is not None and not any(name.startswith("worker") for name in pids):
        state = "lent"
    elif pids:
        state = "running"
    elif exit_code == 0:
        state = "finished"
    elif (host_dir / STOPPED_MARK).exists():
        state = "stopped"
    elif exit_code is not None:
        state = "failed"
    else:
        state = "lost"  # no process and no exit code: killed with SIGKILL or the host rebooted
    attempt = _read_int(host_dir / ATTEMPT)
    records = rank_records(run_dir, host)  # read once per poll
    result.update(state=state, exit_code=exit_code, pids=pids, attempt=attempt, ranks=ranks(run_dir, host),
                  failures=failures(run_dir, host, attempt), parts=parts(records),
                  rank_regrouped=rank_regrouped(records),
                  silent_peers=silent_peers(run_dir, host) if pids else [],
                  rejoining=rejoining(run_dir, host, attempt) if "launcher" in pids else None,
                  lent=lent if state == "lent" else None,
                  wanted_back=_read_json(host_dir / LEND_REQUEST) if pids else None)  # fmt: skip
    if main:
        last = last_metrics(run_dir)
        if last is not None:
            result.update({k: last[k] for k in PROGRESS_KEYS if k in last})
        try:
            run = json.loads(read_text(run_dir / STATUS))
        except (OSError, ValueError):
            run = None
        if isinstance(run, dict):
            result.update(run_state=run.get("state"), error=run.get("error"))
            result.update({k: run[k] for k in RUN_KEYS if run.get(k) is not None})
    return result


def running_job(runs_dir: Path) -> dict[str, Any] | None:
    """The job this host runs now, from ``runs/active-job``: {job, pgid}, or None where it names none, or a
    process group that is gone or no longer this job's (left behind by a job that ended: the next launch
    replaces it)."""
    try:
        parts = read_text(runs_dir / ACTIVE_JOB).split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    job, pgid = parts[0], int(parts[1])
    if not belongs(pgid, runs_dir / job):
        return None
    return {"job": job, "pgid": pgid}


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


def stop(run_dir: Path, host: str, grace_s: float) -> dict[str, Any]:
    """SIGTERM the job's own recorded processes, SIGKILL what is left after ``grace_s`` seconds, confirm.

    Returns {signalled, killed, remaining} (name -> pid each); ``remaining`` is non-empty only when a
    process survived SIGKILL for 10 s."""
    host_dir = run_dir / "hosts" / host
    targets = job_pids(run_dir, host)
    if targets:
        (host_dir / STOPPED_MARK).write_text(f"{time.time()}\n")
    _signal(targets, signal.SIGTERM)
    remaining = _wait_gone(run_dir, host, grace_s)
    killed = dict(remaining)
    _signal(remaining, signal.SIGKILL)
    remaining = _wait_gone(run_dir, host, 10)
    active = run_dir.parent / ACTIVE_JOB
    try:
        names_this_job = read_text(active).split()[:1] == [run_dir.name]
    except OSError:
        names_this_job = False
    if not remaining and names_this_job:
        active.unlink()
    return {"signalled": targets, "killed": killed, "remaining": remaining}


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(read_file(path, 1 << 16, tail=True).decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(run_dir: Path, host: str, script: str, timeout_s: float) -> dict[str, Any]:
    """Start the job on this host: write its launch script, run it in a session of its own, wait until it
    has written its process group id, and record the job as the one this host runs (``runs/active-job``).

    Clears the pid file, exit status and stop mark of an earlier launch of the run first, so that neither
    the wait here nor the controller reads a stale one. Returns {pgid, script, log}; raises RuntimeError
    with the log's end when the script exits or writes no pid within ``timeout_s`` seconds."""
    host_dir = run_dir / "hosts" / host
    host_dir.mkdir(parents=True, exist_ok=True)
    for name in (LAUNCH_PID, LAUNCH_START, EXIT_CODE, STOPPED_MARK):
        (host_dir / name).unlink(missing_ok=True)
    path = host_dir / LAUNCH_SCRIPT
    partial = host_dir / (LAUNCH_SCRIPT + ".tmp")
    partial.write_text(script, encoding="utf-8")
    partial.chmod(0o755)
    os.replace(partial, path)
    log = host_dir / LAUNCH_LOG
    # A session of its own: its pid is the job's process group, and it outlives this module's SSH session.
    proc = subprocess.Popen(
        [str(path)],
        cwd=host_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    deadline = time.monotonic() + timeout_s
    pgid = _read_int(host_dir / LAUNCH_PID)
    while pgid is None:
        if proc.poll() is not None:
            ended = f"{path} exited with {proc.returncode} before it wrote its pid"
            raise RuntimeError(f"{ended}; {log} ends:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} wrote no pid within {timeout_s:g} s; {log} ends:\n{_log_tail(log)}")
        time.sleep(0.02)
        pgid = _read_int(host_dir / LAUNCH_PID)
    if pgid == proc.pid:  # the script wrote its own pid: its start time goes beside it
        record_pid(host_dir / LAUNCH_START, pgid)
    active = run_dir.parent / ACTIVE_JOB
    partial = run_dir.parent / (ACTIVE_JOB + ".tmp")
    partial.write_text(f"{run_dir.name} {pgid}\n", encoding="utf-8")
    os.replace(partial, active)
    return {"pgid": pgid, "script": str(path), "log": str(log)}
