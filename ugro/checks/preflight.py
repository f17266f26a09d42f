"""Run the preflight playbook and show its verdict: one table, a row per check, a column per host.

The fast phase (facts + the network mesh: a few seconds) is what ``make train`` runs before every
launch; ``make preflight`` adds the heavy phase (code sync, an all-reduce across every host, the
job's 5-step memory probe per host). Judging is in ugro/checks/preflight_checks.py.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from train.config import load_job
from ugro.checks import jobcheck
from ugro.checks.preflight_checks import PreflightContext, judge_fast, judge_heavy
from ugro.checks.preflight_network import NETWORK_ROWS
from ugro.checks.preflight_report import ORDER, Cell, Check, Report, Thresholds
from ugro.checks.preflight_stack import lock_cuda
from ugro.hosts import codesync
from ugro.hosts.playbook import REPO, PlaybookRun, run_playbook
from ugro.module_utils import ugro_codetree as codetree
from ugro.run.launch import known_facts
from ugro.stack import cuda as stack

STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


class PreflightError(RuntimeError):
    """The playbook itself could not run (bad inventory, no host at all): one line saying why."""


@dataclass
class Outcome:
    report: Report
    seconds: dict[str, float]
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> its ugro_host facts
    ranks: dict[str, int] = field(default_factory=dict)  # host -> worker processes a launch starts there
    code_sync: dict[str, bool] = field(default_factory=dict)  # host -> whether make train syncs the code there


def launch_facts(outcome: Outcome, code_hash: str) -> dict[str, dict[str, Any]]:
    """Per host, the fast checks' facts that the launch reads instead of asking the host the same again
    (ugro/run/launch.py ``known_facts``)."""
    return known_facts(outcome.facts, outcome.code_sync, code_hash)


def backend_problems(facts: dict[str, dict[str, Any]], backend: str) -> list[str]:
    """Why ``model.backend: unsloth`` cannot run on a host (no usable NVIDIA GPU, unsloth not installed), per
    host: ugro/stack/cuda.py's ``backend``, as preflight's `backend` row judges it."""
    if backend != "unsloth":
        return []
    cuda, _ = lock_cuda()
    problems = []
    for host, found in facts.items():
        gpus = found.get("gpu", {}).get("gpus") or []
        installed = bool(found.get("versions", {}).get("unsloth"))
        if cuda is not None or not gpus:  # without GPUs the lock's CUDA runtime is never consulted
            ccs = [g.get("compute_cap") for g in gpus]
            choice = stack.backend(ccs, found.get("gpu", {}).get("driver"), cuda or "", installed, backend)
        else:  # no lock to judge the GPU by: what the host has is all there is to go on
            choice = stack.Backend("unsloth", "cuda", "", None if installed else "no unsloth")
        if choice.problem == "no unsloth":
            problems.append(
                f"{host}: model.backend 'unsloth' but unsloth is not installed in its environment "
                "(make provision installs requirements/locks/py3.X/gpu.txt on GPU hosts)"
            )
        elif not choice.ok:
            problems.append(f"{host}: {choice.why}")
    return problems


def _playbook_error(run: PlaybookRun) -> str:
    if run.failures:
        return "; ".join(f"{h}: {m}" for h, m in run.failures.items())
    tail = ""
    if run.runner is not None:
        try:
            tail = " ".join(run.runner.stdout.read().strip().splitlines()[-3:])
        except (OSError, ValueError, AttributeError):
            tail = ""
    status = run.runner.status if run.runner is not None else "not started"
    return f"ansible-playbook ended with status {status}: {tail or 'no output'}"


def _context(run: PlaybookRun) -> dict[str, Any]:
    for facts in run.facts.values():
        if "preflight_context" in facts:
            return dict(facts["preflight_context"])
    raise PreflightError(_playbook_error(run))


def run_fast(
    inventory: Path, control: Path, thresholds: Thresholds, backend: str = "auto", launch: dict[str, str] | None = None
) -> tuple[Report, PlaybookRun]:
    """The fast checks on every host of the inventory, for a job whose model.backend is ``backend``; with
    ``launch`` (ugro_job_id and ugro_job_file of the run about to start) they also read what its launch asks."""
    controller_hash = codetree.tree_hash(REPO, codetree.code_files(REPO))
    extravars = {"ugro_preflight_phase": "fast", "ugro_preflight_ephemeral_port": random.randint(40000, 60000)}
    extravars |= launch or {}
    run = run_playbook("preflight.yml", inventory, extravars, control / "fast")
    ctx = _context(run)
    hosts: list[str] = list(ctx["hosts"])
    reports = {h: dict(run.facts[h]["preflight_report"]) for h in hosts if "preflight_report" in run.facts.get(h, {})}
    own = {h: run.facts.get(h, {}).get("preflight_context", ctx) for h in hosts}
    cluster = PreflightContext(
        hosts,
        ctx["main_host"],
        dict(ctx["addresses"]),
        int(ctx["rendezvous_port"]),
        controller_hash,
        code_sync={h: bool(c["code_sync"]) for h, c in own.items()},
        python_of={h: str(c.get("python", "ugro_python")) for h, c in own.items()},
    )
    report = judge_fast(reports, dict(run.failures), cluster, thresholds, backend=backend)
    return report, run


def run_heavy(report: Report, inventory: Path, job_file: str, control: Path, thresholds: Thresholds) -> None:
    """Sync the code, then the all-reduce and the memory probe on every host; adds their rows to ``report``."""
    if report.failed(NETWORK_ROWS):
        skip = Cell("SKIP", "network FAIL", "skipped: the network checks failed", "fix the FAILs above first")
        report.checks += [
            Check("all-reduce", {h: skip for h in report.hosts}),
            Check("memory (5 steps)", {h: skip for h in report.hosts}),
        ]
        return
    code_hash = codesync.pack(REPO, control / "code.tar.gz")
    extravars = {
        "ugro_preflight_phase": "heavy",
        "ugro_job_file": job_file,
        "ugro_code_archive": str(control / "code.tar.gz"),
        "ugro_code_hash": code_hash,
        "ugro_model_dirs": jobcheck.model_dirs(load_job(REPO / job_file), REPO),  # the CLI validated it
    }
    run = run_playbook("preflight.yml", inventory, extravars, control / "heavy")
    heavy = {
        h: dict(f["preflight_report"]) for h, f in run.facts.items() if "allreduce" in f.get("preflight_report", {})
    }
    judge_heavy(report, heavy, thresholds, job_file)
    for host in heavy:  # the heavy phase synced (or verified) the code there
        if host not in run.failures:
            report.row("train code").cells[host] = Cell("PASS", f"{code_hash[:12]} (synced)")
    for host, message in run.failures.items():  # e.g. the code sync failed there
        for check in report.checks[-2:]:
            check.cells[host] = Cell(
                "FAIL", "not run", f"{host}: {message}"[:300], f"fix {host}, then rerun make preflight"
            )


def preflight(
    inventory: Path,
    control: Path,
    thresholds: Thresholds,
    job_file: str | None = None,
    heavy: bool = False,
    backend: str = "auto",
    launch: dict[str, str] | None = None,
) -> Outcome:
    started = time.monotonic()
    report, run = run_fast(inventory, control, thresholds, backend, launch)
    facts = {
        h: dict(f["preflight_report"]["host"])
        for h, f in run.facts.items()
        if f.get("preflight_report", {}).get("host")
    }
    reported = {h: f.get("preflight_report", {}).get("ranks") for h, f in run.facts.items()}
    ranks = {h: int(reported[h]) for h in report.hosts if reported.get(h) is not None}  # in node-rank order
    seconds = {"fast": time.monotonic() - started}
    if heavy and job_file is not None:
        mid = time.monotonic()
        run_heavy(report, inventory, job_file, control, thresholds)
        seconds["heavy"] = time.monotonic() - mid
    contexts = {h: f["preflight_context"] for h, f in run.facts.items() if isinstance(f.get("preflight_context"), dict)}
    code_sync = {h: bool(c.get("code_sync", True)) for h, c in contexts.items()}
    return Outcome(report, seconds, facts, ranks, code_sync)


def _cell_text(cell: Cell) -> str:
    text = f"[{STYLE[cell.status]}]{cell.status}[/]"
    return f"{text} {cell.detail}" if cell.detail else text


def render(report: Report, console: Console, title: str) -> None:
    """The table, then one line of cause and one of fix per non-PASS cell."""
    table = Table(title=title, title_justify="left")
    table.add_column("check")
    for host in report.hosts:
        table.add_column(host + (" (main)" if host == report.main_host else ""))
    for check in report.checks:
        table.add_row(check.name, *(_cell_text(check.cells.get(h, Cell("SKIP", "-"))) for h in report.hosts))
    console.print(table)
    problems = sorted(report.problems(), key=lambda p: -ORDER[p[2].status])
    for name, host, cell in problems:
        console.print(f"[{STYLE[cell.status]}]{cell.status}[/] {name} @ {host}: {cell.cause}", highlight=False)
        console.print(f"     fix: {cell.fix}", highlight=False)


def summary(report: Report) -> str:
    counts = {s: sum(1 for c in report.checks for x in c.cells.values() if x.status == s) for s in ORDER}
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return f"{len(report.checks)} checks on {len(report.hosts)} host(s): {parts}"
