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


def test_ufw_refuses_the_cluster_ports_over_ipv6_too(host: Any) -> None:
    # prepare.yml turned ufw's IPv6 off (IPV6=no: IPv6 dropped, except on loopback); the role turned it on, so that
    # ufw refuses the ports over IPv6 as well (its reject rules have their (v6) twin), and ::1 gets the rules below.
    assert re.search(r"(?m)^IPV6=yes$", host.file("/etc/default/ufw").content_string)
    status = host.check_output("ufw status")
    for port in ("29500", "9840", "32768:60999"):
        assert re.search(rf"(?m)^{port}/tcp \(v6\)\s+REJECT\s+Anywhere \(v6\)\s*$", status), status
        assert not re.search(rf"(?m)^{port}/tcp \(v6\)\s+ALLOW", status), status  # the members are IPv4


def test_ufw_refuses_the_cluster_ports_to_every_local_account_but_root_and_the_jobs(host: Any) -> None:
    # ufw's before rules (IPv4 and IPv6): a SYN to the cluster ports of this host (any of its addresses, loopback
    # included) or of a member (IPv4) from any uid but root's and ugro's (firewall_job_user) gets a TCP reset. The uids
    # are matched as ranges (owner match), so that the kernel's own sockets (no uid) are never refused.
    uid = int(host.user("ugro").uid)
    others = (f"--uid-owner 1-{uid - 1} ", f"--uid-owner {uid + 1}-4294967294 ")
    variables = host.ansible.get_variables()
    members = [variables["ugro_cluster_address"], variables["testbed_bridge_address"]]
    ports = "-p tcp --syn -m multiport --dports 29500,32768:60999 "
    for rules, chain in (("before.rules", "ufw-before-output"), ("before6.rules", "ufw6-before-output")):
        content = host.file(f"/etc/ufw/{rules}").content_string
        begin, end = content.index("# BEGIN ugro (role firewall)"), content.index("# END ugro (role firewall)")
        assert end < content.index(f"-A {chain} -o lo -j ACCEPT")  # ahead of ufw's accept of loopback
        lines = [line for line in content[begin:end].splitlines() if line.startswith("-A")]
        wanted = [f"-A {chain} {ports}-m addrtype --dst-type LOCAL -m owner {o}" for o in others]
        wanted += [
            f"-A {chain} {ports}-d {m} -m owner {o}" for m in members if chain == "ufw-before-output" for o in others
        ]
        assert sorted(lines) == sorted(f"{w}-j REJECT --reject-with tcp-reset" for w in wanted), content[begin:end]
    live = host.check_output("iptables -S ufw-before-output")
    assert f"--uid-owner {uid + 1}-4294967294" in live, live


def test_preflight_reads_the_live_ipv4_and_ipv6_rules_as_members_only(host: Any) -> None:
    # What `make preflight` judges, from the facts ugro_host_facts reads on the host: ufw's (v6) rules included.
    from ugro.checks.preflight_network import firewall_check

    variables = host.ansible.get_variables()
    facts = host.ansible("ugro_host_facts", "gather_subset=firewall,ports", check=False)["ansible_facts"]["ugro_host"]
    ufw = facts["firewall"]["ufw"]
    assert ufw["active"] and ufw["ipv6"] is True
    assert {"action": "reject", "sources": None, "ports": [[29500, 29500]], "family": "ipv6"} in ufw["rules"]
    addresses = {"tb1": variables["ugro_cluster_address"], "controller": variables["testbed_bridge_address"]}
    cell = firewall_check("tb1", facts, addresses, 29500)
    assert (cell.status, cell.detail) == ("PASS", "members only (ufw)"), cell
