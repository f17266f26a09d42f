"""Judge what the preflight role measured: one row per check, one cell per host, PASS / WARN / FAIL.

Pure functions over the ``preflight_report`` fact of every host (roles/preflight): ``host`` is what the
host module ``ugro_host_facts`` gathered there (``ansible_facts.ugro_host``), ``network`` what
``ugro_net_probe`` measured (``listen``: label -> port, peers, error; ``connect``: one result per target),
``error`` why a module failed. ugro/checks/preflight.py runs the playbook and renders the result. Every
non-PASS cell says its cause and its fix in one line each.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ugro.stack import cuda as stack
from ugro.stack import lockfile as locks

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
ORDER: dict[str, int] = {"PASS": 0, "SKIP": 1, "WARN": 2, "FAIL": 3}
VERSION_ROWS = ("python", "torch", "cuda runtime", "nccl", "transformers", "peft", "unsloth")
NETWORK_ROWS = ("reachable", "rendezvous port", "ephemeral ports")
GIB = 1 << 30


@dataclass
class Cell:
    status: Status
    detail: str = ""
    cause: str = ""
    fix: str = ""


@dataclass
class Check:
    name: str
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class Thresholds:
    min_free_gb: float = 2.0  # free disk for checkpoints on the rendezvous host
    busbw_floor_gbps: float = 0.05  # GB/s (nccl-tests' unit); 1 GbE tops out near 0.117
    clock_skew_warn_s: float = 1.0
    memory_headroom: float = 0.90  # WARN when the peak is above this share of the device


@dataclass
class Report:
    hosts: list[str]
    rendezvous_host: str
    checks: list[Check] = field(default_factory=list)
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> figures

    def row(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def failed(self, rows: tuple[str, ...] | None = None) -> bool:
        return any(
            cell.status == "FAIL" for c in self.checks if rows is None or c.name in rows for cell in c.cells.values()
        )

    def problems(self) -> list[tuple[str, str, Cell]]:
        return [
            (c.name, h, cell) for c in self.checks for h, cell in c.cells.items() if cell.status in ("WARN", "FAIL")
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": not self.failed(),
                "hosts": self.hosts,
                "rendezvous_host": self.rendezvous_host,
                "checks": [{"name": c.name, "cells": {h: asdict(x) for h, x in c.cells.items()}} for c in self.checks],
                "measurements": self.measurements,
            },
            indent=2,
        )


def _same_everywhere(
    name: str, values: dict[str, str | None], rendezvous: str, fix: str, missing_ok: bool = True
) -> Check:
    """A row where every host must report the same value; the majority (ties: the rendezvous host) is right."""
    check = Check(name)
    counts = Counter(values.values())
    top = max(counts.values(), default=0)
    majority = [v for v, n in counts.items() if n == top]
    reference = values.get(rendezvous) if values.get(rendezvous) in majority else majority[0] if majority else None
    others = {v for v in values.values()}
    for host, value in values.items():
        if value == reference:
            shown = value if value is not None else "not installed"
            if value is None and not missing_ok:
                check.cells[host] = Cell("FAIL", shown, f"{name} missing on every host", fix.format(ref="?", host=host))
            else:
                check.cells[host] = Cell("PASS", shown)
            continue
        where = ", ".join(h for h, v in values.items() if v == reference)
        check.cells[host] = Cell(
            "FAIL",
            value or "not installed",
            f"{name} {value or 'not installed'} on {host}, {reference or 'not installed'} on {where}",
            fix.format(ref=reference, host=host),
        )
    del others
    return check


def _ifname_matches(spec: str, ifname: str) -> bool | None:
    """Whether NCCL/GLOO_SOCKET_IFNAME ``spec`` selects interface ``ifname``; None for an exclusion list."""
    if spec.startswith("^"):
        return None
    exact = spec.startswith("=")
    for part in spec.lstrip("=").split(","):
        part = part.strip()
        if part and (ifname == part if exact else ifname.startswith(part)):
            return True
    return False


def _interface_check(host: str, facts: dict[str, Any], address: str) -> Cell:
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
        match = _ifname_matches(spec, holder)
        if match is None:
            return Cell(
                "WARN",
                f"{var}={spec}",
                f"{var}={spec} in {path} is an exclusion list; not verified",
                f"name the interface ({holder}) in {path} on {host}",
            )
        if not match:
            exists = any(_ifname_matches(spec, n) for n in interfaces)
            why = "selects another interface" if exists else "matches no interface here"
            return Cell(
                "FAIL",
                f"{var}={spec}",
                f"{var}={spec} in {path} {why}; {address} is on {holder}",
                f"set NCCL_SOCKET_IFNAME={holder} and GLOO_SOCKET_IFNAME={holder} in {path} on {host}",
            )
    return Cell("PASS", f"{holder} ({path})")


def _names_check(host: str, facts: dict[str, Any], addresses: dict[str, str]) -> Cell:
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


def _beyond(sources: list[str], members: set[str]) -> list[str]:
    """The sources that are more than one member's address: a network, or an address of no member."""
    extra = []
    for source in dict.fromkeys(sources):
        net = ipaddress.IPv4Network(source, strict=False)
        if not (net.prefixlen == 32 and str(net.network_address) in members):
            extra.append(str(net) if net.prefixlen < 32 else str(net.network_address))
    return extra


