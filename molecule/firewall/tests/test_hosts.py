"""Role firewall (nftables) on each host: the package, the role's table and file, and tb1's own table untouched.

Connections from inside and outside the subnet, the boot ruleset and a missing table are verify.yml's
(molecule/conftest.py runs it last): they need the other hosts or apply the role again.
"""

from __future__ import annotations

from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

TABLE_FILE = "/etc/nftables.d/ugro.nft"


def _tables(host: Any) -> list[str]:
    return sorted(host.check_output("nft list tables").splitlines())


def test_nftables_is_installed(host: Any) -> None:
    assert host.package("nftables").is_installed


def test_only_the_roles_table_is_added(host: Any) -> None:
    # tb1 had a firewall of its own before the role (prepare.yml); tb2 had none.
    own = ["table inet filter"] if host.backend.get_hostname() == "tb1" else []
    assert _tables(host) == sorted([*own, "table inet ugro"])


def test_tb1_own_table_is_unchanged(host: Any) -> None:
    if host.backend.get_hostname() != "tb1":
        return
    assert (
        host.check_output("nft -s list table inet filter") == host.file("/root/ruleset.before").content_string.strip()
    )


def test_the_table_opens_the_cluster_ports_to_the_members_only(host: Any) -> None:
    variables = host.ansible.get_variables()
    rules = host.file(TABLE_FILE)
    assert rules.is_file and rules.user == "root" and rules.mode == 0o644
    assert "ip saddr @cluster_sources tcp dport { 29500, 32768-60999 } accept" in rules.content_string
    assert "ip saddr @exporter_sources tcp dport 9840 accept" in rules.content_string
    assert "tcp dport { 29500, 9840, 32768-60999 } reject with tcp reset" in rules.content_string
    assert variables["testbed_subnet"] not in rules.content_string  # no rule for the whole subnet
    # The live set: the members (tb1, tb2: adjacent addresses, merged into a range), not the non-member nm1.
    members = host.check_output("nft list set inet ugro cluster_sources")
    assert variables["ugro_cluster_address"] in members
    assert variables["testbed_non_members"][0]["address"] not in members
    exporter = host.check_output("nft list set inet ugro exporter_sources")
    assert variables["testbed_bridge_address"] in exporter  # the controller reaches the exporter


def test_the_boot_ruleset_includes_the_table_file(host: Any) -> None:
    assert f'include "{TABLE_FILE}"' in host.file("/etc/nftables.conf").content_string.splitlines()
