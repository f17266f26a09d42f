"""`ugro plan`: which rank holds which layers, data parallel or pipeline stages (ugro/checks/plan.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from train.layout.stageplan import PlanError
from ugro.checks import plan as stageplan
from ugro.checks import preflight as preflight_run
from ugro.checks.preflight_report import Thresholds
from ugro.commands.common import (
    DEFAULT_INVENTORY,
    DEFAULT_JOB,
    InventoryOpt,
    JobOpt,
    SetOpt,
    cluster,
    console,
    convert_model,
    dim,
    fail,
    load,
    with_settings,
)
from ugro.hosts.playbook import REPO, runs_dir

Facts = dict[str, dict[str, object]]


def _online(inventory: Path, hosts: list[str]) -> tuple[Facts | None, dict[str, int] | None]:
    """Every host's facts and ranks from the fast preflight; (None, None) where some host did not answer."""
    try:
        outcome = preflight_run.preflight(inventory, runs_dir() / ".control" / "preflight", Thresholds())
    except preflight_run.PreflightError as exc:
        console.print(f"[yellow]the hosts did not answer ({exc}): planning from the inventory alone[/]",
                      highlight=False)  # fmt: skip
        return None, None
    if set(outcome.facts) != set(hosts):
        missing = ", ".join(h for h in hosts if h not in outcome.facts)
        console.print(f"[yellow]no facts from {missing}: planning from the inventory alone[/]", highlight=False)
        return None, None
    return outcome.facts, outcome.ranks


def plan(
    job_file: JobOpt = DEFAULT_JOB,
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    offline: Annotated[
        bool, typer.Option("--offline", help="from the inventory alone (profiles' memory_gib), without the hosts")
    ] = False,
    setting: SetOpt = None,
) -> None:
    """Show which rank holds which layers: data parallel where the model fits every rank, else pipeline stages
    sized to each host's memory and speed; exit 2 with the arithmetic when the model fits nowhere."""
    job_file = with_settings(job_file, setting)
    job = load(job_file)
    convert_model(job)
    hosts = cluster(inventory)
    facts, found_ranks = (None, None) if offline else _online(inventory, hosts.hosts)
    try:
        memory = stageplan.hosts_memory(job, REPO, hosts.hosts, hosts.hostvars, facts, found_ranks)
        for host in memory:
            dim(host.line(job.data.seq_len))
        for host in memory:
            dim(stageplan.whole_estimates(job, REPO, host))
        layout = stageplan.plan_cluster(job, REPO, memory)
    except PlanError as exc:
        raise fail(f"{job_file}: {exc}") from None
    table = Table(title=f"plan of {job_file} on {inventory}{' (offline)' if facts is None else ''}",
                  title_justify="left")  # fmt: skip
    for column in ("host", "replica", "stage", "layers", "micro-batch", "peak / memory", "busy"):
        table.add_column(column)
    for row in stageplan.rows(layout):
        table.add_row(*row)
    console.print(table)
    speed = sum(r.speed for r in layout.replicas)
    bubble = " (busy: the stage's share of the step time; the rest waits in the pipeline's bubble)"
    console.print(f"{layout.reason}; throughput ~{speed:.2f} x one rank holding the whole model"
                  f"{bubble if layout.pipelined else ''}", highlight=False)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command(name="plan")(plan)
