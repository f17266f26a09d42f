"""The preflight's network rows: the cluster interface and names, the firewall, the rendezvous and ephemeral ports
between every pair of hosts (what ``ugro_net_probe`` measured), the clocks."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from ugro.checks.preflight_report import Cell, Check, Thresholds

NETWORK_ROWS = ("reachable", "rendezvous port", "ephemeral ports")


def ifname_matches(spec: str, ifname: str) -> bool | None:
    """Whether NCCL/GLOO_SOCKET_IFNAME ``spec`` selects interface ``ifname``; None for an exclusion list."""
    if spec.startswith("^"):
        return None
    exact = spec.startswith("=")
    for part in spec.lstrip("=").split(","):
        part = part.strip()
        if part and (ifname == part if exact else ifname.startswith(part)):
            return True
    return False


def interface_check(host: str, facts: dict[str, Any], address: str) -> Cell:
    interfaces: dict[str, list[str]] = facts.get("interfaces", {})
    holder = facts.get("cluster", {}).get("interface")
    env = facts.get("env_file", {})
    path = env.get("path", "the env file")
    if env.get("error"):
        return Cell("FAIL", "unreadable", f"{path}: {env['error']}", f"fix or remove {path} on {host}")
    if holder is None:
        where = ", ".join(f"{n} {'/'.join(a)}" for n, a in interfaces.items() if n != "lo") or "none"
        return Cell(
            "FAIL",
            "no interface",
            f"no interface on {host} holds its cluster address {address} ({where})",
            f"set ugro_cluster_address of {host} to one of its own addresses in the inventory",
        )
    ifnames: dict[str, str] = env.get("ifnames", {})
    if not env.get("exists") or not ifnames:
        note = f"no {path}" if not env.get("exists") else f"{path} names no interface"
        return Cell("PASS", f"{holder} (detected; {note})")
    for var, spec in sorted(ifnames.items()):
        match = ifname_matches(spec, holder)
        if match is None:
            return Cell(
                "WARN",
                f"{var}={spec}",
                f"{var}={spec} in {path} is an exclusion list; not verified",
                f"name the interface ({holder}) in {path} on {host}",
            )
        if not match:
            exists = any(ifname_matches(spec, n) for n in interfaces)
            why = "selects another interface" if exists else "matches no interface here"
            return Cell(
                "FAIL",
                f"{var}={spec}",
                f"{var}={spec} in {path} {why}; {address} is on {holder}",
                f"set NCCL_SOCKET_IFNAME={holder} and GLOO_SOCKET_IFNAME={holder} in {path} on {host}",
            )
    return Cell("PASS", f"{holder} ({path})")


def names_check(host: str, facts: dict[str, Any], addresses: dict[str, str]) -> Cell:
    resolved: dict[str, dict[str, Any]] = facts.get("resolve", {})
    bad: list[str] = []
    lines: list[str] = []
    for name, want in addresses.items():
        if re.fullmatch(r"[0-9.]+", name):
            continue
        got = resolved.get(name, {})
        if got.get("address") != want:
            bad.append(f"{name} -> {got.get('address') or got.get('error') or 'nothing'}")
            lines.append(f"{want} {name}")
    if not bad:
        return Cell("PASS", f"{len(addresses)} names")
    return Cell(
        "FAIL",
        f"{len(bad)} wrong",
        f"{host} resolves {'; '.join(bad)} (want the cluster address)",
        f"put '{', '.join(lines)}' in /etc/hosts on {host} (no 127.0.1.1 line for its own name)",
    )


FIREWALL_FIX = (
    "make provision ANSIBLE_ARGS='--tags firewall' (role firewall, firewall_allow_from: members, the default): "
    "the cluster ports then accept the inventory's hosts only (docs/security.md)"
)


def _accepted_from(rules: list[dict[str, Any]], port: int, open_by_default: bool) -> list[str] | None:
    """The sources a connection to ``port`` is accepted from under ``rules`` (first match wins); None: anywhere."""
    accepted: list[str] = []
    for rule in rules:
        ports = rule.get("ports")
        if ports is not None and not any(low <= port <= high for low, high in ports):
            continue
        if rule.get("sources") is None:
            return None if rule.get("action") == "accept" else accepted
        if rule.get("action") == "accept":
            accepted += rule["sources"]
    return None if open_by_default else accepted


def _of_family(rules: list[dict[str, Any]], version: int) -> list[dict[str, Any]]:
    """The rules that a connection over IPv4 (``version`` 4) or IPv6 (6) can match: not those of the other family
    (``family``, or their sources)."""
    kept = []
    for rule in rules:
        if rule.get("family") not in (None, f"ipv{version}"):
            continue
        sources = rule.get("sources")
        if sources is not None:
            sources = [s for s in sources if ipaddress.ip_network(s, strict=False).version == version]
            if not sources:
                continue
        kept.append(dict(rule, sources=sources))
    return kept


def _beyond(sources: list[str], members: set[str]) -> list[str]:
    """The sources that are more than one member's address: a network, or an address of no member (any IPv6 one:
    the members are IPv4)."""
    extra = []
    for source in dict.fromkeys(sources):
        net = ipaddress.ip_network(source, strict=False)
        if not (net.prefixlen == 32 and str(net.network_address) in members):
            extra.append(str(net) if net.prefixlen < net.max_prefixlen else str(net.network_address))
    return extra


def _open_beyond(
    rules: list[dict[str, Any]], ports: list[int], open_by_default: bool, members: set[str]
) -> list[str] | None:
    """Who beyond the members reaches any of ``ports`` under ``rules``: [] none, None anyone, else the sources."""
    extra: list[str] = []
    for p in ports:
        accepted = _accepted_from(rules, p, open_by_default)
        if accepted is None:
            return None
        extra += [e for e in _beyond(accepted, members) if e not in extra]
    return extra


def _open_cell(host: str, shown: str, name: str, extra: list[str] | None, ipv6: bool) -> Cell:
    who = "anywhere" if extra is None else ", ".join(extra)
    over = " over IPv6" if ipv6 else ""
    detail = (
        "open to all" if extra is None else f"open to {extra[0]}" + (f" +{len(extra) - 1}" if len(extra) > 1 else "")
    )
    if not ipv6:
        return Cell(
            "WARN",
            detail,
            f"{host}'s ports {shown} accept connections from {who} ({name}), more than the cluster's members; "
            "nothing behind them authenticates",
            f"on {host}: {FIREWALL_FIX}",
        )
    how = (
        "it sets IPV6=yes in /etc/default/ufw, so that ufw refuses the ports over IPv6 too"
        if name == "ufw"
        else "its table refuses the ports over IPv6"
    )
    return Cell(
        "WARN",
        detail + over,
        f"{host}'s ports {shown} accept IPv6 connections from {who} ({name}): the cluster is IPv4, but the c10d "
        "stores listen on IPv6 too (dual-stack), and nothing behind the ports authenticates",
        f"on {host}: {FIREWALL_FIX}; {how} (or remove the rule that accepts them over IPv6)",
    )


def firewall_check(host: str, facts: dict[str, Any], addresses: dict[str, str], port: int) -> Cell:
    """Whether the host's rendezvous port and ephemeral range accept its cluster's members only, over IPv4 and IPv6
    (the members are IPv4: over IPv6 they must accept no one)."""
    if ipaddress.IPv4Address(addresses.get(host) or "0.0.0.0").is_loopback:
        return Cell("PASS", "loopback only")
    fw = facts.get("firewall")
    if fw is None:
        return Cell("SKIP", "not gathered")
    low, _, high = str(facts.get("port_range") or "32768-60999").partition("-")
    ports = sorted({port, int(low), int(high or low)})
    shown = f"{port} and {low}-{high or low}"
    members = {a for a in addresses.values()}
    # (name, rules, IPv4 open by default, IPv6 open by default or None where the firewall drops IPv6 whole)
    firewalls: list[tuple[str, list[dict[str, Any]], bool, bool | None]] = []
    if fw.get("nftables") and fw["nftables"].get("present"):
        firewalls.append((f"nftables table inet {fw['nftables']['table']}", fw["nftables"]["rules"], True, True))
    if fw.get("ufw") and fw["ufw"].get("active"):
        allow = fw["ufw"].get("default_incoming") == "allow"
        # IPV6=no: ufw drops every IPv6 packet but loopback's.
        firewalls.append(("ufw", fw["ufw"]["rules"], allow, None if fw["ufw"].get("ipv6") is False else allow))
    if not firewalls and fw.get("why"):
        return Cell(
            "SKIP",
            "unreadable",
            f"{host}'s firewall could not be read: {fw['why']}"[:300],
            f"let {host}'s ansible_user run nft/ufw through sudo without a password, or check by hand",
        )
    if not firewalls:
        return Cell(
            "WARN",
            "open to all",
            f"no ugro firewall on {host} (no nftables table inet ugro, no active ufw): its ports {shown} accept "
            "connections from anywhere on the LAN, and nothing behind them authenticates",
            f"on {host}: {FIREWALL_FIX}",
        )
    # A connection must pass every firewall of the host: per family, the one that lets the fewest through decides.
    closer: dict[int, str] = {}
    least: dict[int, tuple[str, list[str] | None]] = {}
    for name, rules, open4, open6 in firewalls:
        for version, by_default in ((4, open4), (6, open6)):
            extra = [] if by_default is None else _open_beyond(_of_family(rules, version), ports, by_default, members)
            if extra is not None and not extra:
                closer.setdefault(version, name)
            elif version not in least or (least[version][1] is None and extra is not None):
                least[version] = (name, extra)
    for version in (4, 6):
        if version not in closer:
            name, extra = least[version]
            return _open_cell(host, shown, name, extra, ipv6=version == 6)
    return _services_in_range(host, facts, low, high or low) or Cell("PASS", f"members only ({closer[4].split()[0]})")


def _services_in_range(host: str, facts: dict[str, Any], low: str, high: str) -> Cell | None:
    """A WARN when the host's own services listen inside the ephemeral range that the members-only firewall closes:
    nftables and ufw cannot tell NCCL's and gloo's sockets from theirs, so no device outside the cluster reaches
    them any more."""
    listeners = facts.get("range_listeners") or []
    if not listeners:
        return None
    shown = ", ".join(f"{entry['process']} on {entry['port']}" for entry in listeners[:5])
    more = f" and {len(listeners) - 5} more" if len(listeners) > 5 else ""
    return Cell(
        "WARN",
        f"members only; cuts {len(listeners)} service(s)",
        f"{host}'s firewall refuses the ports {low}-{high} to every device outside the cluster (NCCL and gloo listen "
        f"there), and {host}'s own services listen inside that range: {shown}{more}. Only the cluster's hosts reach "
        "them now",
        f"on {host}: give each a fixed port outside {low}-{high}, or narrow the range (sysctl "
        "net.ipv4.ip_local_port_range) so that their ports fall outside it, then make provision "
        "ANSIBLE_ARGS='--tags firewall'",
    )


def _connections(reports: dict[str, dict[str, Any]], label: str) -> list[dict[str, Any]]:
    found = []
    for host, report in reports.items():
        for result in (report.get("network") or {}).get("connect", []):
            if result.get("label") == label:
                found.append({**result, "from": host})
    return found


def _listener(report: dict[str, Any], label: str) -> dict[str, Any]:
    """What ugro_net_probe's listener ``label`` of one host did: {port, peers, error}; {} when it had none."""
    return dict((report.get("network") or {}).get("listen", {}).get(label) or {})