def _firewall_check(host: str, facts: dict[str, Any], addresses: dict[str, str], port: int) -> Cell:
    """Whether the host's rendezvous port and ephemeral range accept its cluster's members only."""
    if ipaddress.IPv4Address(addresses.get(host) or "0.0.0.0").is_loopback:
        return Cell("PASS", "loopback only")
    fw = facts.get("firewall")
    if fw is None:
        return Cell("SKIP", "not gathered")
    low, _, high = str(facts.get("port_range") or "32768-60999").partition("-")
    ports = sorted({port, int(low), int(high or low)})
    shown = f"{port} and {low}-{high or low}"
    members = {a for a in addresses.values()}
    firewalls: list[tuple[str, list[dict[str, Any]], bool]] = []
    if fw.get("nftables") and fw["nftables"].get("present"):
        firewalls.append((f"nftables table inet {fw['nftables']['table']}", fw["nftables"]["rules"], True))
    if fw.get("ufw") and fw["ufw"].get("active"):
        firewalls.append(("ufw", fw["ufw"]["rules"], fw["ufw"].get("default_incoming") == "allow"))
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
    worst: tuple[str, list[str] | None] | None = None
    for name, rules, open_by_default in firewalls:
        extra: list[str] | None = []
        for p in ports:
            accepted = _accepted_from(rules, p, open_by_default)
            if accepted is None:
                extra = None
                break
            assert extra is not None
            extra += [e for e in _beyond(accepted, members) if e not in extra]
        if extra is not None and not extra:
            return _services_in_range(host, facts, low, high or low) or Cell(
                "PASS", f"members only ({name.split()[0]})"
            )
        if worst is None or (worst[1] is None and extra is not None):
            worst = (name, extra)
    assert worst is not None
    name, extra = worst
    who = "anywhere" if extra is None else ", ".join(extra)
    return Cell(
        "WARN",
        "open to all" if extra is None else f"open to {extra[0]}" + (f" +{len(extra) - 1}" if len(extra) > 1 else ""),
        f"{host}'s ports {shown} accept connections from {who} ({name}), more than the cluster's members; "
        "nothing behind them authenticates",
        f"on {host}: {FIREWALL_FIX}",
    )


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


