"""`ugro validate`: a job file, its data as the ranks will pack it, its backend; with an inventory, what
`make train` checks on the hosts first (ugro/checks/jobcheck.py, ugro/checks/prelaunch.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ugro.checks import ranks
from ugro.checks.preflight_stack import lock_cuda
from ugro.commands import preflight
from ugro.commands.common import (
    DEFAULT_JOB,
    JobOpt,
    SetOpt,
    check_targets,
    checked,
    console,
    fail,
    tokenized,
    with_settings,
)
from ugro.stack import cuda as stack


def validate(
    job_file: JobOpt = DEFAULT_JOB,
    inventory: Annotated[
        Path | None, typer.Option("--inventory", "-i", help="also run make train's fast checks on its hosts")
    ] = None,
    setting: SetOpt = None,
    show: Annotated[
        int,
        typer.Option(
            min=0, help="print this many training rows (preference: pairs, kto: examples), the trained tokens marked"
        ),
    ] = 0,
) -> None:
    """Check a job file, print its cluster-wide hash, its data as the ranks will pack it (records, tokens, rows,
    padding, steps an epoch; a preference job's pairs and the answers data.seq_len cuts) and which backend it runs
    where; with an inventory, also what make train checks on its hosts first (the fast preflight, and the global
    batch against the ranks)."""
    job_file = with_settings(job_file, setting)
    job, data = checked(job_file)
    check_targets(job)  # a base still in its wheel is converted by make train, not here: nothing downloads
    held = f", {data.eval_records} held-out" if job.eval else ""
    console.print(
        f"{job_file}: ok (job '{job.name}', {data.train_records} training records{held}, "
        f"cluster-wide hash {job.cluster_hash()[:12]})"
    )
    found = tokenized(job)
    if found is None:
        console.print("[dim]data: its rows and steps are counted once the base model is here (make train converts "
                      "it)[/]", highlight=False)  # fmt: skip
    else:
        console.print(found.facts.line(), highlight=False)
        from ugro.checks.datafacts import show as show_rows

        for text in show_rows(found, show):
            console.print(text, highlight=False)
    cuda, why = lock_cuda()
    if cuda is None:
        raise fail(f"the node lock cannot be judged: {why}")
    console.print(f"backend: {stack.policy(job.model.backend, cuda)}", highlight=False)
    if inventory is not None:  # the fast checks name a missing inventory
        planned = preflight.fast_checks(inventory, job, job_file).outcome.ranks
        console.print(f"{inventory}: ok, {ranks.describe(planned)} for a global batch of "
                      f"{job.train.global_batch_size}", highlight=False)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command()(validate)
