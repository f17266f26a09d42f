"""`ugro status`: per host, the state of a running or finished job (playbooks/status.yml); a SLURM run's from its
directory (ugro/schedulers/render.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, JobIdOpt, clock, console, err, job_id_or_latest
from ugro.hosts.playbook import run_playbook, runs_dir
from ugro.model.jsonfile import read_object
from ugro.run import attach
from ugro.schedulers import render as schedulers

COLUMNS = ("host", "state", "step", "loss", "tokens/s", "computes", "pids")


def _state(s: dict[str, Any], failed: bool) -> str:
    """The host's state; a host taken back (train/recovery/lending.py) says since when, by whom and why."""
    state = str(s.get("state") or ("unreachable" if failed else "?"))
    lent, asked = s.get("lent"), s.get("wanted_back")
    if state == "lent" and isinstance(lent, dict):
        request = lent.get("request") or {}
        return (f"lent since {clock(lent.get('since'))} after step {lent.get('step')} (by {request.get('by')}: "
                f"{request.get('why')})")  # fmt: skip
    if state == "running" and isinstance(asked, dict):
        return f"running, taken back after this step (by {asked.get('by')}: {asked.get('why')})"
    if state == "running" and isinstance(s.get("rejoining"), dict) and s["rejoining"].get("lent"):
        return "running, lent again: rejoining the group"
    return state


def _row(host: str, s: dict[str, Any], failed: bool) -> tuple[str, ...]:
    state = _state(s, failed)
    step = f"{s['step']}/{s['total_steps']}" if "step" in s else ""
    computes = "; ".join(f"rank {r}: {part}" for r, part in s.get("parts", {}).items())
    return (host, state, step, f"{s['loss']:.4f}" if "loss" in s else "",
            f"{s['tokens_per_s']:.0f}" if "tokens_per_s" in s else "", computes,
            " ".join(str(p) for p in s.get("pids", {}).values()))  # fmt: skip


def _follower_line(run_dir: Path) -> None:
    """Whether a controller follows the run (and so relaunches it after a fault), for a run `make train` launched."""
    if attach.Launch.read(run_dir) is None:
        return
    live = attach.follower(run_dir)
    if live is not None:
        since = clock(live.get("since"))
        console.print(f"followed by the controller: process {live.get('pid')} on {live.get('machine')} since {since}",
                      highlight=False)  # fmt: skip
        return
    state = str(read_object(run_dir / "run.json").get("state") or "")
    if state in ("finished", "failed", "stopped") and (run_dir / "logs").is_dir():
        return  # over, and its results collected
    console.print(f"[yellow]no controller follows this run[/]: a fault now waits for one; `make follow "
                  f"JOB_ID={run_dir.name}` takes it up", highlight=False)  # fmt: skip


def status(
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    job_id: JobIdOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="a SLURM run's directory (shared filesystem)")] = None,
) -> None:
    """Per host: running / finished / failed / stopped, step, last loss, process ids."""
    if run_dir is not None or (runs_dir() / job_id_or_latest(job_id) / "slurm").is_dir():
        # A SLURM run (`ugro slurm-script`): read from its directory, no inventory (ugro/schedulers/render.py).
        raise typer.Exit(schedulers.status(run_dir or runs_dir() / job_id_or_latest(job_id), console))
    job_id = job_id_or_latest(job_id)
    run = run_playbook("status.yml", inventory, {"ugro_job_id": job_id}, runs_dir() / ".control" / "status")
    table = Table(title=f"job {job_id}")
    for column in COLUMNS:
        table.add_column(column)
    for host in run.hosts:
        table.add_row(*_row(host, run.facts.get(host, {}).get("train_job_status", {}), host in run.failures))
    console.print(table)
    _follower_line(runs_dir() / job_id)
    for host, message in run.failures.items():
        err.print(f"[bold red]{host}:[/] {message}", highlight=False)
    if run.failures:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(status)
