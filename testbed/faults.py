"""Faults: what the recovery tests and `make bench-recovery` do to a test host mid-job (its ranks or its job
killed, its cable pulled), and the processes inside a host found from this machine."""

from __future__ import annotations

import signal
from pathlib import Path

from testbed import links, procs
from testbed.state import Testbed, TestbedError, read_state


def _members(directory: str | Path, host: str) -> list[int]:
    """The pids (as this machine sees them) of every process inside ``host``."""
    state = read_state(Path(directory).resolve())
    if state is None:
        raise TestbedError(f"no testbed in {directory}")
    inits = [p for p in state["processes"] if p.get("role") == "init" and p.get("host") == host]
    return [pid for init in inits for pid in procs.namespace_members(init)]


def _read_proc(pid: int, name: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def host_processes(directory: str | Path, host: str, marker: str) -> list[int]:
    """The pids (as this machine sees them) of the processes inside ``host`` whose command line has ``marker``."""
    return [pid for pid in _members(directory, host) if marker in (_read_proc(pid, "cmdline") or "")]


def host_ranks(directory: str | Path, host: str) -> list[int]:
    """The pids (as this machine sees them) of the ranks inside ``host``: processes named ``ugro-rank<N>`` (a rank
    names itself so, whether torchrun started it or train/launcher.py forked it with the launcher's command line)."""
    return [pid for pid in _members(directory, host) if (_read_proc(pid, "comm") or "").startswith("ugro-rank")]


def kill_ranks(directory: str | Path, host: str) -> list[int]:
    """SIGKILL every rank inside ``host`` (a crashed rank, the launcher on that host left running)."""
    pids = host_ranks(directory, host)
    procs.send(pids, signal.SIGKILL)
    return pids


def kill_processes(directory: str | Path, host: str, marker: str) -> list[int]:
    """SIGKILL every process inside ``host`` whose command line has ``marker`` (a host crash, as the job sees it)."""
    pids = host_processes(directory, host, marker)
    procs.send(pids, signal.SIGKILL)
    return pids


def set_link(directory: str | Path, host: str, up: bool) -> None:
    """Bring ``host``'s cluster interface down (a pulled cable: no RST, packets just stop) or back up."""
    target = Testbed.load(directory).host(host)
    links.set_link(target.namespace, target.interface, up)
