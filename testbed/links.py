"""The test cluster's network: a Linux bridge on this machine, and per host a network namespace joined to it by a
veth pair whose far end carries the host's interface name and address; bare non-member hosts likewise.

Every namespace and link is recorded in the state before it is made, so that `down` removes it.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from testbed.state import write_state
from testbed.system import run, tool

# Non-members (up's non_members) get the addresses .201, .202, ... of the subnet.
NON_MEMBER_BASE = 200


def add_bridge(state: dict[str, Any]) -> None:
    """The bridge with the controller's address on the subnet (and, for rootfs hosts, on the outside network)."""
    ip, bridge = tool("ip"), state["bridge"]
    state["links"].append(bridge)
    write_state(state)
    run(ip, "link", "add", "name", bridge, "type", "bridge")
    run(ip, "addr", "add", f"{state['bridge_address']}/{ipaddress.IPv4Network(state['subnet']).prefixlen}",
        "dev", bridge)  # fmt: skip
    run(ip, "link", "set", "dev", bridge, "up")
    if state["rootfs"]:
        outside_prefix = ipaddress.IPv4Network(state["outside_subnet"]).prefixlen
        run(ip, "addr", "add", f"{state['outside_address']}/{outside_prefix}", "dev", bridge)


def add_host(state: dict[str, Any], host: dict[str, Any], ifname: str) -> None:
    """``host``'s namespace on the bridge, its end of the veth named ``ifname`` and holding its address."""
    ip, ns, veth = tool("ip"), host["namespace"], host["veth"]
    prefixlen = ipaddress.IPv4Network(state["subnet"]).prefixlen
    state["namespaces"].append(ns)
    state["links"].append(veth)
    write_state(state)
    run(ip, "netns", "add", ns)
    # The namespace end is created inside the namespace under the host's interface name.
    run(ip, "link", "add", "name", veth, "type", "veth", "peer", "name", ifname, "netns", ns)
    run(ip, "link", "set", "dev", veth, "master", state["bridge"], "up")
    run(ip, "-n", ns, "addr", "add", f"{host['address']}/{prefixlen}", "dev", ifname)
    run(ip, "-n", ns, "link", "set", "dev", ifname, "up")
    run(ip, "-n", ns, "link", "set", "dev", "lo", "up")


def add_outside_route(state: dict[str, Any], host: dict[str, Any]) -> None:
    """The LAN beyond the cluster subnet: the host can answer it, so "refused" can be tested."""
    run(tool("ip"), "-n", host["namespace"], "route", "add", state["outside_subnet"], "dev", host["interface"])


def add_non_member(state: dict[str, Any], host: dict[str, Any]) -> None:
    """A bare host of the subnet, not in the inventory: a namespace on the bridge with an address, nothing else."""
    add_host(state, host, "eth0")


def set_link(namespace: str, interface: str, up: bool) -> None:
    """Bring a host's interface down (a pulled cable: no RST, packets just stop) or back up."""
    run(tool("ip"), "netns", "exec", namespace, tool("ip"), "link", "set", interface, "up" if up else "down")
