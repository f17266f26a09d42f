"""Role firewall refuses the settings it no longer reads, naming the host and the fix, before it changes anything
(an inventory written for the include in /etc/nftables.conf would otherwise be silently ignored)."""

from __future__ import annotations

from pathlib import Path

from helpers import ansible_playbook

PLAY = """
- name: The firewall role's checks only.
  hosts: node1
  gather_facts: false
  tasks:
    - name: Validate.
      ansible.builtin.include_role:
        name: firewall
        tasks_from: validate.yml
"""


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
