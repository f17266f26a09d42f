"""The shipped inventories parse, and every playbook sees the shared defaults at the lowest precedence.

The defaults of every cluster (rendezvous port, main host, code directory, Python, ...) are role defaults
(roles/ugro/defaults/main.yml), loaded first by every play, so any value a user's inventory sets wins.
These tests run real ansible-inventory and ansible-playbook: a play that loads the defaults as
playbooks/ do and prints what each host sees.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO, Run

from ugro.module_utils import ugro_jobstate

BIN = Path(sys.executable).parent
ENV = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}

# What a play of playbooks/ sees on each host: the defaults loaded as every playbook loads them (role ugro
# first, the cluster addresses published), and the rendezvous address as playbooks/train.yml computes it.
SHOW_PLAYBOOK = """
- name: Show the settings every playbook sees.
  hosts: ugro_cluster
  gather_facts: false
  pre_tasks:
    - name: Publish every host's cluster address.
      ansible.builtin.include_role:
        name: ugro
        tasks_from: cluster_address
  roles:
    - role: ugro
  tasks:
    - name: Write them down on the controller.
      ansible.builtin.copy:
        content: "{{ seen | to_json }}"
        dest: "{{ show_dir }}/{{ inventory_hostname }}.json"
        mode: "0644"
      delegate_to: localhost
      vars:
        seen:
          port: "{{ ugro_rendezvous_port }}"
          main_host: "{{ ugro_main_host }}"
          rendezvous_address: "{{ hostvars[ugro_main_host]['ugro_cluster_address'] }}"
          code_dir: "{{ ugro_code_dir }}"
          python: "{{ ugro_python }}"
          code_sync: "{{ ugro_code_sync }}"
