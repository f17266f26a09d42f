"""The run's records (runs/<job-id>/, written by the ranks: train/metrics.py) as a tracker takes them: the job's
settings, one metric point per logged step, each rank's device, and the files to keep at the end."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.metrics import EVAL, METRICS
from ugro.model.jsonfile import read_object

# Of a metrics.jsonl row, the figures that are not metrics: the step is the step, the rest are constants or clocks.
NOT_METRICS = ("step", "total_steps", "time", "ranks")
# What a remote cluster's poll gives of the main rank's newest row (ugro_jobstate.PROGRESS_KEYS, less the step).
LIVE_KEYS = ("loss", "tokens_per_s", "eta_s")
# The base model's held-out loss, logged at step 0 beside the fine-tuned model's.
BASE_EVAL = "base_eval_loss"


@dataclass(frozen=True)
class Point:
    """The metrics of one step, and when they were taken (epoch seconds)."""

    step: int
    values: dict[str, float]
    time: float

    def without(self, keys: tuple[str, ...]) -> Point:
        return Point(self.step, {k: v for k, v in self.values.items() if k not in keys}, self.time)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def train_point(row: dict[str, Any]) -> Point:
    """One metrics.jsonl row: its figures (loss, lr, grad_norm, tokens, tokens/s, epoch, elapsed, ETA, a preference
    method's), per rank its share of the batch, tokens/s, ready time and peak memory (GiB), and per host the sum of
    its ranks' shares and tokens/s and the largest of their peak memories."""
    values = {k: n for k, v in row.items() if k not in NOT_METRICS and (n := _number(v)) is not None}
    found = row.get("ranks")
    ranks: dict[str, Any] = found if isinstance(found, dict) else {}
    hosts = [str(h) for h in ranks.get("host") or []]
    for key in ("share", "tokens_per_s", "ready_s", "peak_gib"):
        for rank, value in enumerate(ranks.get(key) or []):
            number = _number(value)
            if number is None:
                continue
            values[f"rank{rank}/{key}"] = number
            if rank < len(hosts) and key != "ready_s":
                name = f"host/{hosts[rank]}/{key}"
                together = max if key == "peak_gib" else sum  # one card's memory each: the fullest is the host's
                values[name] = together((values.get(name, 0.0), number))
    return Point(int(row["step"]), values, float(row.get("time") or 0.0))


def eval_point(row: dict[str, Any], now: float) -> Point:
    """One eval.jsonl row: the fine-tuned model's held-out loss (and a preference method's held-out figures) as
    ``eval_*``; the base model's row as ``base_eval_loss``."""
    if row.get("model") == "base":
        loss = _number(row.get("eval_loss"))
        return Point(int(row["step"]), {BASE_EVAL: loss} if loss is not None else {}, now)
    values: dict[str, float] = {}
    for key, value in row.items():
        number = _number(value)
        if key != "step" and number is not None:
            values[key if key.startswith("eval_") else f"eval_{key}"] = number
    return Point(int(row["step"]), values, now)


def live_point(status: dict[str, Any], now: float) -> Point | None:
    """The main rank's newest row as a remote cluster's poll gives it (its step, loss, tokens/s, ETA), or None."""
    step = status.get("step")
    if not isinstance(step, int):
        return None
    values = {k: n for k in LIVE_KEYS if (n := _number(status.get(k))) is not None}
    return Point(step, values, now) if values else None


class Tail:
    """A JSON-lines file read as it grows: each call gives the complete rows added since the last one. A file that
    was replaced or shortened (a resumed run drops the rows it redoes) is read again from its start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.inode: int | None = None

    def rows(self) -> Iterator[dict[str, Any]]:
        try:
            stat = os.stat(self.path)
        except OSError:
            return
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.inode, self.offset = stat.st_ino, 0
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1  # a line being written now waits for the next call
        self.offset += end
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                yield row


@dataclass
class Records:
    """The run's metrics.jsonl and eval.jsonl, followed."""

    run_dir: Path
    metrics: Tail = field(init=False)
    evals: Tail = field(init=False)

    def __post_init__(self) -> None:
        self.metrics, self.evals = Tail(self.run_dir / METRICS), Tail(self.run_dir / EVAL)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as dotted keys (``optim.lr``), each value a string: lists and None as JSON."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{name}.")
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


def devices(run_dir: Path) -> dict[str, str]:
    """Each rank's device as its status file says it (hosts/<host>/rank<N>.json), as ``device.<host>.rank<N>``."""
    found: dict[str, str] = {}
    for path in sorted((run_dir / "hosts").glob("*/rank*.json")):
        record = read_object(path)
        if isinstance(record.get("rank"), int) and record.get("device"):
            found[f"device.{path.parent.name}.rank{record['rank']}"] = str(record["device"])
    return found


def artifacts(run_dir: Path, card: Path | None) -> list[tuple[Path, str]]:
    """The files a finished run keeps in its trackers, with the folder each goes into ('' the top): the adapter, the
    loss curve, the held-out answers, the model card, `make eval`'s results (eval.tasks); those the run has."""
    wanted = [(run_dir / "adapter", "adapter"), (run_dir / "loss.png", ""), (run_dir / "samples.md", "")]
    wanted += [(run_dir / "eval" / name, "eval") for name in ("results.json", "README.md")]
    if card is not None:
        wanted.append((card, "model-card"))
    return [(path, folder) for path, folder in wanted if path.exists()]


def write_card(run_dir: Path, repo: Path) -> Path | None:
    """The run's model card for its adapter (ugro/model/card.py), in the controller's own .control/tracking/; None
    where the run has no adapter or the card cannot be rendered from its records."""
    from ugro.model import card
    from ugro.model.basemodel import ModelError

    adapter = run_dir / "adapter"
    if not adapter.is_dir():
        return None
    files = [(p.name, "the LoRA adapter's " + p.name) for p in sorted(adapter.iterdir()) if p.is_file()]
    try:
        text = card.render_card(run_dir, repo, artifact="adapter", files=files)
    except (ModelError, OSError, ValueError, KeyError, TypeError):
        return None
    out = run_dir / ".control" / "tracking" / "README.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out
