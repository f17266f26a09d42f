"""`ugro doctor`: a run's failure explained from its collected logs (ugro/checks/doctor.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ugro.checks import doctor as diagnosis
from ugro.commands.common import JobIdOpt, console, fail, job_id_or_latest
from ugro.hosts.playbook import runs_dir


def doctor(
    job_id: JobIdOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="a run directory (default: runs/<job-id>)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the findings as JSON")] = False,
) -> None:
    """Explain a run's failure from its collected logs: host, cause and fix for each known failure."""
    directory = run_dir if run_dir is not None else runs_dir() / job_id_or_latest(job_id)
    if not directory.is_dir():
        raise fail(f"{directory}: no such run directory (see runs/, or `make logs` to collect one)")
    findings = diagnosis.diagnose(directory)
    if as_json:
        print(diagnosis.to_json(directory, findings))
    else:
        diagnosis.render(directory, findings, console)
    if findings:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(name="doctor")(doctor)
