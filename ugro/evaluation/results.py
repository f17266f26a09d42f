"""An evaluation's figures: base vs tuned per task and metric (the table the command prints, the card's section),
written to runs/<job-id>/eval/results.json (both models' lm-eval results, lm-eval's version) and eval/README.md."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ugro.evaluation.runner import Evaluation

RESULTS = "results.json"
README = "README.md"


@dataclass(frozen=True)
class Row:
    task: str
    version: str
    metric: str  # lm-eval's "metric,filter" key without a "none" filter
    base: float
    tuned: float
    higher_is_better: bool | None
    samples: int | None

    @property
    def change(self) -> float:
        """The relative change from base to tuned (NaN where the base is 0 or a figure is missing)."""
        return (self.tuned - self.base) / abs(self.base) if self.base and math.isfinite(self.base) else math.nan

    @property
    def better(self) -> bool | None:
        if self.higher_is_better is None or self.tuned == self.base:
            return None
        return (self.tuned > self.base) == self.higher_is_better


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


def value_text(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 1e4 else f"{x:.3e}"


def change_text(row: Row) -> str:
    if math.isnan(row.change):
        return f"{row.tuned - row.base:+.4f}"
    return f"{row.change:+.1%}"


def markdown_table(table: list[Row]) -> str:
    lines = ["| task | version | metric | base | tuned | change | documents |", "|---|---|---|---|---|---|---|"]
    for r in table:
        mark = "" if r.better is None else (" (better)" if r.better else " (worse)")
        lines.append(f"| {r.task} | {r.version} | {r.metric} | {value_text(r.base)} | {value_text(r.tuned)} | "
                     f"{change_text(r)}{mark} | {r.samples if r.samples is not None else ''} |")  # fmt: skip
    return "\n".join(lines)


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


def read_rows(run_dir: Path) -> tuple[dict[str, Any], list[Row]] | None:
    """The run's recorded evaluation (results.json) and its table, or None where there is none."""
    path = run_dir / "eval" / RESULTS
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    keys = ("task", "version", "metric", "base", "tuned", "higher_is_better", "samples")
    return record, [Row(**{k: r.get(k) for k in keys}) for r in record.get("comparison", [])]
