"""Role firewall (nftables) on each host: the package, the role's table and file, and tb1's own tables untouched.

tb1 had a firewall of its own and Docker's tables before the role (prepare.yml); these tests run after the
converge and the idempotence run, so both the role's load of its table and its second run left them alone.
Connections from inside and outside the subnet, a reload of the boot ruleset and a missing table are
verify.yml's (molecule/conftest.py runs it last): they need the other hosts or apply the role again.
"""

from __future__ import annotations

from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

TABLE_FILE = "/etc/nftables.d/ugro.nft"
BOOT_RULESET = "/etc/nftables.conf"


def _tables(host: Any) -> list[str]:
    return sorted(host.check_output("nft list tables").splitlines())


def _tables_before(host: Any) -> list[str]:
    """tb1's tables before the role (prepare.yml): its own inet filter and Docker's ip nat and ip filter."""
    if host.backend.get_hostname() != "tb1":
        return []
    return sorted(host.file("/root/tables.before").content_string.splitlines())


def test_nftables_is_installed(host: Any) -> None:
    assert host.package("nftables").is_installed


def test_only_the_roles_table_is_added(host: Any) -> None:
    before = _tables_before(host)
    if host.backend.get_hostname() == "tb1":
        assert before == ["table inet filter", "table ip filter", "table ip nat"]
    assert _tables(host) == sorted([*before, "table inet ugro"])


def test_the_hosts_own_and_dockers_tables_are_unchanged(host: Any) -> None:
    for table in _tables_before(host):
        family, name = table.split()[1:]
        saved = host.file(f"/root/table.{family}.{name}.before").content_string.strip()
        assert host.check_output(f"nft -s list table {family} {name}") == saved, table


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


def test_the_boot_ruleset_no_longer_flushes_the_whole_ruleset(host: Any) -> None:
    # tb1: prepare.yml's file; tb2: Debian's own, from the nftables package the role installed. Both started
    # with `flush ruleset`; the role put the reset of the file's own table in its place and dropped the include
    # of its table file that an earlier release added (tb1, prepare.yml).
    lines = [line.strip() for line in host.file(BOOT_RULESET).content_string.splitlines()]
    assert "flush ruleset" not in lines
    assert not [line for line in lines if line.startswith("include") and TABLE_FILE in line]
    reset = lines.index("table inet filter")
    assert lines[reset + 1] == "delete table inet filter"
    assert reset < lines.index("table inet filter {")


def _uid(host: Any, user: str) -> int:
    return int(host.user(user).uid)


def test_the_cluster_ports_refuse_every_local_account_but_root_and_the_jobs(host: Any) -> None:
    # The output chain: new connections (a SYN) to the cluster ports of this host (any of its addresses: fib daddr type
    # local, loopback included, IPv4 and IPv6) and of the members (the set members) are refused (TCP reset) unless the
    # socket is root's or the job's account's (molecule.yml: firewall_job_user ugro; prepare.yml creates it and guest).
    variables = host.ansible.get_variables()
    table = host.check_output("nft list table inet ugro")
    owners = f"meta skuid != {{ 0, {_uid(host, 'ugro')} }}"
    syn = "tcp flags syn / fin,syn,rst,ack"
    assert f"tcp dport {{ 29500, 32768-60999 }} {syn} {owners} fib daddr type local reject with tcp reset" in table
    assert f"tcp dport {{ 29500, 32768-60999 }} {syn} {owners} ip daddr @members reject with tcp reset" in table
    assert "type filter hook output priority" in table
    members = host.check_output("nft list set inet ugro members")
    assert variables["ugro_cluster_address"] in members
    assert variables["testbed_non_members"][0]["address"] not in members
    assert str(_uid(host, "guest")) not in table.split("meta skuid")[1].split("}")[0]


def test_preflight_reads_the_live_rules_as_members_only_over_ipv4_and_ipv6(host: Any) -> None:
    # What `make preflight` judges, from the facts ugro_host_facts reads on the host (IPv6 rules included).
    from ugro.checks.preflight_network import firewall_check

    runner = host.backend.ansible_runner
    addresses = {name: runner.get_variables(name)["ugro_cluster_address"] for name in runner.get_hosts("ugro_cluster")}
    facts = host.ansible("ugro_host_facts", "gather_subset=firewall,ports", check=False)["ansible_facts"]["ugro_host"]
    cell = firewall_check(host.backend.get_hostname(), facts, addresses, 29500)
    assert (cell.status, cell.detail) == ("PASS", "members only (nftables)"), cell
    assert facts["firewall"]["nftables"]["present"]
