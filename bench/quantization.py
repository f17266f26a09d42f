"""`make bench-4bit`: does 4-bit QLoRA of the default model learn as well as the unquantized run?

Runs the default job (jobs/default.yaml: SmolLM2-135M-Instruct, 24 steps, the bundled data, seed 1234)
through torchrun on this machine once per variant, the same job and seed each time, changing only
model.quantization / model.dtype, and prints the held-out loss at every evaluation and the training loss
at every logged step, side by side. Figures, not pass/fail: docs/results.md records a run.

    python -m bench.quantization [--variants none-float32,4bit-float32] [--steps 24] [--nproc 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from testbed.net import free_port
from train.metrics import read_eval, read_metrics
from ugro.model import basemodel

REPO = Path(__file__).resolve().parent.parent
console = Console(width=160, soft_wrap=True)
VARIANTS = {
    "none-float32": {"quantization": "none", "dtype": "float32"},
    "none-bfloat16": {"quantization": "none", "dtype": "bfloat16"},
    "4bit-float32": {"quantization": "4bit", "dtype": "float32"},
    "4bit-bfloat16": {"quantization": "4bit", "dtype": "bfloat16"},
}


def run_variant(name: str, steps: int, nproc: int, work: Path) -> tuple[Path, float]:
    """The default job with one variant's model settings, through torchrun: (its run directory, seconds)."""
    job: dict[str, Any] = yaml.safe_load((REPO / "jobs" / "default.yaml").read_text())
    job["name"] = f"bench-4bit-{name}"
    job["model"] |= VARIANTS[name]
    job["train"] |= {"max_steps": steps}
    job["checkpoint"] |= {"every": steps}
    job_file = work / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    run_dir = work / name
    argv = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "--module", "train.worker", "--job", str(job_file), "--run-dir", str(run_dir), "--resume", "none",
        "--code-dir", str(REPO),
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"variant {name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return run_dir, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none-float32,4bit-float32", help=f"comma list of {sorted(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}: choose from {sorted(VARIANTS)}")
    basemodel.ensure(REPO / "models" / "smollm2-135m-instruct")
    load = os.getloadavg()[0]
    results: dict[str, tuple[Path, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ugro-bench-4bit-") as tmp:
        for name in names:
            console.print(f"running {name} ({args.steps} steps, {args.nproc} ranks) ...")
            results[name] = run_variant(name, args.steps, args.nproc, Path(tmp))
        evals = {n: {r["step"]: r["eval_loss"] for r in read_eval(d)} for n, (d, _) in results.items()}
        train = {n: {r["step"]: r["loss"] for r in read_metrics(d)} for n, (d, _) in results.items()}
    table = Table(title=f"held-out loss (eval) and training loss by step; load average {load:.1f} at start")
    table.add_column("step", justify="right")
    for name in names:
        table.add_column(f"{name} eval", justify="right")
        table.add_column(f"{name} train", justify="right")
    for step in sorted({s for e in evals.values() for s in e} | {s for t in train.values() for s in t}):
        cells = []
        for name in names:
            e, t = evals[name].get(step), train[name].get(step)
            cells += [f"{e:.4f}" if e is not None else "", f"{t:.4f}" if t is not None else ""]
        if any(cells):
            table.add_row(str(step), *cells)
    console.print(table)
    for name in names:
        first, last = evals[name][min(evals[name])], evals[name][max(evals[name])]
        console.print(
            f"{name}: held-out loss {first:.4f} -> {last:.4f} ({(last - first) / first:+.1%}) "
            f"in {results[name][1]:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
