"""Judge what the preflight role measured: one row per check, one cell per host, PASS / WARN / FAIL.

Pure functions over the ``preflight_report`` fact of every host (roles/preflight): ``host`` is what the
host module ``ugro_host_facts`` gathered there (``ansible_facts.ugro_host``), ``network`` what
``ugro_net_probe`` measured (``listen``: label -> port, peers, error; ``connect``: one result per target),
``error`` why a module failed. ugro/checks/preflight.py runs the playbook and renders the result. Every
non-PASS cell says its cause and its fix in one line each. This module puts the rows together, with the host's
own (disk, a job already running) and the heavy phase's; the others are by concern: the report's model
(``preflight_report``), the network (``preflight_network``), the stack (``preflight_stack``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ugro.checks.preflight_kernel import kernel_rows
from ugro.checks.preflight_network import (
    clock_row,
    ephemeral_row,
    firewall_check,
    interface_check,
    names_check,
    rendezvous_row,
)
from ugro.checks.preflight_report import GIB, Cell, Check, Report, Status, Thresholds, same_everywhere
from ugro.checks.preflight_stack import (
    VERSION_ROWS,
    arch_row,
    backend_row,
    driver_row,
    lock_cuda,
    python_row,
    unsloth_row,
)


def _disk_check(host: str, facts: dict[str, Any], main_host: str, t: Thresholds) -> Cell:
    disk = facts.get("disk", {})
    free = disk.get("free_bytes", 0) / GIB
    detail = f"{free:.1f} GiB free"
    if free >= t.min_free_gb:
        return Cell("PASS", detail)
    where = disk.get("measured_at", disk.get("path", "?"))
    status: Status = "FAIL" if host == main_host else "WARN"
    what = "checkpoints are written here (main host)" if host == main_host else "logs are written here"
    return Cell(
        status,
        detail,
        f"{free:.2f} GiB free at {where} on {host}, below {t.min_free_gb:g} GiB; {what}",
        f"free space on {host} under {where} (old runs/, caches) or raise the disk",
    )


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


@dataclass(frozen=True)
class PreflightContext:
    """What the fast phase's playbook says of the cluster, beside each host's report: the hosts in node-rank
    order, the main host, each host's cluster address, the rendezvous port, the controller's code hash, where
    the launch syncs the code (host -> bool, default yes), and each host's job Python (for the messages)."""

    hosts: list[str]
    main_host: str
    addresses: dict[str, str]
    port: int
    controller_hash: str
    code_sync: dict[str, bool] = field(default_factory=dict)
    python_of: dict[str, str] = field(default_factory=dict)


def judge_fast(
    reports: dict[str, dict[str, Any]],
    unreachable: dict[str, str],
    cluster: PreflightContext,
    thresholds: Thresholds,
    backend: str = "auto",
    cuda: tuple[str | None, str] | None = None,
) -> Report:
    """The fast rows from every host's report; hosts with no report are FAIL in `reachable` and SKIP elsewhere.

    ``backend`` is the job's model.backend; ``cuda`` the CUDA runtime torch runs on the GPU hosts (and why
    there is none), by default the node lock's (``lock_cuda``).
    """
    report = Report(cluster.hosts, cluster.main_host)
    reach, ok = reachable_row(reports, unreachable, cluster.hosts, cluster.python_of)
    report.checks.append(reach)
    facts = {h: r["host"] for h, r in ok.items()}
    report.checks.append(_running_row(facts))
    report.checks += _version_rows(facts, cluster.main_host)
    report.checks.append(_code_row(facts, cluster.controller_hash, cluster.code_sync))
    report.checks.append(_gpu_row(facts))
    runtime, why = cuda or lock_cuda()
    driver = driver_row(facts, cluster.main_host, runtime)
    for host in facts:
        driver.cells.setdefault(host, Cell("PASS", "no GPU"))
    report.checks.append(driver)
    report.checks.extend(kernel_rows(facts))
    report.checks.append(arch_row(facts, runtime, why))
    report.checks.append(backend_row(facts, runtime, backend, report))
    report.checks += _network_rows(ok, cluster, thresholds)
    for host in cluster.hosts:  # a host that never reported: every row but `reachable` is SKIP
        for check in report.checks:
            check.cells.setdefault(host, Cell("SKIP", "-"))
        if host in facts:
            report.measurements.setdefault(host, {})["versions"] = facts[host]["versions"]
    return report


