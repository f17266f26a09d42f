"""Role cluster_network on each host: every node's name resolves to its cluster address through the role's
/etc/hosts block (the rest of the file kept), and known_hosts holds the other node's real host key.

SSH with strict host key checking and the interface entry point are verify.yml's (molecule/conftest.py runs it last).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import testinfra

testinfra_hosts = ["ansible://ugro_cluster"]

NODES = ("tb1", "tb2")


def _other(host: Any) -> str:
    return next(node for node in NODES if node != host.backend.get_hostname())


def _node(name: str) -> Any:
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    return testinfra.get_host(f"ansible://{name}", ansible_inventory=str(inventory))


def test_every_node_resolves_to_its_cluster_address(host: Any) -> None:
    for node in NODES:
        address = _node(node).ansible.get_variables()["ugro_cluster_address"]
        assert host.check_output(f"getent hosts {node}").split()[0] == address


def test_etc_hosts_keeps_the_rest_of_the_file(host: Any) -> None:
    lines = host.file("/etc/hosts").content_string.splitlines()
    assert "127.0.0.1       localhost" in lines
    assert "::1     localhost ip6-localhost ip6-loopback" in lines
    assert not [line for line in lines if line.startswith("127.0.1.1")]
    assert len([line for line in lines if line.startswith("# BEGIN ugro cluster nodes")]) == 1


def test_known_hosts_holds_the_other_nodes_real_key(host: Any) -> None:
    other = _node(_other(host))
    real = " ".join(other.file("/etc/ssh/ssh_host_ed25519_key.pub").content_string.split()[:2])
    for name in (_other(host), other.ansible.get_variables()["ugro_cluster_address"]):
        found = host.check_output(f"ssh-keygen -F {name} -f /etc/ssh/ssh_known_hosts").splitlines()
        assert real in [" ".join(line.split()[1:3]) for line in found if not line.startswith("#")], name
