"""Which private subnet a test cluster takes: one nothing on this machine overlaps, the first free one for
``--subnet auto``, the "outside" network beside it, and the dead testbeds an interrupted run left on it."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from testbed import procs, teardown
from testbed.state import STATE_FILE, TestbedError, read_state
from testbed.system import run


def outside_network(net: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    """A network beside the cluster subnet (10.213.12.0/24 -> 10.214.12.0/24): "the rest of the LAN"."""
    return ipaddress.IPv4Network((int(net.network_address) + (1 << 16), net.prefixlen))


def check_subnet_free(net: ipaddress.IPv4Network) -> None:
    """Refuse a subnet that any address or route on this machine already overlaps."""
    addrs = json.loads(run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    for link in addrs:
        for info in link.get("addr_info", []):
            iface = ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}")
            if iface.network.overlaps(net):
                raise TestbedError(
                    f"subnet {net} overlaps {iface} on {link['ifname']} (another testbed? pass --subnet)"
                )
    routes = json.loads(run("ip", "-j", "-4", "route", "show").stdout or "[]")
    for route in routes:
        dst = route.get("dst", "")
        if dst and dst != "default" and ipaddress.IPv4Network(dst, strict=False).overlaps(net):
            raise TestbedError(f"subnet {net} overlaps the route to {dst} via {route.get('dev')}; pass --subnet")


def free_subnet(first: int = 100, last: int = 199) -> str:
    """The first 10.213.N.0/24 (N in first..last) that neither it nor its outside network overlaps anything here."""
    for octet in range(first, last + 1):
        net = ipaddress.IPv4Network(f"10.213.{octet}.0/24")
        with contextlib.suppress(TestbedError):
            reclaim_dead(net)
            check_subnet_free(net)
            check_subnet_free(outside_network(net))
            return str(net)
    raise TestbedError(f"no free subnet in 10.213.{first}.0/24..10.213.{last}.0/24: `ip -br addr` shows who holds them")


def _testbed_dirs() -> dict[str, Path]:
    """The directory of every testbed that has its tmpfs mounted on this machine, by suffix."""
    found: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, source = left.split(), right.split()
        if len(fields) > 4 and len(source) > 1 and re.fullmatch(r"ugro-testbed-[0-9a-f]{6}", source[1]):
            mount_point = fields[4].replace("\\040", " ")
            found[source[1].rsplit("-", 1)[1]] = Path(mount_point).parent
    return found


def _is_dead(state: dict[str, Any]) -> bool:
    """A testbed none of whose recorded processes runs any more: its hosts are gone, only its devices are left.

    One still being brought up (incomplete, written in the last minutes) is never dead.
    """
    if any(procs.is_ours(proc) for proc in state.get("processes", [])):
        return False
    age_s = time.time() - (Path(state["dir"]) / STATE_FILE).stat().st_mtime
    return bool(state.get("complete")) or age_s > 600


def reclaim_dead(net: ipaddress.IPv4Network) -> list[Path]:
    """Take down every dead testbed whose bridge holds an address in `net` (left by an interrupted run).

    A testbed is found by its tmpfs mount and taken down from its own state file, like `down` would;
    one with a process still running is left alone.
    """
    dirs = _testbed_dirs()
    addrs = json.loads(run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    reclaimed = []
    for link in addrs:
        name = str(link.get("ifname", ""))
        overlaps = any(
            ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}").network.overlaps(net)
            for info in link.get("addr_info", [])
        )
        directory = dirs.get(name.removeprefix("ugbr-")) if name.startswith("ugbr-") else None
        state = read_state(directory) if overlaps and directory else None
        if state is None or directory is None or state.get("bridge") != name or not _is_dead(state):
            continue
        print(f"testbed: taking down the dead testbed in {directory} ({state['subnet']}, left by an "
              "interrupted run: none of its processes runs)", file=sys.stderr)  # fmt: skip
        teardown.down(directory)
        reclaimed.append(directory)
    return reclaimed
