"""The shipped inventories parse, and give every host what the launch playbook needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

BIN = Path(sys.executable).parent


def _inventory(path: str) -> dict:
    result = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(REPO / path), "--list"],
        capture_output=True, text=True, check=True, env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
    )  # fmt: skip
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("path", "hosts"),
    [
        ("inventory/local.yml", ["localhost"]),
        ("inventory/reference-cluster.example.yml", ["master", "node4070", "node3070"]),
    ],
)
def test_inventory_has_the_cluster_group_and_its_defaults(path: str, hosts: list[str]) -> None:
    data = _inventory(path)
    assert data["ugro_cluster"]["hosts"] == hosts
    for host in hosts:
        hostvars = data["_meta"]["hostvars"][host]
        assert hostvars["ugro_rendezvous_port"] == 29500
        assert "ugro_code_dir" in hostvars and "ugro_python" in hostvars