def rendezvous_row(reports: dict[str, dict[str, Any]], main_host: str, port: int, hosts: list[str]) -> Check:
    check = Check("rendezvous port")
    listen = _listener(reports.get(main_host, {}), "rendezvous")
    results = {r["from"]: r for r in _connections(reports, "rendezvous")}
    bind_error = listen.get("error")
    failed = {h: r for h, r in results.items() if not r.get("ok")}
    for host in hosts:
        if host not in reports:
            continue
        if host == main_host and bind_error and "in use" in bind_error:
            check.cells[host] = Cell(
                "FAIL",
                "in use",
                f"{bind_error} on {host}",
                f"stop what listens on {port} there (a job still running?) or change ugro_rendezvous_port",
            )
            continue
        if host == main_host and failed:
            names = ", ".join(sorted(failed))
            first = next(iter(failed.values()))
            check.cells[host] = Cell(
                "FAIL",
                f"{len(failed)} blocked",
                f"{names} cannot connect to {main_host}:{port}: {first.get('error')}",
                f"allow tcp {port} from the cluster subnet in the firewall of {main_host} "
                "(make provision ANSIBLE_ARGS='--tags firewall', or nft/ufw by hand)",
            )
            continue
        result = results.get(host)
        if result is None:
            check.cells[host] = Cell("SKIP", "not tried")
        elif result.get("ok"):
            check.cells[host] = Cell("PASS", f"rtt {result['rtt_s'] * 1000:.1f} ms")
        else:
            check.cells[host] = Cell(
                "FAIL",
                "cannot connect",
                f"{host} -> {main_host}:{port}: {result.get('error')}",
                f"allow tcp {port} from the cluster subnet on {main_host}",
            )
    return check