def _disk_check(host: str, facts: dict[str, Any], rendezvous: str, t: Thresholds) -> Cell:
    disk = facts.get("disk", {})
    free = disk.get("free_bytes", 0) / GIB
    detail = f"{free:.1f} GiB free"
    if free >= t.min_free_gb:
        return Cell("PASS", detail)
    where = disk.get("measured_at", disk.get("path", "?"))
    status: Status = "FAIL" if host == rendezvous else "WARN"
    what = "checkpoints are written here (rendezvous host)" if host == rendezvous else "logs are written here"
    return Cell(
        status,
        detail,
        f"{free:.2f} GiB free at {where} on {host}, below {t.min_free_gb:g} GiB; {what}",
        f"free space on {host} under {where} (old runs/, caches) or raise the disk",
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


def _rendezvous_row(reports: dict[str, dict[str, Any]], rendezvous: str, port: int, hosts: list[str]) -> Check:
    check = Check("rendezvous port")
    listen = _listener(reports.get(rendezvous, {}), "rendezvous")
    results = {r["from"]: r for r in _connections(reports, "rendezvous")}
    bind_error = listen.get("error")
    failed = {h: r for h, r in results.items() if not r.get("ok")}
    for host in hosts:
        if host not in reports:
            continue
        if host == rendezvous and bind_error and "in use" in bind_error:
            check.cells[host] = Cell(
                "FAIL",
                "in use",
                f"{bind_error} on {host}",
                f"stop what listens on {port} there (a job still running?) or change ugro_rendezvous_port",
            )
            continue
        if host == rendezvous and failed:
            names = ", ".join(sorted(failed))
            first = next(iter(failed.values()))
            check.cells[host] = Cell(
                "FAIL",
                f"{len(failed)} blocked",
                f"{names} cannot connect to {rendezvous}:{port}: {first.get('error')}",
                f"allow tcp {port} from the cluster subnet in the firewall of {rendezvous} "
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
                f"{host} -> {rendezvous}:{port}: {result.get('error')}",
                f"allow tcp {port} from the cluster subnet on {rendezvous}",
            )
    return check


def _ephemeral_row(reports: dict[str, dict[str, Any]], hosts: list[str], addresses: dict[str, str]) -> Check:
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


def _clock_row(reports: dict[str, dict[str, Any]], rendezvous: str, t: Thresholds) -> Check:
    check = Check("clock skew")
    for host, report in reports.items():
        if host == rendezvous:
            check.cells[host] = Cell("PASS", "reference")
            continue
        connected = (report.get("network") or {}).get("connect", [])
        result = next((r for r in connected if r.get("host") == rendezvous and "offset_s" in r), None)
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
                f"{host}'s clock is {offset:+.1f} s off {rendezvous}'s; logs and timeouts disagree",
                f"enable time sync (systemd-timesyncd or chrony) on {host} and {rendezvous}",
            )
    return check


def _python_row(facts: dict[str, dict[str, Any]]) -> Check:
    """Each host's Python must have a lock: every lock pins the same versions, so Pythons may differ by host."""
    check = Check("python")
    supported = sorted(p.parent.name.removeprefix("py") for p in locks.LOCKS.glob("py3.*/node.txt"))
    for host, f in facts.items():
        version = str(f["versions"].get("python") or "?")
        minor = ".".join(version.split(".")[:2])
        if minor in supported:
            check.cells[host] = Cell("PASS", version)
        else:
            check.cells[host] = Cell(
                "FAIL",
                version,
                f"{host} runs Python {version}, which has no lock (requirements/locks: {', '.join(supported)})",
                f"install one of Python {', '.join(supported)} on {host}, set python_env_interpreter to it and run "
                "make provision",
            )
    return check


def _unsloth_row(facts: dict[str, dict[str, Any]], values: dict[str, str | None], rendezvous: str, fix: str) -> Check:
    """unsloth where it is installed must be one version; a host without it is fine unless it has a GPU."""
    installed: dict[str, str | None] = {h: v for h, v in values.items() if v}
    check = _same_everywhere("unsloth", installed, rendezvous, fix) if installed else Check("unsloth")
    for host in values:
        if host in installed:
            continue
        if facts[host].get("gpu", {}).get("gpus"):
            check.cells[host] = Cell(
                "WARN",
                "not installed",
                f"{host} has a GPU but no unsloth: it trains with transformers + peft",
                f"make provision ANSIBLE_ARGS='--limit {host}' (a GPU host gets requirements/locks/py3.X/gpu.txt)",
            )
        else:
            check.cells[host] = Cell("PASS", "not installed (no GPU)")
    return check


def lock_cuda() -> tuple[str | None, str]:
    """The CUDA runtime of the node lock (what torch runs on the GPU hosts), or None and why not."""
    try:
        cuda = stack.lock_cuda_runtime(locks.LOCKS)
        stack.min_driver(cuda)
        stack.torch_build(cuda)
    except (stack.StackError, OSError) as exc:
        return None, str(exc)
    return cuda, ""


def _torch(facts: dict[str, Any]) -> str:
    return str(facts.get("versions", {}).get("torch") or "?")


