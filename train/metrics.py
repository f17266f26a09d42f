"""Rank 0's record of a run: metrics.jsonl, TensorBoard events, run.json status, the loss curve."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# metrics.jsonl and run.json are also read where the job's state is reported (ugro/module_utils/ugro_jobstate.py).
METRICS = "metrics.jsonl"
EVAL = "eval.jsonl"
STATUS = "run.json"
SAMPLES = "samples"  # samples.md for people, samples.json for the controller's summary
# hosts/<host>/rank<N>.json: every rank's own latest figures, on its own host (the node exporter reads them).
RANK_STATUS = "rank{rank}.json"


def write_status(run_dir: Path, **fields: Any) -> None:
    """Merge fields into run.json atomically (readers never see half a file)."""
    path = run_dir / STATUS
    current: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    current |= fields
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(current, indent=1))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line being written right now
    return rows


def last_logged_step(run_dir: Path) -> int | None:
    rows = read_metrics(run_dir)
    return int(rows[-1]["step"]) if rows else None


def steps_by_host(run_dir: Path) -> dict[str, int]:
    """How many of the run's logged steps each host took part in (a host lent, lost or back counts the rest)."""
    counted: dict[str, int] = {}
    for row in read_metrics(run_dir):
        for host in dict.fromkeys((row.get("ranks") or {}).get("host") or []):
            counted[str(host)] = counted.get(str(host), 0) + 1
    return counted


def take_over(shadow_dir: Path, run_dir: Path) -> None:
    """The rows a host kept for itself (MetricsWriter with tensorboard=False in ``shadow_dir``) become the run's,
    when its host takes over the run's records from a main host that was lost."""
    for name in (METRICS, EVAL):
        if (shadow_dir / name).is_file():
            os.replace(shadow_dir / name, run_dir / name)


def _drop_rows_after(path: Path, step: int) -> None:
    """Remove the rows of steps after ``step`` (a resumed run redoes them; from step 0, all), atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if step > 0 and int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut off by the failure that ended the last attempt
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriter:
    """The run's metrics.jsonl, eval.jsonl and TensorBoard events, from ``start_step`` on (later rows are dropped).

    The main rank keeps them in the run directory; local rank 0 of every other host keeps the same rows in its
    own ``hosts/<host>/`` without TensorBoard (``tensorboard=False``: every figure of a row is the same on every
    rank), so that a survivor whose host becomes the main one after the main host is lost holds the run's whole
    history (``take_over``)."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool = True) -> None:
        for name in (METRICS, EVAL):
            _drop_rows_after(run_dir / name, start_step)
        self.run_dir = run_dir
        self.total = total_steps
        self.start_step = start_step
        self.started = time.monotonic()
        self.tokens_since_start = 0
        self._file = (run_dir / METRICS).open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(
        self,
        step: int,
        loss: float,
        tokens: int,
        lr: float,
        grad_norm: float,
        epoch: float,
        ranks: dict[str, list[Any]] | None = None,
        pairs: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """One optimizer step; ``ranks`` (``rank_figures``) holds every rank's host, share and speed; ``pairs`` a
        preference method's figures of the step (rewards, margin, accuracy: train/preference/step.py)."""
        self.tokens_since_start += tokens
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        row: dict[str, Any] = {
            "step": step,
            "total_steps": self.total,
            "loss": round(loss, 6),
            "lr": lr,
            "grad_norm": round(grad_norm, 6),
            "tokens": tokens,
            "tokens_per_s": round(self.tokens_since_start / elapsed, 1) if elapsed > 0 else 0.0,
            "epoch": round(epoch, 4),
            "elapsed_s": round(elapsed, 2),
            "eta_s": round(elapsed / done * (self.total - step), 1) if done else None,
            "time": time.time(),
        }
        if ranks is not None:
            row["ranks"] = ranks
        extra = {key: round(value, 6) for key, value in (pairs or {}).items() if key != "loss"}
        row |= extra
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", *extra):
                self._tb.add_scalar(f"train/{key}", row[key], step)
        return row

    def log_eval(self, step: int, loss: float, tokens: int, adapter: bool = True,
                 pairs: dict[str, float | None] | None = None) -> dict[str, Any]:  # fmt: skip
        """One held-out evaluation: step 0 with adapter=False is the base model; ``pairs``: a preference method's
        held-out figures (``tokens`` is then the held-out items)."""
        row: dict[str, Any] = {
            "step": step,
            "eval_loss": round(loss, 6),
            "tokens": tokens,
            "model": "fine-tuned" if adapter else "base",
        }
        extra = {key: None if value is None else round(value, 6) for key, value in (pairs or {}).items()
                 if key not in ("loss", "items")}  # fmt: skip
        row |= extra
        with (self.run_dir / EVAL).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, step)
            for key, value in extra.items():
                if value is not None:
                    self._tb.add_scalar(f"eval/{key}", value, step)
        return row

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def rank_figures(
    hosts: Sequence[str],
    shares: Sequence[int],
    ready_s: Sequence[float],
    tokens: Sequence[float],
    peak_gib: Sequence[float] = (),
) -> dict[str, list[Any]]:
    """Every rank's host and share of this step's global batch (0-1), and, from the step before (the figures
    this step's all-reduce brought: train/balance/step.py ``StepClock``), its compute time until its gradients were
    ready, its label tokens per second of that time and its peak memory in GiB (on its GPU, else its process's peak
    resident set); None where nothing was measured yet (a run's first step)."""
    total = sum(shares) or 1
    return {
        "host": list(hosts),
        "share": [round(s / total, 6) for s in shares],
        "ready_s": [round(t, 4) if t > 0 else None for t in ready_s],
        "tokens_per_s": [round(n / t, 1) if t > 0 else None for n, t in zip(tokens, ready_s, strict=False)],
        "peak_gib": [round(g, 3) if g > 0 else None for g in peak_gib],
    }


