"""What a test cluster is, and the record `up` keeps of it in <dir>/state.json.

The record names every namespace, link, mount and process `up` made, written before each is made, so that
`down` (testbed/teardown.py) undoes exactly that and nothing else, after a complete `up` or a partial one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed import procs

DEFAULT_DIR = ".testbed"
STATE_FILE = "state.json"


class TestbedError(RuntimeError):
    """Raised for anything that keeps a testbed from coming up or going down, with the reason."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class TestbedHost:
    name: str
    address: str
    interface: str
    namespace: str

    __test__ = False


@dataclass(frozen=True)
class Testbed:
    dir: Path
    hosts: list[TestbedHost]
    inventory: Path
    key: Path
    ssh_config: Path
    bridge: str
    bridge_address: str
    subnet: str
    rootfs: bool = False
    outside_address: str = ""

    __test__ = False

    def host(self, name: str) -> TestbedHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @classmethod
    def load(cls, directory: str | Path) -> Testbed:
        """The testbed that `up` left in `directory` (for example by `make testbed-up`)."""
        state = read_state(Path(directory).resolve())
        if state is None or not state.get("complete"):
            raise TestbedError(f"no complete testbed in {directory}: run `python -m testbed up` first")
        return testbed_from_state(state)


def testbed_from_state(state: dict[str, Any]) -> Testbed:
    directory = Path(state["dir"])
    return Testbed(
        dir=directory,
        hosts=[TestbedHost(h["name"], h["address"], h["interface"], h["namespace"]) for h in state["hosts"]],
        inventory=directory / "inventory.yml",
        key=directory / "id_ed25519",
        ssh_config=directory / "ssh_config",
        bridge=state["bridge"],
        bridge_address=state["bridge_address"],
        subnet=state["subnet"],
        rootfs=bool(state.get("rootfs")),
        outside_address=state.get("outside_address", ""),
    )


def name_suffix(directory: Path) -> str:
    """Six hex digits from the testbed's directory: two testbeds in two directories never share a name."""
    return hashlib.sha256(str(directory).encode()).hexdigest()[:6]


def read_state(directory: Path) -> dict[str, Any] | None:
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def write_state(state: dict[str, Any]) -> None:
    path = Path(state["dir"]) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def record_process(state: dict[str, Any], pid: int, role: str, host: str) -> None:
    stat = procs.proc_stat(pid)
    if stat is None:
        return  # it has gone already; nothing to stop later
    state["processes"].append({"pid": pid, "starttime": stat[2], "role": role, "host": host})
    write_state(state)