def ephemeral_row(reports: dict[str, dict[str, Any]], hosts: list[str], addresses: dict[str, str]) -> Check:
    check = Check("ephemeral ports")
    if len(hosts) == 1:
        for host in reports:
            check.cells[host] = Cell("PASS", "single host")
        return check
    results = _connections(reports, "ephemeral")
    # Whose fault is a failed connection s -> t? The source's (output rules, routing) when t accepts others
    # but s reaches nobody; otherwise the target's (input rules). One blocked host is one FAIL.
    reached = {r["host"] for r in results if r.get("ok")}
    reaching = {r["from"] for r in results if r.get("ok")}

    def sources_fault(r: dict[str, Any]) -> bool:
        return r["host"] in reached and r["from"] not in reaching

    failed = [r for r in results if not r.get("ok")]
    for host in hosts:
        if host not in reports:
            continue
        listen = _listener(reports[host], "ephemeral")
        port, bind_error = listen.get("port"), listen.get("error")
        inbound = [r for r in failed if r["host"] == host and not bind_error and not sources_fault(r)]
        outbound = [r for r in failed if r["from"] == host and sources_fault(r)]
        mine = [r for r in results if r["from"] == host]
        if bind_error:
            check.cells[host] = Cell(
                "WARN",
                "not tested",
                f"{bind_error} on {host}: the probe's port was busy",
                "run make preflight again (it picks another port)",
            )
        elif inbound:
            peers = ", ".join(sorted(r["from"] for r in inbound))
            port_range = (reports[host].get("host") or {}).get("port_range") or "32768-60999"
            check.cells[host] = Cell(
                "FAIL",
                f"{len(inbound)} blocked",
                f"{peers} cannot connect to {host}:{port} ({inbound[0].get('error')}); "
                "NCCL/gloo connect back on such ports",
                f"allow tcp {port_range} (the ephemeral range) from the cluster subnet on {host}, not only the "
                "rendezvous port (make provision ANSIBLE_ARGS='--tags firewall')",
            )
        elif outbound:
            peers = ", ".join(sorted(r["host"] for r in outbound))
            check.cells[host] = Cell(
                "FAIL",
                "cannot connect",
                f"{host} cannot connect to {peers} (other hosts can): {outbound[0].get('error')}",
                f"check the output rules of {host}'s firewall and its route to {addresses.get(outbound[0]['host'])}",
            )
        else:
            ok = sum(1 for r in mine if r.get("ok"))
            elsewhere = sorted(r["host"] for r in mine if not r.get("ok"))
            check.cells[host] = Cell(
                "PASS", f"{ok} peers" + (f" ({', '.join(elsewhere)}: see there)" if elsewhere else "")
            )
    return check


def clock_row(reports: dict[str, dict[str, Any]], main_host: str, t: Thresholds) -> Check:
    check = Check("clock skew")
    for host, report in reports.items():
        if host == main_host:
            check.cells[host] = Cell("PASS", "reference")
            continue
        connected = (report.get("network") or {}).get("connect", [])
        result = next((r for r in connected if r.get("host") == main_host and "offset_s" in r), None)
        if result is None:
            check.cells[host] = Cell("SKIP", "not measured")
            continue
        offset = float(result["offset_s"])
        detail = f"{offset * 1000:+.0f} ms"
        if abs(offset) <= t.clock_skew_warn_s:
            check.cells[host] = Cell("PASS", detail)
        else:
            check.cells[host] = Cell(
                "WARN",
                detail,
                f"{host}'s clock is {offset:+.1f} s off {main_host}'s; logs and timeouts disagree",
                f"enable time sync (systemd-timesyncd or chrony) on {host} and {main_host}",
            )
    return check
