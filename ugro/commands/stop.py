"""`ugro stop`: stop the job's own processes on every host and confirm (playbooks/stop.yml)."""

from __future__ import annotations

import typer

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, JobIdOpt, console, job_id_or_latest, playbook_failed
from ugro.hosts.playbook import run_playbook, runs_dir


def stop(
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    job_id: JobIdOpt = None,
) -> None:
    """Stop the job's own processes on every host (recorded process group and pids) and confirm."""
    job_id = job_id_or_latest(job_id)
    run = run_playbook("stop.yml", inventory, {"ugro_job_id": job_id}, runs_dir() / ".control" / "stop")
    if not run.ok:
        raise playbook_failed(run, "stop")
    console.print(f"job {job_id}: no process of it is left on {', '.join(run.hosts)}")


def register(app: typer.Typer) -> None:
    app.command()(stop)
