"""Role firewall refuses the settings it no longer reads, naming the host and the fix, before it changes anything
(an inventory written for the include in /etc/nftables.conf would otherwise be silently ignored)."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

from helpers import ansible_playbook


def _validate_play(hosts: str, then: str = "") -> str:
    """A play of role firewall's checks only (its validate phase), and ``then``'s tasks after them."""
    return f"""
- name: The firewall role's checks.
  hosts: {hosts}
  gather_facts: false
  tasks:
    - name: Validate.
      ansible.builtin.include_role:
        name: firewall
        tasks_from: validate.yml
{then}"""


PLAY = _validate_play("node1")


def test_an_obsolete_firewall_setting_is_refused_naming_host_and_fix(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        "all:\n  hosts:\n    node1:\n      ansible_connection: local\n      firewall_nftables_enable_service: true\n"
    )
    (tmp_path / "play.yml").write_text(PLAY)
    run = ansible_playbook(inventory, tmp_path / "play.yml")
    assert run.returncode != 0, run.stdout
    assert "node1 sets firewall_nftables_enable_service, which role firewall no longer reads" in run.stdout, run.stdout
    assert "Fix: delete them from group_vars/host_vars" in run.stdout
    assert run.stdout.count("TASK [firewall :") == 1, run.stdout  # refused at its first check


UIDS_PLAY = _validate_play(
    "ugro_cluster",
    """    - name: Show the uids.
      ansible.builtin.debug:
        msg: "uids={{ __firewall_local_uids | to_json }} account={{ __firewall_job_account }}"
""",
)


def _cluster(tmp_path: Path, host_vars: str = "") -> Path:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        "all:\n  children:\n    ugro_cluster:\n      hosts:\n        node1:\n          ansible_connection: local\n"
        "          ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
        "          ugro_cluster_address: 127.0.0.1\n" + host_vars
    )
    (tmp_path / "play.yml").write_text(UIDS_PLAY)
    return inventory


def test_the_jobs_account_is_the_one_ansible_logs_in_as_and_root_is_always_allowed(tmp_path: Path) -> None:
    # A local connection logs in as this process's account; nobody (by name) and a bare uid are firewall_local_users.
    inventory = _cluster(tmp_path, "          firewall_local_users: [nobody, '0']\n")
    run = ansible_playbook(inventory, tmp_path / "play.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    login = pwd.getpwuid(os.getuid())
    uids = sorted({0, login.pw_uid, pwd.getpwnam("nobody").pw_uid})
    assert f"uids={json.dumps(uids)} account={login.pw_name}" in run.stdout, run.stdout


def test_a_jobs_account_that_is_no_account_of_the_host_is_refused_naming_host_and_fix(tmp_path: Path) -> None:
    inventory = _cluster(tmp_path, "          firewall_job_user: ugro-no-such-account\n")
    run = ansible_playbook(inventory, tmp_path / "play.yml")
    assert run.returncode != 0, run.stdout
    out = " ".join(run.stdout.split())
    assert 'ugro-no-such-account (firewall_job_user "ugro-no-such-account") is no account of node1' in out, out
    assert "Fix: set firewall_job_user of node1 to the account that runs the ranks there" in out
    assert "uids=" not in out
