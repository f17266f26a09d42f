"""An evaluation's figures: base vs tuned per task and metric (the table the command prints, the card's section),
written to runs/<job-id>/eval/results.json (both models' lm-eval results, lm-eval's version) and eval/README.md."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ugro.model.benchmarks import RESULTS, Row, change_text, markdown_table, read_rows, value_text

if TYPE_CHECKING:
    from ugro.evaluation.runner import Evaluation

README = "README.md"
__all__ = ["README", "RESULTS", "Row", "change_text", "markdown_table", "read_rows", "rows", "value_text", "write"]


def _figures(result: dict[str, Any], task: str) -> dict[str, float]:
    out = {}
    for key, value in (result.get("results", {}).get(task) or {}).items():
        if "," not in key or "_stderr" in key or not isinstance(value, int | float):
            continue
        metric, filt = key.split(",", 1)
        out[metric if filt == "none" else key] = float(value)
    return out


def rows(base: dict[str, Any], tuned: dict[str, Any]) -> list[Row]:
    """Every (task, metric) both results hold, in the tasks' order."""
    out = []
    for task in base.get("results", {}):
        before, after = _figures(base, task), _figures(tuned, task)
        better = (base.get("higher_is_better") or {}).get(task) or {}
        samples = (base.get("n-samples") or {}).get(task) or {}
        for metric, value in before.items():
            if metric in after:
                hib = better.get(metric.split(",", 1)[0])
                out.append(Row(task, str((base.get("versions") or {}).get(task, "?")), metric, value, after[metric],
                               None if hib is None else bool(hib), samples.get("effective")))  # fmt: skip
    return out


def _record(evaluation: Evaluation, table: list[Row]) -> dict[str, Any]:
    import lm_eval

    return {
        "lm_eval_version": lm_eval.__version__,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "run": evaluation.run_dir.name,
        "tasks": evaluation.tasks,
        "limit": evaluation.limit,
        "task_dir": str(evaluation.task_dir.path),
        "models": {label: m.describe(evaluation.repo) for label, m in evaluation.models.items()},
        "comparison": [asdict(r) | {"change": None if math.isnan(r.change) else r.change} for r in table],
        "results": evaluation.results,
    }


def _readme(record: dict[str, Any], table: list[Row]) -> str:
    models = record["models"]
    return "\n".join([
        f"# lm-evaluation-harness: run {record['run']}",
        "",
        f"lm-eval {record['lm_eval_version']}, {record['finished_at']}; base: `{models['base']}`, "
        f"tuned: `{models['tuned']}`" + (f"; at most {record['limit']} documents per task" if record["limit"] else ""),
        "",
        markdown_table(table),
        "",
        "heldout: the answer's log-likelihood given its prompt, as the run trained (token_perplexity is exp of the "
        "mean loss per answer token); heldout_gen: greedy answers scored against the references (chrF, BLEU). The "
        f"tasks are in `{record['task_dir']}` (`lm_eval --include_path` reads them); every figure is in "
        f"`{RESULTS}`.",
        "",
    ])  # fmt: skip


def write(evaluation: Evaluation) -> tuple[Path, list[Row]]:
    """results.json and README.md in runs/<job-id>/eval; the path of results.json, and the table."""
    table = rows(evaluation.results["base"], evaluation.results["tuned"])
    out = evaluation.run_dir / "eval"
    record = _record(evaluation, table)
    (out / RESULTS).write_text(json.dumps(record, indent=2, default=str, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / README).write_text(_readme(record, table), encoding="utf-8")
    return out / RESULTS, table