def _cards(facts: dict[str, Any]) -> str:
    return ", ".join(sorted({str(g.get("name")) for g in facts.get("gpu", {}).get("gpus") or []})) or "its GPU"


def _driver_fix(host: str) -> str:
    return (
        f'set nvidia_driver_version: "{stack.pinned_driver()}" (role nvidia_driver\'s default, R580) for every node, '
        f"run make provision ANSIBLE_ARGS='--tags nvidia_driver --limit {host}' and reboot {host} "
        "(nvidia_driver_reboot_allowed: true lets the role do it)"
    )


def _runs(driver: str, cuda: str) -> bool:
    try:
        return stack.driver_ok(driver, cuda)
    except stack.StackError:  # not a version nvidia-smi should print: not one that runs anything
        return False


def _driver_row(facts: dict[str, dict[str, Any]], rendezvous: str, cuda: str | None) -> Check:
    """Every GPU host's driver: new enough for torch's CUDA runtime (the lock's), and the same everywhere."""
    drivers = {h: str(f["gpu"]["driver"]) for h, f in facts.items() if f.get("gpu", {}).get("driver")}
    check = _same_everywhere(
        "driver", dict(drivers), rendezvous, "install driver {ref} on {host} and hold it (apt-mark hold), then reboot"
    )
    if cuda is None:
        return check
    floor = stack.min_driver(cuda)
    for host, driver in drivers.items():
        if not _runs(driver, cuda):
            check.cells[host] = Cell(
                "FAIL",
                f"{driver} < {floor}",
                f"{host} ({_cards(facts[host])}) runs driver {driver}, older than the {floor} that CUDA {cuda} "
                f"(torch {_torch(facts[host])}'s runtime) needs: torch sees no GPU there",
                _driver_fix(host),
            )
        elif check.cells[host].status == "PASS":
            check.cells[host] = Cell("PASS", f"{driver} (CUDA {cuda} needs >= {floor})")
    return check


def _arch_row(facts: dict[str, dict[str, Any]], cuda: str | None, why: str) -> Check:
    """Every GPU's compute capability against the architectures torch's CUDA build was compiled for."""
    check = Check("gpu arch")
    for host, f in facts.items():
        gpus = f.get("gpu", {}).get("gpus") or []
        if not gpus:
            check.cells[host] = Cell("PASS", "no GPU")
            continue
        if cuda is None:
            check.cells[host] = Cell("WARN", "not judged", f"no CUDA runtime to judge against: {why}", "run make lock")
            continue
        seen: dict[str, str] = {}
        dead: list[tuple[str, str]] = []
        unknown: list[str] = []
        for g in gpus:
            name, cc = str(g.get("name")), g.get("compute_cap")
            if cc is None:
                unknown.append(name)
            elif stack.support(cc, cuda) == "none":
                dead.append((name, cc))
            else:
                cubin = stack.cubin_for(cc, cuda)
                seen.setdefault(
                    name, f"{cc} {cubin}" if cubin == f"sm_{cc.replace('.', '')}" else f"{cc} runs {cubin or 'PTX'}"
                )
        build = stack.torch_build(cuda)
        torch = _torch(f)
        if dead:
            name, cc = dead[0]
            check.cells[host] = Cell(
                "FAIL",
                f"{cc} unsupported",
                f"{host}'s {name} is compute capability {cc}: torch {torch}'s CUDA {cuda} build has kernels for "
                f"{build.arch_list()} only (CUDA 13 dropped Maxwell, Pascal and Volta)",
                f"replace the {name} in {host} with a Turing (7.5) or newer card, or take {host} out of ugro_cluster",
            )
        elif unknown:
            check.cells[host] = Cell(
                "WARN",
                "not reported",
                f"nvidia-smi on {host} does not report the compute capability of {', '.join(unknown)}",
                f"install the pinned driver on {host} (make provision ANSIBLE_ARGS='--tags nvidia_driver')",
            )
        else:
            check.cells[host] = Cell("PASS", "; ".join(seen.values()))
    return check


