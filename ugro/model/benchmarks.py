"""A run's recorded lm-evaluation-harness figures (runs/<job-id>/eval/results.json, written by `make eval`:
ugro/evaluation/results.py): base vs tuned per task and metric, read and shown as a table, for the command, its
README and the model card's Benchmarks section."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = "results.json"


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


def read_rows(run_dir: Path) -> tuple[dict[str, Any], list[Row]] | None:
    """The run's recorded evaluation (results.json) and its table, or None where there is none."""
    path = run_dir / "eval" / RESULTS
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    keys = ("task", "version", "metric", "base", "tuned", "higher_is_better", "samples")
    return record, [Row(**{k: r.get(k) for k in keys}) for r in record.get("comparison", [])]
