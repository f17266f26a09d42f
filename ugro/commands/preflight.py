"""`ugro preflight`: every host checked before a launch (ugro/checks/preflight.py); and how the fast checks that
`make train` and `make validate INVENTORY=...` run first are shown, or their refusal (ugro/checks/prelaunch.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from train.config import JobConfig
from ugro.checks import preflight as preflight_run
from ugro.checks import prelaunch
from ugro.checks.preflight_report import Thresholds
from ugro.commands.common import (
    DEFAULT_INVENTORY,
    DEFAULT_JOB,
    InventoryOpt,
    JobOpt,
    check_targets,
    console,
    convert_model,
    dim,
    fail,
    load,
    refused,
)
from ugro.hosts.playbook import runs_dir
from ugro.run.launch import Refused

MinFreeOpt = Annotated[float, typer.Option(envvar="MIN_FREE_GB", help="GiB free needed on the main host")]
BusbwOpt = Annotated[float, typer.Option(envvar="BUSBW_FLOOR", help="all-reduce busbw floor, GB/s (WARN below)")]


def show_fast(found: prelaunch.Fast) -> None:
    """The fast checks passed: the plan's news, one summary line and the WARNs (a CPU host is not news)."""
    if found.plan_line:
        dim(found.plan_line)
    dim(prelaunch.summary_line(found.outcome))
    for name, host, cell in found.outcome.report.problems():
        if name != "gpu":
            console.print(f"[yellow]WARN[/] {name} @ {host}: {cell.cause}", highlight=False)


def fast_checks(inventory: Path, job: JobConfig, job_file: Path) -> prelaunch.Fast:
    """The fast checks before a launch, shown; a refusal exits."""
    try:
        found = prelaunch.fast(inventory, job, job_file)
    except Refused as exc:
        raise refused(exc) from None
    show_fast(found)
    return found


def preflight(
    job_file: JobOpt = DEFAULT_JOB,
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    fast: Annotated[bool, typer.Option("--fast", help="only the fast checks (what make train runs)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    min_free_gb: MinFreeOpt = 2.0,
    busbw_floor: BusbwOpt = 0.05,
) -> None:
    """Check every host before a launch: versions, names, ports, interfaces, all-reduce, memory."""
    job = load(job_file)
    convert_model(job)
    check_targets(job)
    thresholds = Thresholds(min_free_gb=min_free_gb, busbw_floor_gbps=busbw_floor)
    if not inventory.is_file():
        raise fail(f"{inventory}: inventory not found (the default is inventory/local.yml)")
    try:
        relative = prelaunch.repo_path(job_file)
        control = runs_dir() / ".control" / "preflight"
        outcome = preflight_run.preflight(inventory, control, thresholds, relative, not fast, job.model.backend)
    except Refused as exc:
        raise refused(exc) from None
    except preflight_run.PreflightError as exc:
        raise fail(f"preflight could not run on {inventory}: {exc}") from None
    if as_json:
        print(outcome.report.to_json())
    else:
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in outcome.seconds.items())
        preflight_run.render(outcome.report, console, f"preflight of {inventory} ({timing})")
        console.print(preflight_run.summary(outcome.report))
    if outcome.report.failed():
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(name="preflight")(preflight)
