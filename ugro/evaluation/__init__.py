"""lm-evaluation-harness on a run: the base model and the run's model side by side (``make eval``, docs/export.md).

    evaluate_run(run_dir, repo, tasks=None, limit=None, log=print) -> Report
        the run's held-out tasks generated into runs/<job-id>/eval/tasks/ (heldout.py, tasks.py), lm-eval on both
        models (models.py, runner.py), results.json and README.md in runs/<job-id>/eval (results.py), and the
        Benchmarks section of any model card the run's export wrote (ugro/model/card.py)
    after_training(run_dir, repo, log=print) -> Report | None
        the same with the job's eval.tasks, once a run finished; None where the job names no tasks

A user's mistake (no adapter, an unknown task, a task whose data is not here) is one train.config.ConfigError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ugro.evaluation.results import Row, markdown_table

__all__ = ["Report", "Row", "after_training", "evaluate_run", "markdown_table"]


@dataclass(frozen=True)
class Report:
    results: Path  # runs/<job-id>/eval/results.json
    readme: Path
    rows: list[Row]
    cards: list[Path]  # the model cards refreshed with the Benchmarks section


def evaluate_run(
    run_dir: Path,
    repo: Path,
    tasks: Sequence[str] | None = None,
    limit: int | None = None,
    log: Callable[[str], object] = print,
) -> Report:
    """lm-eval's ``tasks`` (default: the job's eval.tasks, else heldout) on the run's base and tuned model."""
    from ugro.evaluation import results, runner
    from ugro.model import card
    from ugro.model.gguf_export import job_of

    job = job_of(run_dir)
    evaluation = runner.prepare(run_dir, repo, job, tasks, limit)
    runner.evaluate(evaluation, log)
    path, table = results.write(evaluation)
    cards = [p for p in (run_dir / "merged" / "README.md", run_dir / "gguf" / "README.md") if p.is_file()]
    for path_card in cards:
        card.refresh_benchmarks(path_card, run_dir)
    return Report(path, path.parent / results.README, table, cards)


def after_training(run_dir: Path, repo: Path, log: Callable[[str], object] = print) -> Report | None:
    """``evaluate_run`` with the job's eval.tasks and eval.tasks_limit, for the training command to call once a
    run has finished; None (nothing run) where the job sets no eval.tasks."""
    from ugro.model.gguf_export import job_of

    job = job_of(run_dir)
    if job.eval is None or not job.eval.tasks:
        return None
    return evaluate_run(run_dir, repo, job.eval.tasks, job.eval.tasks_limit, log)