"""


def _inventory(path: Path) -> dict[str, Any]:
    result = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(path), "--list"], capture_output=True, text=True, check=True, env=ENV
    )
    return json.loads(result.stdout)


def _seen(ansible_playbook: Run, inventory: Path, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Per host, the settings a play of playbooks/ sees with this inventory (real ansible-playbook)."""
    playbook, show_dir = tmp_path / "show.yml", tmp_path / "seen"
    playbook.write_text(SHOW_PLAYBOOK)
    show_dir.mkdir()
    result = ansible_playbook(inventory, playbook, "-e", f"show_dir={show_dir}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in show_dir.glob("*.json")}


def _user_inventory(tmp_path: Path, group_vars: dict[str, Any]) -> Path:
    """A user's inventory/cluster.yml beside the repository's inventory/group_vars, as the README has it."""
    directory = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory" / "group_vars", directory / "group_vars")
    group: dict[str, Any] = {
        "hosts": {
            "node1": {"ansible_host": "10.9.0.1", "ansible_connection": "local"},
            "node2": {"ansible_host": "10.9.0.2", "ansible_connection": "local"},
        }
    }
    if group_vars:
        group["vars"] = group_vars
    path = directory / "cluster.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {"ugro_cluster": group}}}))
    return path


@pytest.mark.parametrize(
    ("path", "hosts"),
    [
        ("inventory/local.yml", ["localhost"]),
        ("inventory/reference-cluster.example.yml", ["master", "node4070", "node3070"]),
    ],
)
def test_inventory_has_the_cluster_group(path: str, hosts: list[str]) -> None:
    assert _inventory(REPO / path)["ugro_cluster"]["hosts"] == hosts


def test_every_playbook_loads_the_shared_defaults_first() -> None:
    for playbook in sorted((REPO / "playbooks").glob("*.yml")):
        for play in yaml.safe_load(playbook.read_text()):
            first = (play.get("roles") or [{}])[0]
            assert (first.get("role") if isinstance(first, dict) else first) == "ugro", (
                f"{playbook.name}: play '{play['name']}' must list role ugro first (the shared defaults)"
            )


def test_shipped_group_vars_set_nothing() -> None:
    """inventory/group_vars is the user's: a value there would outrank their inventory file's own group vars."""
    for path in (REPO / "inventory" / "group_vars").rglob("*"):
        if path.is_file():
            assert yaml.safe_load(path.read_text()) is None, f"{path} sets variables: ship defaults in a role"


def test_the_inventorys_own_group_vars_win_over_the_shipped_defaults(tmp_path: Path, ansible_playbook: Run) -> None:
    inventory = _user_inventory(tmp_path, {"ugro_main_host": "node2", "ugro_rendezvous_port": 29600})
    seen = _seen(ansible_playbook, inventory, tmp_path)
    for host in ("node1", "node2"):
        assert seen[host]["main_host"] == "node2"
        assert int(seen[host]["port"]) == 29600
        # node2's address is its default (ansible_host), published so that node1 reads it too.
        assert seen[host]["rendezvous_address"] == "10.9.0.2"
        # What the inventory leaves unset comes from the shared defaults.
        assert seen[host]["code_dir"] == "/opt/ugro"
        assert seen[host]["python"] == "/opt/ugro/.venv/bin/python"


def test_the_main_host_s_former_name_is_still_read(tmp_path: Path, ansible_playbook: Run) -> None:
    """An inventory written before ugro_main_host was named so: ugro_rendezvous_host still chooses the main host,
    for the plays and for the controller."""
    from ugro.hosts.inventory import read_cluster

    inventory = _user_inventory(tmp_path, {"ugro_rendezvous_host": "node2"})
    seen = _seen(ansible_playbook, inventory, tmp_path)
    assert {host: seen[host]["main_host"] for host in ("node1", "node2")} == {"node1": "node2", "node2": "node2"}
    assert read_cluster(inventory).main_host == "node2"


def test_the_shared_defaults_apply_where_the_inventory_sets_nothing(tmp_path: Path, ansible_playbook: Run) -> None:
    seen = _seen(ansible_playbook, _user_inventory(tmp_path, {}), tmp_path)
    for host in ("node1", "node2"):
        assert seen[host]["main_host"] == "node1"  # the first host of ugro_cluster
        assert int(seen[host]["port"]) == 29500
        assert seen[host]["rendezvous_address"] == "10.9.0.1"
        assert seen[host]["python"] == "/opt/ugro/.venv/bin/python"
        assert seen[host]["code_sync"] in (True, "True")


def test_the_local_inventory_runs_this_checkout_on_loopback(tmp_path: Path, ansible_playbook: Run) -> None:
    seen = _seen(ansible_playbook, REPO / "inventory" / "local.yml", tmp_path)["localhost"]
    assert seen["main_host"] == "localhost" and int(seen["port"]) == 29500
    assert seen["rendezvous_address"] == "127.0.0.1"
    assert seen["code_sync"] in (False, "False")


@pytest.mark.parametrize("playbook", ["status.yml", "stop.yml"])
def test_a_play_refuses_a_job_id_that_is_not_one_path_component(playbook: str, ansible_playbook: Run) -> None:
    """The plays read the job-id pattern from role ugro's vars (written once for them) before anything runs; its
    copies, in the host modules and in role train_launch, which ship or run alone, are the same pattern."""
    plays = yaml.safe_load((REPO / "roles" / "ugro" / "vars" / "main.yml").read_text())["__ugro_job_id_pattern"]
    launch = yaml.safe_load((REPO / "roles" / "train_launch" / "vars" / "main.yml").read_text())
    assert plays == launch["__train_launch_job_id_pattern"] == ugro_jobstate.JOB_ID.pattern
    local = REPO / "inventory" / "local.yml"
    result = ansible_playbook(local, REPO / "playbooks" / playbook, "-e", "ugro_job_id=../etc")
    assert result.returncode != 0, result.stdout[-3000:]
    assert "ugro_job_id must name a job, such as default-20261121-190000, not '../etc'" in result.stdout, result.stdout
