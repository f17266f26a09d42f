"""The cluster an inventory describes, as the controller needs it before a launch: hosts, rendezvous, copying.

Read with ``ansible-inventory --list`` (Ansible's own reading of the file, group_vars and host_vars included),
so what the controller plans with is what the playbooks will see.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GROUP = "ugro_cluster"


class InventoryError(RuntimeError):
    """The inventory cannot be read, or has no usable ugro_cluster group; the message says how to fix it."""


@dataclass(frozen=True)
class Cluster:
    hosts: list[str]  # inventory order
    main_host: str  # serves the rendezvous; writes the run's checkpoints, metrics and adapter
    remote: bool  # False where the hosts write into the controller's own checkout (ugro_code_sync: false)
    # Every host's variables as the inventory sets them (group_vars and host_vars merged, not templated; role
    # defaults are not among them).
    hostvars: dict[str, dict[str, Any]] = field(default_factory=dict)


def _members(groups: dict[str, dict[str, list[str]]], name: str) -> list[str]:
    group = groups.get(name, {})
    found = list(group.get("hosts", []))
    for child in group.get("children", []):
        found += [h for h in _members(groups, child) if h not in found]
    return found


def _listing(inventory: Path) -> dict[str, Any]:
    binary = Path(sys.executable).parent / "ansible-inventory"
    out = subprocess.run(
        [str(binary), "-i", str(inventory), "--list"], capture_output=True, text=True, timeout=120, check=False
    )
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise InventoryError(f"{inventory}: ansible-inventory cannot read it: {first}")
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def read_cluster(inventory: Path) -> Cluster:
    data = _listing(inventory)
    hostvars: dict[str, dict[str, Any]] = data.get("_meta", {}).get("hostvars", {})
    hosts = _members(data, GROUP)
    if not hosts:
        raise InventoryError(f"{inventory}: no hosts in group '{GROUP}'; list the cluster under all.children.{GROUP}")
    first = hostvars.get(hosts[0], {})
    chosen = first.get("ugro_main_host", first.get("ugro_rendezvous_host"))  # its former name, still read
    main_host = chosen if isinstance(chosen, str) and chosen in hosts else hosts[0]
    remote = all(hostvars.get(h, {}).get("ugro_code_sync", True) is not False for h in hosts)
    return Cluster(hosts=hosts, main_host=main_host, remote=remote, hostvars=hostvars)
