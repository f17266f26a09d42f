"""Rank 0's record of a run: metrics.jsonl, TensorBoard events, run.json status, the loss curve."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# metrics.jsonl and run.json are also read where the job's state is reported (ugro/module_utils/ugro_jobstate.py).
METRICS = "metrics.jsonl"
EVAL = "eval.jsonl"
STATUS = "run.json"
SAMPLES = "samples"  # samples.md for people, samples.json for the controller's summary


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


class MetricsWriter:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.total = total_steps
        self.start_step = start_step
        self.started = time.monotonic()
        self.tokens_since_start = 0
        self._file = (run_dir / METRICS).open("a", encoding="utf-8")
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, step: int, loss: float, tokens: int, lr: float, grad_norm: float, epoch: float) -> dict[str, Any]:
        self.tokens_since_start += tokens
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        row = {
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
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            self._tb.add_scalar(f"train/{key}", row[key], step)
        return row

    def log_eval(self, step: int, loss: float, tokens: int, adapter: bool = True) -> dict[str, Any]:
        """One held-out evaluation: step 0 with adapter=False is the base model."""
        row = {
            "step": step,
            "eval_loss": round(loss, 6),
            "tokens": tokens,
            "model": "fine-tuned" if adapter else "base",
        }
        with (self.run_dir / EVAL).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        self._tb.add_scalar("eval/loss", loss, step)
        return row

    def close(self) -> None:
        self._file.close()
        self._tb.close()


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


def plot_loss(run_dir: Path) -> Path | None:
    """Draw loss over steps from metrics.jsonl into loss.png."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", linewidth=1, label="training")
    evals = read_eval(run_dir)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="held-out")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per answer token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
