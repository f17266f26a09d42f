"""Role firewall (ufw) on tb1: ufw enabled, SSH allowed, the ports allowed to the members and refused elsewhere.

Connections from inside and outside the subnet are verify.yml's (molecule/conftest.py runs it last).
"""

from __future__ import annotations

import re
from typing import Any

testinfra_hosts = ["ansible://tb1"]


def test_ufw_is_active_with_ssh_and_the_cluster_ports_open_to_the_members_only(host: Any) -> None:
    assert host.package("ufw").is_installed
    status = host.check_output("ufw status")
    variables = host.ansible.get_variables()
    members = [variables["ugro_cluster_address"], variables["testbed_bridge_address"]]  # molecule.yml
    assert "Status: active" in status
    assert re.search(r"(?m)^22/tcp\s+ALLOW\s+Anywhere\s*$", status), status
    for port in ("29500", "9840", "32768:60999"):
        for member in members:
            assert re.search(rf"(?m)^{port}/tcp\s+ALLOW\s+{re.escape(member)}\s*$", status), status
        assert re.search(rf"(?m)^{port}/tcp\s+REJECT\s+Anywhere\s*$", status), status
        assert variables["testbed_subnet"] not in status  # no rule for the whole subnet
    # Every allow rule comes before the reject rules (ufw: the first rule that matches wins).
    lines = [line for line in status.splitlines() if "ALLOW" in line or "REJECT" in line]
    last_allow = max(i for i, line in enumerate(lines) if "ALLOW" in line and "(v6)" not in line)
    assert last_allow < min(i for i, line in enumerate(lines) if "REJECT" in line), status
    assert host.file("/etc/ufw/ugro-rules").contains(f"allow proto tcp from {members[0]} to any port 29500")


def test_nothing_of_the_nftables_backend_is_left(host: Any) -> None:
    # prepare.yml applied the role with nftables first, added the include of an earlier release and the unit of a
    # systemd host; ufw now holds the rules, so the role removed the table and everything that loaded it.
    assert "table inet ugro" not in host.check_output("nft list tables").splitlines()
    assert not host.file("/etc/nftables.d/ugro.nft").exists
    for unit in ("ugro-firewall.service", "sysinit.target.wants/ugro-firewall.service"):
        path = host.file(f"/etc/systemd/system/{unit}")
        assert not path.exists and not path.is_symlink, unit
    # Debian's boot ruleset is as the package installed it: its `flush ruleset` back, no include of the table.
    assert host.file("/etc/nftables.conf").content_string == host.file("/root/nftables.conf.before").content_string
