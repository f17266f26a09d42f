"""The test cluster's Ansible inventory and ssh_config, written from its state (testbed/bringup.py ``up``); and
the copy of that inventory the multi-host tests and benchmarks run on (one CPU rank a host)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from testbed.state import Testbed

REPO = Path(__file__).resolve().parent.parent
# Not resolved: the venv's python is a symlink, and only the venv path gives the venv's packages.
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
SSH_OPTS = "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"


def _write_rootfs(state: dict[str, Any]) -> None:
    """Hosts of their own Debian: Ansible uses their Python, and nothing of this machine's is theirs."""
    directory = Path(state["dir"])
    hosts = {
        h["name"]: {
            "ansible_host": h["address"],
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(directory / "id_ed25519"),
            "ansible_ssh_common_args": SSH_OPTS,
            "ansible_control_path_dir": state["control_path_dir"],
            "ansible_python_interpreter": "/usr/bin/python3",
            "ugro_cluster_address": h["address"],
            "testbed_interface": h["interface"],
            "testbed_namespace": h["namespace"],
            "testbed_debian": h.get("debian", "12"),
        }
        for h in state["hosts"]
    }
    repo = state.get("apt_repo", {})
    group_vars = {
        "testbed_bridge_address": state["bridge_address"],
        "testbed_subnet": state["subnet"],
        "testbed_outside_address": state["outside_address"],
        "testbed_apt_proxy": state["apt_proxy"],
        "testbed_apt_repo_url": repo.get("url", ""),
        "testbed_apt_repo_keyring_url": repo.get("keyring_url", ""),
        "testbed_apt_repo": repo,
        "testbed_non_members": non_member_vars(state),
    }
    inventory = {"all": {"vars": group_vars, "children": {"ugro_cluster": {"hosts": hosts}}}}
    header = (
        "# Written by testbed/inventory.py: test hosts with their own Debian root filesystem\n"
        "# (network namespaces + bubblewrap + overlay + sshd), packages through the apt proxy.\n"
    )
    (directory / "inventory.yml").write_text(header + "---\n" + yaml.safe_dump(inventory, sort_keys=False))
    (directory / "ssh_config").write_text("\n".join(
        f"Host {h['name']}\n  HostName {h['address']}\n  User root\n  IdentityFile {directory / 'id_ed25519'}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        for h in state["hosts"]
    ))  # fmt: skip


def non_member_vars(state: dict[str, Any]) -> list[dict[str, str]]:
    return [{k: h[k] for k in ("name", "address", "namespace")} for h in state.get("non_members", [])]


def write(state: dict[str, Any]) -> None:
    directory = Path(state["dir"])
    key = str(directory / "id_ed25519")
    if state.get("rootfs"):
        _write_rootfs(state)
        return
    hosts = {
        h["name"]: {
            "ansible_host": h["address"],
            "ansible_user": "root",
            "ansible_ssh_private_key_file": key,
            "ansible_ssh_common_args": SSH_OPTS,
            "ansible_control_path_dir": state["control_path_dir"],
            "ansible_python_interpreter": str(VENV_PYTHON),
            "ugro_cluster_address": h["address"],
            "ugro_code_dir": "/opt/ugro",
            "ugro_python": str(VENV_PYTHON),
            "testbed_interface": h["interface"],
            "testbed_namespace": h["namespace"],
        }
        for h in state["hosts"]
    }
    inventory: dict[str, Any] = {"all": {"children": {"ugro_cluster": {"hosts": hosts}}}}
    if state.get("non_members"):
        inventory["all"]["vars"] = {"testbed_non_members": non_member_vars(state)}
    header = (
        "# Written by testbed/inventory.py: the testbed hosts (network namespaces + bubblewrap + sshd).\n"
        "# The cluster defaults come from the playbooks' role ugro (roles/ugro/defaults/main.yml).\n"
    )
    (directory / "inventory.yml").write_text(header + "---\n" + yaml.safe_dump(inventory, sort_keys=False))

    blocks = [
        f"Host {h['name']}\n"
        f"  HostName {h['address']}\n"
        "  User root\n"
        f"  IdentityFile {key}\n"
        "  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n"
        "  LogLevel ERROR\n"
        "  ControlMaster no\n"
        for h in state["hosts"]
    ]
    (directory / "ssh_config").write_text("\n".join(blocks))


def one_rank_per_host(bed: Testbed, path: Path) -> Path:
    """A copy of the testbed's inventory at ``path`` where every host starts one CPU rank with one thread: the
    test hosts share this machine's cores, and three ranks are what the multi-host tests and benchmarks run."""
    data = yaml.safe_load(Path(bed.inventory).read_text())
    for host in data["all"]["children"]["ugro_cluster"]["hosts"].values():
        host |= {"ugro_cpu_procs_per_node": 1, "ugro_omp_num_threads": 1}
    path.write_text(yaml.safe_dump(data))
    return path
