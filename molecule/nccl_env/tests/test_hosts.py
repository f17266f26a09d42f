"""Role nccl_env on each host: the env file names the interface that really holds the host's address."""

from __future__ import annotations

import re
from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

ENV_FILE = "/etc/ugro/nccl.env"
OBSOLETE = {"NCCL_TREE_THRESHOLD", "NCCL_TIMEOUT", "NCCL_IB_TIMEOUT", "NCCL_ALGO", "NCCL_PROTO"}


def _env(host: Any) -> dict[str, str]:
    """The file read the way the launch script reads it: KEY=value lines, comments skipped."""
    out = {}
    for line in host.file(ENV_FILE).content_string.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("'\"")
    return out


def test_the_kernel_puts_the_cluster_address_on_the_testbed_interface(host: Any) -> None:
    hostvars = host.ansible.get_variables()
    address = re.escape(hostvars["ugro_cluster_address"])
    holders = [
        f[1]
        for f in map(str.split, host.check_output("ip -o -4 addr show").splitlines())
        if re.match(f"{address}/", f[3])
    ]
    assert holders == [hostvars["testbed_interface"]]


def test_the_env_file_names_the_hosts_own_interface(host: Any) -> None:
    interface = host.ansible.get_variables()["testbed_interface"]
    env = _env(host)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == interface
    assert env["NCCL_IB_DISABLE"] == "1"
    assert not {key.upper() for key in env} & OBSOLETE


def test_the_launch_script_sources_the_same_values(host: Any) -> None:
    interface = host.ansible.get_variables()["testbed_interface"]
    echo = 'echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME $NCCL_IB_DISABLE"'
    sourced = host.check_output(f"bash -c 'set -a; source {ENV_FILE}; set +a; {echo}'")
    assert sourced == f"{interface} {interface} 1"


def test_the_env_file_is_roots_and_world_readable(host: Any) -> None:
    env_file = host.file(ENV_FILE)
    assert (env_file.user, env_file.group, env_file.mode) == ("root", "root", 0o644)


def test_tb2_has_its_extra_variables(host: Any) -> None:
    if host.backend.get_hostname() == "tb2":
        assert {k: v for k, v in _env(host).items() if k in ("NCCL_DEBUG", "NCCL_P2P_DISABLE")} == {
            "NCCL_DEBUG": "WARN",
            "NCCL_P2P_DISABLE": "1",
        }
