"""lm-evaluation-harness on a run: its held-out tasks generated from the data, any other task named, run by
``lm_eval.simple_evaluate`` on the base model and on the run's model, one after the other, with the same settings."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.config import ConfigError, JobConfig
from ugro.evaluation.heldout import held_out_set
from ugro.evaluation.models import EvalModel, run_models
from ugro.evaluation.tasks import HELDOUT, HELDOUT_GEN, TaskDir, write_tasks

Log = Callable[[str], object]
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@dataclass
class Evaluation:
    """What an evaluation of one run produced: both models' lm-eval results (as simple_evaluate returns them)."""

    run_dir: Path
    repo: Path
    tasks: list[str]
    task_dir: TaskDir
    limit: int | None
    models: dict[str, EvalModel]
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # "base" / "tuned" -> simple_evaluate's


def _quiet() -> None:
    """lm-eval, transformers and datasets report every step at INFO/WARNING; the command prints its own lines (lm-eval's
    progress bars of each request kind stay: a minute or two of greedy answers on a CPU)."""
    for name in ("lm-eval", "lm_eval", "transformers", "datasets", "peft", "accelerate", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def requested_tasks(asked: Sequence[str] | None, job: JobConfig) -> list[str]:
    """TASKS as given, else the job's eval.tasks, else heldout; names kept in order, once."""
    names = [n.strip() for n in (asked or (job.eval.tasks if job.eval else []) or [HELDOUT]) if n.strip()]
    return list(dict.fromkeys(names)) or [HELDOUT]


def _not_cached(name: str, exc: BaseException) -> ConfigError:
    offline = [v for v in OFFLINE if os.environ.get(v, "") not in ("", "0", "false", "False")]
    where = (
        f"this machine reads the Hugging Face cache only ({', '.join(offline)} set): download the task's data once "
        f"on a machine online (`lm_eval --tasks {name} --limit 1 ...`, or datasets.load_dataset) and copy "
        "~/.cache/huggingface here, or name a task whose data is local"
        if offline
        else "check its dataset is reachable or cached (datasets.load_dataset), or name a task whose data is local"
    )
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"lm-eval task '{name}': its data cannot be loaded ({cause[:300]}); {where}")


def unknown_tasks(names: Sequence[str]) -> list[str]:
    """The names lm-eval has no task of (heldout and heldout_gen are the run's own, generated at evaluation); its
    built-in tasks indexed only where another name is given (~10 s). For the checks before a launch."""
    other = [n for n in names if n not in (HELDOUT, HELDOUT_GEN)]
    if not other:
        return []
    from lm_eval.tasks import TaskManager

    known = set(TaskManager().all_tasks)
    return [n for n in other if n not in known]


def task_manager(names: Sequence[str], task_dir: TaskDir) -> Any:
    """lm-eval's TaskManager over the run's generated tasks, and over lm-eval's own only where a name is not one of
    the run's: indexing its ~15,000 built-in tasks takes ~10 s, which the held-out tasks alone do not need."""
    from lm_eval.tasks import TaskManager

    own = set(task_dir.names)
    return TaskManager(include_path=str(task_dir.path), include_defaults=not set(names) <= own)


def load_tasks(names: Sequence[str], task_dir: TaskDir) -> Any:
    """lm-eval's TaskManager over its own tasks and the run's generated ones, every name checked and its data
    loaded once (an unknown task, or one whose data is not here, is one ConfigError naming it)."""
    manager = task_manager(names, task_dir)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:  # the same answer as unknown_tasks, from the manager this evaluation loads its tasks with
        raise ConfigError(
            f"lm-eval has no task {', '.join(repr(n) for n in unknown)}: name a task of `lm_eval ls tasks` (its "
            f"data local or cached), or heldout, the run's own held-out set (tasks written to {task_dir.path})"
        )
    for name in names:
        try:
            manager.load([name])
        except Exception as exc:
            raise _not_cached(name, exc) from None
    return manager


def prepare(run_dir: Path, repo: Path, job: JobConfig, asked: Sequence[str] | None, limit: int | None) -> Evaluation:
    """Everything checked before a model is loaded: the run's models, the tasks written and loaded."""
    _quiet()
    base, tuned = run_models(run_dir, repo, job)
    names = requested_tasks(asked, job)
    out = run_dir / "eval" / "tasks"
    if any(n.startswith(HELDOUT) for n in names):  # the run's own tasks, generated from its held-out data
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tuned.tokenizer))
        max_new_tokens = job.eval.max_new_tokens if job.eval else 64
        task_dir = write_tasks(held_out_set(job, tokenizer, repo), out, max_new_tokens)
    else:
        out.mkdir(parents=True, exist_ok=True)
        task_dir = TaskDir(out, ())
    tasks = list(dict.fromkeys(t for n in names for t in task_dir.expand(n)))
    load_tasks(tasks, task_dir)
    eval_limit = limit if limit is not None else (job.eval.tasks_limit if job.eval else None)
    return Evaluation(run_dir, repo, tasks, task_dir, eval_limit, {"base": base, "tuned": tuned})


def evaluate(evaluation: Evaluation, log: Log = print) -> Evaluation:
    """simple_evaluate on the base model, then on the run's model; their results kept in ``evaluation``."""
    import lm_eval

    manager = task_manager(evaluation.tasks, evaluation.task_dir)
    for label, model in evaluation.models.items():
        log(f"{label} model ({model.describe(evaluation.repo)}): {', '.join(evaluation.tasks)}")
        result = lm_eval.simple_evaluate(
            model="hf",
            model_args=model.hflm_args(),
            tasks=list(evaluation.tasks),
            task_manager=manager,
            limit=evaluation.limit,
            bootstrap_iters=0,  # no stderr: a few dozen documents, and bootstrapped BLEU costs minutes
            log_samples=False,
            device="cpu",
        )
        if result is None:  # simple_evaluate returns None on the ranks other than 0; this is one process
            raise ConfigError("lm-eval returned no results")
        evaluation.results[label] = result
    return evaluation