def _backend_row(facts: dict[str, dict[str, Any]], cuda: str | None, requested: str, report: Report) -> Check:
    """What each host trains with: unsloth or transformers + peft, on CUDA or on CPU (train/model.py's choice)."""
    check = Check("backend")
    for host, f in facts.items():
        gpus = f.get("gpu", {}).get("gpus") or []
        if cuda is None:
            label = "hf (CPU, gloo)" if not gpus else "not judged"
            check.cells[host] = Cell(
                "PASS" if not gpus else "WARN", label, "no CUDA runtime in the lock", "run make lock"
            )
            continue
        choice = stack.backend(
            [g.get("compute_cap") for g in gpus],
            f.get("gpu", {}).get("driver"),
            cuda,
            bool(f.get("versions", {}).get("unsloth")),
            requested,
        )
        report.measurements.setdefault(host, {})["backend"] = {"name": choice.name, "device": choice.device}
        if choice.ok:
            check.cells[host] = Cell("PASS", choice.label())
            continue
        fixes = {
            "no gpu": "use model.backend 'auto' (unsloth where it can run) or 'hf' in the job file",
            "driver": _driver_fix(host),
            "arch": f"replace the card in {host} with a Turing (7.5) or newer one, or take {host} out of ugro_cluster",
            "no unsloth": "make provision (GPU hosts get requirements/locks/py3.X/gpu.txt) or model.backend 'auto'",
        }
        shown = f"{choice.name}, CPU (no CUDA)" if choice.problem == "driver" else choice.label()
        check.cells[host] = Cell("FAIL", shown, f"{host} ({_cards(f)}): {choice.why}", fixes[choice.problem or ""])
    return check


def _running_row(facts: dict[str, dict[str, Any]]) -> Check:
    """One job per host at a time: a live job holds the rendezvous port and the devices."""
    check = Check("running job")
    for host, f in facts.items():
        running = f.get("running_job")
        if not running:
            check.cells[host] = Cell("PASS", "none")
        else:
            job = running["job"]
            check.cells[host] = Cell(
                "FAIL",
                job[:24],
                f"{host} already runs job {job}",
                f"wait for it to finish (make status JOB_ID={job}) or stop it: make stop JOB_ID={job}",
            )
    return check


