"""The test hosts' processes, from /proc: whether a recorded process still runs (its pid and start time), the
processes inside a host's PID namespace, and stopping them all (SIGTERM, a grace, SIGKILL to each host's init)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of a live process, or None."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[19])


def is_ours(proc: dict[str, Any]) -> bool:
    """Whether the recorded process still runs: same pid and same start time (pids get reused)."""
    stat = proc_stat(int(proc["pid"]))
    if stat is None:
        return False
    state, _, start = stat
    if state in ("Z", "X"):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(int(proc["pid"]), os.WNOHANG)  # reap it if it is our own child
        return False
    return start == int(proc["starttime"])


def children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[1] == pid:
                kids.append(int(entry.name))
    return kids


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def namespace_members(init: dict[str, Any]) -> list[int]:
    """Every process in the PID namespace of a host's init: all of them were started inside the host."""
    if not is_ours(init):
        return []
    ns = pid_namespace(int(init["pid"]))
    if ns is None or ns == pid_namespace(os.getpid()):
        return []  # never our own namespace
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and pid_namespace(int(e.name)) == ns]


def send(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(procs: Sequence[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    alive = [p for p in procs if is_ours(p)]
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.03)
        alive = [p for p in alive if is_ours(p)]
    return alive


def stop_processes(procs: Sequence[dict[str, Any]], grace_s: float = 2.0) -> list[dict[str, Any]]:
    """Stop the recorded processes and whatever runs inside the hosts; returns any still alive.

    Every process inside a host's PID namespace gets SIGTERM (sshd, its sessions, whatever a test
    started there) and `grace_s` to exit; then SIGKILL to the host's init ends the namespace, and
    with it anything left in it. The bwrap processes outside exit with their init; any recorded
    process still alive after that gets SIGKILL. Recorded pids are checked against their recorded
    start time first, so a reused pid is never signalled.
    """
    inits = [p for p in procs if p.get("role") == "init"]
    # An up that failed between starting bwrap and reading its info left the init unrecorded:
    # it is the bwrap's child in a PID namespace other than ours.
    known = {int(p["pid"]) for p in inits}
    for proc in procs:
        if proc.get("role") == "bwrap" and is_ours(proc):
            for kid in children(int(proc["pid"])):
                stat = proc_stat(kid)
                if kid not in known and stat and pid_namespace(kid) not in (None, pid_namespace(os.getpid())):
                    inits.append({"pid": kid, "starttime": stat[2], "role": "init", "host": proc.get("host")})
    members = sorted({pid for init in inits for pid in namespace_members(init)})
    send(members, signal.SIGTERM)
    services = ("sshd", "apt-proxy", "apt-repo")
    send([int(p["pid"]) for p in procs if p.get("role") in services and is_ours(p)], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(set(namespace_members(i)) - {int(i["pid"])} for i in inits):
        time.sleep(0.03)
    send([int(p["pid"]) for p in inits if is_ours(p)], signal.SIGKILL)
    alive = wait_gone(procs, 2.0)
    if alive:
        send([int(p["pid"]) for p in alive], signal.SIGKILL)
        alive = wait_gone(alive, 2.0)
    return alive