def _reachable_cell(host: str, r: dict[str, Any] | None, unreachable: dict[str, str], python: str) -> Cell:
    if host in unreachable or r is None:
        return Cell(
            "FAIL",
            "unreachable",
            f"{host}: {unreachable.get(host, 'no report')}"[:300],
            f"check ansible_host/ansible_user of {host} and that `ssh {host}` works",
        )
    if not r.get("host") or not r.get("network"):
        # The host modules' messages end in "Fix: ..." where they know it.
        cause, _, fix = str(r.get("error") or "no report").partition(" Fix: ")
        return Cell(
            "FAIL",
            "module failed",
            (cause if cause.startswith(f"{host}:") else f"{host}: {cause}")[:300],
            fix or f"fix what the message names on {host}, then rerun make preflight",
        )
    if r["host"].get("python", {}).get("why"):
        return Cell(
            "FAIL",
            "no python",
            f"{host}: the job's Python {python} could not run: {r['host']['python']['why']}"[:300],
            f"provision {host} (the repository's .venv at ugro_code_dir) or fix ugro_python ({python})",
        )
    return Cell("PASS", "ssh + python")


def reachable_row(
    reports: dict[str, dict[str, Any]], unreachable: dict[str, str], hosts: list[str], python_of: dict[str, str]
) -> tuple[Check, dict[str, dict[str, Any]]]:
    """The `reachable` row, and the reports of the hosts it passes (the only ones the other rows judge)."""
    reach = Check("reachable")
    ok: dict[str, dict[str, Any]] = {}
    for host in hosts:
        r = reports.get(host)
        reach.cells[host] = _reachable_cell(host, r, unreachable, python_of.get(host, "ugro_python"))
        if reach.cells[host].status == "PASS" and r is not None:
            ok[host] = r
    return reach, ok


def _version_rows(facts: dict[str, dict[str, Any]], main_host: str) -> list[Check]:
    rows = [python_row(facts)]
    for row in VERSION_ROWS[1:]:
        values = {h: f["versions"].get(row) for h, f in facts.items()}
        fix = (
            "install " + row.replace(" ", "-") + " {ref} on {host}: make provision"
            " (its venv gets requirements/locks/py3.X/node.txt, + gpu.txt on a GPU host)"
        )
        if row == "unsloth":
            rows.append(unsloth_row(facts, values, main_host, fix))
        else:
            rows.append(same_everywhere(row, values, main_host, fix))
    return rows


def _code_row(facts: dict[str, dict[str, Any]], controller_hash: str, code_sync: dict[str, bool]) -> Check:
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
    return code


def _gpu_row(facts: dict[str, dict[str, Any]]) -> Check:
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
    return gpu


def _network_rows(ok: dict[str, dict[str, Any]], cluster: PreflightContext, t: Thresholds) -> list[Check]:
    """The host's own disk, then the network's rows (ugro/checks/preflight_network.py)."""
    facts = {h: r["host"] for h, r in ok.items()}
    main, addresses, port, hosts = cluster.main_host, cluster.addresses, cluster.port, cluster.hosts
    return [
        Check("disk", {h: _disk_check(h, f, main, t) for h, f in facts.items()}),
        Check("names", {h: names_check(h, f, addresses) for h, f in facts.items()}),
        Check("interface", {h: interface_check(h, f, addresses[h]) for h, f in facts.items()}),
        Check("firewall", {h: firewall_check(h, f, addresses, port) for h, f in facts.items()}),
        rendezvous_row(ok, main, port, hosts),
        ephemeral_row(ok, hosts, addresses),
        clock_row(ok, main, t),
    ]


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
        memory.cells[host] = memory_cell(
            host, res[0] if res else None, int(mem.get("rc", -1)), str(mem.get("output", "")), thresholds, job_file
        )
        if res:
            report.measurements.setdefault(host, {})["memory"] = res[0]
    report.checks += [allreduce, memory]


def memory_cell(host: str, r: dict[str, Any] | None, rc: int, output: str, t: Thresholds, job_file: str) -> Cell:
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