def judge_fast(
    reports: dict[str, dict[str, Any]],
    unreachable: dict[str, str],
    hosts: list[str],
    rendezvous: str,
    addresses: dict[str, str],
    port: int,
    controller_hash: str,
    code_sync: dict[str, bool],
    thresholds: Thresholds,
    python_of: dict[str, str] | None = None,
    backend: str = "auto",
    cuda: tuple[str | None, str] | None = None,
) -> Report:
    """The fast rows from every host's report; hosts with no report are FAIL in `reachable` and SKIP elsewhere.

    ``backend`` is the job's model.backend; ``cuda`` the CUDA runtime torch runs on the GPU hosts (and why
    there is none), by default the node lock's (``lock_cuda``).
    """
    report = Report(hosts, rendezvous)
    python_of = python_of or {}
    reach = Check("reachable")
    ok: dict[str, dict[str, Any]] = {}
    for host in hosts:
        r = reports.get(host)
        if host in unreachable or r is None:
            reach.cells[host] = Cell(
                "FAIL",
                "unreachable",
                f"{host}: {unreachable.get(host, 'no report')}"[:300],
                f"check ansible_host/ansible_user of {host} and that `ssh {host}` works",
            )
        elif not r.get("host") or not r.get("network"):
            # The host modules' messages end in "Fix: ..." where they know it.
            cause, _, fix = str(r.get("error") or "no report").partition(" Fix: ")
            reach.cells[host] = Cell(
                "FAIL",
                "module failed",
                (cause if cause.startswith(f"{host}:") else f"{host}: {cause}")[:300],
                fix or f"fix what the message names on {host}, then rerun make preflight",
            )
        elif r["host"].get("python", {}).get("why"):
            python = python_of.get(host, "ugro_python")
            reach.cells[host] = Cell(
                "FAIL",
                "no python",
                f"{host}: the job's Python {python} could not run: {r['host']['python']['why']}"[:300],
                f"provision {host} (the repository's .venv at ugro_code_dir) or fix ugro_python ({python})",
            )
        else:
            reach.cells[host] = Cell("PASS", "ssh + python")
            ok[host] = r
    report.checks.append(reach)

    facts = {h: r["host"] for h, r in ok.items()}
    report.checks.append(_running_row(facts))
    report.checks.append(_python_row(facts))
    for row in VERSION_ROWS[1:]:
        values = {h: f["versions"].get(row) for h, f in facts.items()}
        fix = (
            "install " + row.replace(" ", "-") + " {ref} on {host}: make provision"
            " (its venv gets requirements/locks/py3.X/node.txt, + gpu.txt on a GPU host)"
        )
        if row == "unsloth":
            report.checks.append(_unsloth_row(facts, values, rendezvous, fix))
        else:
            report.checks.append(_same_everywhere(row, values, rendezvous, fix))

    code = Check("train code")
    for host, f in facts.items():
        got = f.get("code", {}).get("hash")
        if got == controller_hash:
            code.cells[host] = Cell("PASS", got[:12])
        elif code_sync.get(host, True):
            what = got[:12] if got else f"({f['code'].get('why')})"
            code.cells[host] = Cell(
                "WARN",
                (got or "none")[:12],
                f"{host}'s code {what} is not the controller's {controller_hash[:12]}",
                "nothing to do: `make train` syncs it before launching",
            )
        else:
            code.cells[host] = Cell(
                "FAIL",
                (got or "none")[:12],
                f"{host}'s code differs from the controller's {controller_hash[:12]} and ugro_code_sync is false",
                f"update the checkout of {host} or set ugro_code_sync: true",
            )
    report.checks.append(code)

    gpu = Check("gpu")
    for host, f in facts.items():
        g = f.get("gpu", {})
        if g.get("gpus"):
            names = ", ".join(f"{x['name']} {x['memory_mib'] / 1024:.0f} GiB" for x in g["gpus"])
            gpu.cells[host] = Cell("PASS", names)
        else:
            gpu.cells[host] = Cell(
                "WARN",
                "none (CPU, gloo)",
                f"no GPU on {host} ({g.get('why') or g.get('smi')}); it trains on CPU",
                f"expected on a CPU-only host; else install the NVIDIA driver on {host} (make provision)",
            )
    report.checks.append(gpu)
    runtime, why = cuda or lock_cuda()
    driver = _driver_row(facts, rendezvous, runtime)
    for host in facts:
        driver.cells.setdefault(host, Cell("PASS", "no GPU"))
    report.checks.append(driver)
    report.checks.append(_arch_row(facts, runtime, why))
    report.checks.append(_backend_row(facts, runtime, backend, report))

    report.checks.append(Check("disk", {h: _disk_check(h, f, rendezvous, thresholds) for h, f in facts.items()}))
    report.checks.append(Check("names", {h: _names_check(h, f, addresses) for h, f in facts.items()}))
    report.checks.append(Check("interface", {h: _interface_check(h, f, addresses[h]) for h, f in facts.items()}))
    report.checks.append(Check("firewall", {h: _firewall_check(h, f, addresses, port) for h, f in facts.items()}))
    report.checks.append(_rendezvous_row(ok, rendezvous, port, hosts))
    report.checks.append(_ephemeral_row(ok, hosts, addresses))
    report.checks.append(_clock_row(ok, rendezvous, thresholds))
    for host in hosts:  # a host that never reported: every row but `reachable` is SKIP
        for check in report.checks:
            check.cells.setdefault(host, Cell("SKIP", "-"))
        if host in facts:
            report.measurements.setdefault(host, {})["versions"] = facts[host]["versions"]
    return report


def _marked(output: str, mark: str) -> list[dict[str, Any]]:
    found = []
    for line in output.splitlines():
        if line.startswith(mark + " "):
            try:
                found.append(json.loads(line[len(mark) + 1 :]))
            except ValueError:
                continue
    return found


def _tail(output: str, lines: int = 2) -> str:
    kept = [line.strip() for line in output.splitlines() if line.strip() and "warn" not in line.lower()]
    return " | ".join(kept[-lines:])[:300]


