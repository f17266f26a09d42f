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


def test_the_table_file_opens_the_ports_to_the_subnet_only(host: Any) -> None:
    subnet = host.ansible.get_variables()["testbed_subnet"]
    rules = host.file(TABLE_FILE)
    assert rules.is_file and rules.user == "root" and rules.mode == 0o644
    assert f"ip saddr {subnet} tcp dport {{ 29500, 9840, 32768-60999 }} accept" in rules.content_string
    assert "tcp dport { 29500, 9840, 32768-60999 } reject with tcp reset" in rules.content_string


def test_the_boot_ruleset_includes_the_table_file(host: Any) -> None:
    assert f'include "{TABLE_FILE}"' in host.file("/etc/nftables.conf").content_string.splitlines()
