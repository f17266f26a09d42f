"""`ugro eval`: lm-evaluation-harness on the base model and the run's model, side by side (ugro/evaluation/)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from train.config import ConfigError
from ugro.commands.common import JobIdOpt, console, fail, job_id_or_latest
from ugro.hosts.playbook import REPO, runs_dir

if TYPE_CHECKING:
    from ugro.evaluation import Report


def eval_run(
    job_id: JobIdOpt = None,
    tasks: Annotated[
        str | None,
        typer.Option(help="lm-eval tasks, comma-separated (default: the job's eval.tasks, else heldout)"),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="at most N documents per task (default: eval.tasks_limit)")
    ] = (None),
) -> None:
    """lm-evaluation-harness on the base model and the run's model: the run's held-out set (perplexity, and greedy
    answers for chat data) and any task whose data is local or cached; runs/<job-id>/eval."""
    from ugro.evaluation import evaluate_run

    run_dir = runs_dir() / job_id_or_latest(job_id)
    names = [t for t in (tasks or "").split(",") if t.strip()] or None
    try:
        report = evaluate_run(run_dir, REPO, names, limit, log=console.print)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    show(report, run_dir)


def after_training(run_dir: Path) -> None:
    """The job's eval.tasks once its run finished (`make train`): the same table as `make eval`, nothing where the
    job names no tasks."""
    from ugro.evaluation import after_training as harness

    try:
        report = harness(run_dir, REPO, log=console.print)
    except ConfigError as exc:
        raise fail(f"eval.tasks: {exc} (the run itself finished: {run_dir})") from None
    if report is not None:
        show(report, run_dir)


def show(report: Report, run_dir: Path) -> None:
    """Base vs tuned, a row per task and metric, and where the results went."""
    from ugro.evaluation import results

    table = Table(title=f"lm-evaluation-harness: run {run_dir.name}, base vs tuned")
    for column in ("task", "version", "metric", "base", "tuned", "change"):
        table.add_column(column)
    for row in report.rows:
        colour = {True: "green", False: "red", None: "white"}[row.better]
        base, tuned = (results.value_text(x) for x in (row.base, row.tuned))
        table.add_row(row.task, row.version, row.metric, base, tuned, f"[{colour}]{results.change_text(row)}[/]")
    console.print(table)
    console.print(f"results: {report.results}; {report.readme}")
    for card in report.cards:
        console.print(f"model card updated: {card}")


def register(app: typer.Typer) -> None:
    app.command(name="eval")(eval_run)