def judge_heavy(report: Report, heavy: dict[str, dict[str, Any]], thresholds: Thresholds, job_file: str) -> None:
    """Add the all-reduce and memory rows from the heavy phase's reports."""
    allreduce = Check("all-reduce")
    memory = Check("memory (5 steps)")
    for host in report.hosts:
        h = heavy.get(host)
        if h is None:
            allreduce.cells[host] = memory.cells[host] = Cell("SKIP", "-")
            continue
        ar = h.get("allreduce", {})
        out = _marked(str(ar.get("output", "")), "UGRO_ALLREDUCE")
        rc = int(ar.get("rc", -1))
        if out and out[0].get("sum_ok"):
            r = out[0]
            gbps = r["busbw_Bps"] / 1e9
            report.measurements.setdefault(host, {})["allreduce"] = r
            detail = f"{r['latency_s'] * 1e3:.2f} ms, busbw {gbps:.3f} GB/s"
            if r["world"] > 1 and gbps < thresholds.busbw_floor_gbps:
                allreduce.cells[host] = Cell(
                    "WARN",
                    detail,
                    f"bus bandwidth {gbps:.3f} GB/s on {host} ({r['backend']} over {r['ifname'] or '?'}) "
                    f"is below the floor {thresholds.busbw_floor_gbps:g} GB/s",
                    f"check {host}'s link speed and duplex (ethtool), cable and switch; "
                    "or lower the floor (BUSBW_FLOOR)",
                )
            else:
                allreduce.cells[host] = Cell("PASS", detail)
        else:
            why = "hung and was stopped" if rc in (124, 137) else f"exited {rc}" if rc else "reported no result"
            allreduce.cells[host] = Cell(
                "FAIL",
                why,
                f"all-reduce on {host} {why}: {_tail(str(ar.get('output', '')))}",
                "fix the network rows above (rendezvous, ephemeral ports, interface), then rerun make preflight",
            )
        mem = h.get("memory", {})
        res = _marked(str(mem.get("output", "")), "UGRO_MEMPROBE")
        memory.cells[host] = _memory_cell(
            host, res[0] if res else None, int(mem.get("rc", -1)), str(mem.get("output", "")), thresholds, job_file
        )
        if res:
            report.measurements.setdefault(host, {})["memory"] = res[0]
    report.checks += [allreduce, memory]


def _memory_cell(host: str, r: dict[str, Any] | None, rc: int, output: str, t: Thresholds, job_file: str) -> Cell:
    if r is None:
        why = "ran out of time" if rc in (124, 137) else f"exited {rc}"
        return Cell(
            "FAIL",
            why,
            f"memory probe on {host} {why}: {_tail(output)}",
            f"run `python -m train.tools.memprobe --job {job_file}` on {host} to see the error",
        )
    if r.get("config_error"):
        return Cell("FAIL", "bad profile/job", r["config_error"], "fix the named key in that file")
    where = r.get("profile") or job_file
    micro = r.get("micro_batch_size")
    tokens = r.get("micro_batch_tokens")
    knob = (
        f"lower rank_local.micro_batch_tokens (now {tokens}, {micro} sequences) in {where} on {host}"
        if tokens
        else f"lower rank_local.micro_batch_size (now {micro}) in {where} on {host}"
    )
    if not r.get("gradient_checkpointing"):
        knob += ", or set rank_local.gradient_checkpointing: true"
    peak = r.get("peak_bytes", 0) / GIB
    if r.get("oom"):
        return Cell(
            "FAIL",
            f"OOM at micro_batch_size={micro}",
            f"out of memory on {host} at rank_local.micro_batch_size={micro}: {r['oom']}",
            knob,
        )
    total = r.get("total_bytes") or r.get("available_bytes")
    if not total:
        return Cell("PASS", f"peak {peak:.2f} GiB")
    share = r.get("peak_bytes", 0) / total
    kind = "GPU memory" if r.get("total_bytes") else "available RAM"
    detail = f"peak {peak:.2f} of {total / GIB:.1f} GiB"
    if r.get("estimate_bytes"):
        detail += f" (planner's estimate {r['estimate_bytes'] / GIB:.2f})"  # docs/pipeline.md: the memory formula
    if share > 1.0:
        return Cell("FAIL", detail, f"peak {peak:.2f} GiB exceeds the {kind} of {host}", knob)
    if share > t.memory_headroom:
        return Cell(
            "WARN",
            detail,
            f"peak {peak:.2f} GiB is {share:.0%} of the {kind} of {host}: longer sequences may not fit",
            knob,
        )
    return Cell("PASS", detail)
