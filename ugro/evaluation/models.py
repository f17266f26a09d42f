"""The two models an evaluation compares, as lm-eval's HFLM arguments: the base the run was tuned from, and the
run's model (its merged model where runs/<job-id>/merged exists, else the base with the adapter through peft). Both
read prompts with the run's tokenizer (saved with the adapter: its chat template is the trained one), on the CPU
of the controller, in the job's dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, JobConfig
from ugro.model.merge import base_of

BATCH_SIZE = 4


@dataclass(frozen=True)
class EvalModel:
    label: str  # "base" or "tuned"
    pretrained: Path
    tokenizer: Path
    peft: Path | None
    dtype: str

    def hflm_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "pretrained": str(self.pretrained),
            "tokenizer": str(self.tokenizer),
            "dtype": self.dtype,
            "batch_size": BATCH_SIZE,
            "add_bos_token": False,  # the documents carry their BOS where the run trained with one
            "trust_remote_code": False,
        }
        if self.peft is not None:
            args["peft"] = str(self.peft)
        return args

    def describe(self, repo: Path) -> str:
        def shown(path: Path) -> str:
            return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)

        return shown(self.pretrained) + (f" + {shown(self.peft)}" if self.peft else "")


def _merged_current(merged: Path, adapter: Path) -> bool:
    """runs/<id>/merged holds a whole model exported from this adapter (not older than it)."""
    weights = list(merged.glob("*.safetensors"))
    newest_adapter = max((p.stat().st_mtime for p in adapter.iterdir() if p.is_file()), default=0.0)
    return (
        (merged / "config.json").is_file()
        and bool(weights)
        and min(w.stat().st_mtime for w in weights) >= newest_adapter
    )


def run_models(run_dir: Path, repo: Path, job: JobConfig) -> tuple[EvalModel, EvalModel]:
    """(base, tuned) of the run in ``run_dir``; a run without its adapter or base weights is one ConfigError."""
    adapter = run_dir / "adapter"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run (the runs are in {run_dir.parent})")
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(
            f"{adapter}: no adapter here: the run has not finished, or its results are still on its hosts "
            f"(`make logs JOB_ID={run_dir.name}` collects them)"
        )
    base_dir = base_of(adapter, repo)
    dtype = job.model.dtype
    base = EvalModel("base", base_dir, adapter, None, dtype)
    merged = run_dir / "merged"
    if _merged_current(merged, adapter):
        return base, EvalModel("tuned", merged, adapter, None, dtype)
    return base, EvalModel("tuned", base_dir, adapter, adapter, dtype)
