"""`ugro logs`: every host's logs (and the main host's results) collected into runs/<job-id>/ (playbooks/logs.yml)."""

from __future__ import annotations

import typer

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, JobIdOpt, console, job_id_or_latest, playbook_failed
from ugro.hosts.playbook import run_playbook, runs_dir
from ugro.run.launch import latest_link


def logs(
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    job_id: JobIdOpt = None,
) -> None:
    """Collect every host's logs (and the main host's results) into runs/<job-id>/."""
    job_id = job_id_or_latest(job_id)
    run_dir = runs_dir() / job_id
    collect = {"ugro_job_id": job_id, "ugro_runs_dir": str(runs_dir())}
    run = run_playbook("logs.yml", inventory, collect, run_dir / ".control" / "ansible")
    if not run.ok:
        raise playbook_failed(run, "collecting logs")
    latest_link(run_dir)
    console.print(f"logs of {', '.join(run.hosts)} in {run_dir / 'logs'} (runs/latest -> {job_id})")


def register(app: typer.Typer) -> None:
    app.command()(logs)