@dataclass(frozen=True)
class RankStatus:
    """This rank's latest figures, written into ``hosts/<host>/rank<N>.json`` on its own host, atomically, every step:
    what the node exporter (ugro/module_utils/ugro_exporter.py) serves for the ranks of its host, what
    ``make status`` says the rank computes (``part``: the whole model, or its pipeline stage and layers), and the
    device it computes on (``device``: train/layout/engine.py ``device_name``, what the model card names); after a
    change of group, its generation, attempt, the step it continued from, and the digest of the rank's weights at the
    first step in the new group (``regrouped``; the controller settles the restart from it when the main host cannot
    answer)."""

    host: str
    rank: int
    step: int
    total_steps: int
    loss: float
    figures: dict[str, list[Any]]  # ``rank_figures``: every rank's share, ready time, tokens/s
    part: str = "the whole model"
    device: str | None = None
    regrouped: dict[str, Any] | None = None

    def _own(self, key: str) -> Any:
        values = self.figures.get(key, [])
        return values[self.rank] if self.rank < len(values) else None

    def write(self, run_dir: Path) -> None:
        record = {
            "job": run_dir.name,
            "host": self.host,
            "rank": self.rank,
            "world_size": len(self.figures.get("share", [])),
            "step": self.step,
            "total_steps": self.total_steps,
            "loss": round(self.loss, 6),
            "share": self._own("share"),
            "ready_s": self._own("ready_s"),
            "tokens_per_s": self._own("tokens_per_s"),
            "peak_gib": self._own("peak_gib"),
            "part": self.part,
            "device": self.device,
            "regrouped": self.regrouped,
            "time": time.time(),
        }
        path = run_dir / "hosts" / self.host / RANK_STATUS.format(rank=self.rank)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def read_eval(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / EVAL
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def read_samples(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / f"{SAMPLES}.json"
    return list(json.loads(path.read_text())) if path.is_file() else []


def write_samples(run_dir: Path, model_name: str, items: list[dict[str, str]]) -> Path:
    """samples.md: each held-out question with the reference, the base model's and the fine-tuned answer."""
    (run_dir / f"{SAMPLES}.json").write_text(json.dumps(items, indent=1, ensure_ascii=False) + "\n")
    lines = [
        f"# Held-out questions: {model_name} before and after fine-tuning",
        "",
        "Greedy decoding, the same prompt for both; none of these questions is in the training data.",
        "",
    ]
    for n, item in enumerate(items, 1):
        lines += [f"## {n}. {item['question']}", ""]
        for label, key in (("Reference", "reference"), ("Base model", "before"), ("Fine-tuned", "after")):
            quoted = "\n".join(f"> {line}" if line else ">" for line in (item.get(key) or "(no answer)").splitlines())
            lines += [f"**{label}:**", "", quoted, ""]
    out = run_dir / f"{SAMPLES}.md"
    out.write_text("\n".join(lines))
    return out


def _per_rank(rows: list[dict[str, Any]], key: str) -> dict[int, tuple[list[int], list[float]]]:
    """rank -> (steps, values) of one per-rank figure, for the rows that carry it."""
    series: dict[int, tuple[list[int], list[float]]] = {}
    for row in rows:
        values = (row.get("ranks") or {}).get(key) or []
        for rank, value in enumerate(values):
            if value is not None:
                steps, ys = series.setdefault(rank, ([], []))
                steps.append(int(row["step"]) - (0 if key == "share" else 1))  # times are the step before's
                ys.append(float(value))
    return series


def _loss_label(run_dir: Path) -> str:
    """What the loss is: per answer token (sft), or a preference method's mean per pair (kto: per example)."""
    path = run_dir / STATUS
    job = (json.loads(path.read_text()).get("job") or {}) if path.is_file() else {}
    method = (job.get("train") or {}).get("method") or "sft"
    if method == "sft":
        return "loss (mean per answer token)"
    return f"{method.upper()} loss (mean per {'example' if method == 'kto' else 'pair'})"


def plot_loss(run_dir: Path) -> Path | None:
    """The end-of-run picture, loss.png: training and held-out loss over the steps, each rank's tokens/s, and
    each rank's share of the global batch (how the balancer split it), from metrics.jsonl."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed, share = _per_rank(rows, "tokens_per_s"), _per_rank(rows, "share")
    panels = 3 if speed or share else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.2 * panels), dpi=100, sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", linewidth=1, label="training")
    evals = read_eval(run_dir)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="held-out")
    ax.legend()
    ax.set_ylabel(_loss_label(run_dir))
    ax.set_title(run_dir.name)
    if panels == 3:
        hosts = next(((row.get("ranks") or {}).get("host") for row in reversed(rows) if row.get("ranks")), None) or []

        def name(rank: int) -> str:
            return f"rank {rank} ({hosts[rank]})" if rank < len(hosts) else f"rank {rank}"

        ax = axes[1][0]
        for rank, (steps, values) in sorted(speed.items()):
            ax.plot(steps, values, linewidth=1, label=name(rank))
        ax.plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], "k--", linewidth=1,
                label="all ranks (wall clock, since start)")  # fmt: skip
        ax.set_ylabel("tokens/s")
        ax.set_title("tokens/s per rank (its own compute time, waiting left out)", fontsize="medium")
        ax.legend(fontsize="small")
        ax = axes[2][0]
        steps = [int(row["step"]) for row in rows if row.get("ranks")]
        bottom = [0.0] * len(steps)
        for rank, (at, values) in sorted(share.items()):  # stacked: each rank a band, together the whole batch
            by_step = dict(zip(at, values, strict=True))
            top = [b + by_step.get(step, 0.0) for b, step in zip(bottom, steps, strict=True)]
            ax.fill_between(steps, bottom, top, step="post", alpha=0.85, label=name(rank))
            bottom = top
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of the global batch")
        ax.set_title("each rank's share of the global batch, stacked (the balancer's plan)", fontsize="medium")
        ax.legend(fontsize="small", loc="lower right", framealpha=0.9)
    axes[-1][0].set_xlabel("optimizer step")
    for row_axes in axes:
        row_axes[0].grid(alpha=0.3)
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
