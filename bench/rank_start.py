"""`make bench-rank-start`: the CPU one host spends to start a rank, torchrun's way against train/launcher.py's
(ranks forked from a launcher that imported the stack once, as on every host without a GPU).

On the 3-host test cluster the launch's seconds are mostly CPU: three agents and three ranks share two cores, and
each imports torch, the rank transformers and peft as well (docs/results.md, "Recovery"). torchrun starts a module
entrypoint (``-m train.worker``) as a new interpreter, so a rank imports torch again after its agent did;
``python -m train.launcher`` takes torchrun's arguments and forks the ranks instead. This benchmark times both on
this machine, each a one-host run (static rendezvous, as the launch script starts it) of the tiny job for one step
with no evaluation (one rank, gloo on the CPU): wall seconds and the CPU seconds of the whole process tree. The last
line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from bench.cluster_job import tiny_job
from testbed.net import free_port

REPO = Path(__file__).resolve().parent.parent
console = Console(soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


def _timed(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, every descendant the run waited for) of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:6])} ... failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@app.command()
def run(repeat: Annotated[int, typer.Option(min=1, help="runs of each way")] = 3) -> None:
    """Time both ways, alternating, and print the figures."""
    figures: dict[str, list[tuple[float, float]]] = {"torchrun": [], "train.launcher": []}
    with (tempfile.TemporaryDirectory(prefix="ugro-bench-rank-start-") as tmp,
          tiny_job("bench-rank-start", train={"max_steps": 1}, schedule={"warmup_steps": 0}) as job):  # fmt: skip
        for index in range(repeat):
            for way in figures:
                run_dir = Path(tmp) / f"{way}-{index}"
                launcher = "torch.distributed.run" if way == "torchrun" else way
                argv = [sys.executable, "-m", launcher, "--nnodes=1", "--node-rank=0", "--nproc-per-node=1",
                        "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=rank-start",
                        "--max-restarts=0", "--module", "train.worker", "--job", str(job), "--run-dir", str(run_dir),
                        "--code-dir", str(REPO)]  # fmt: skip
                figures[way].append(_timed(argv))
    table = Table(title=f"a one-step tiny job on one host, {repeat} runs each (load {os.getloadavg()[0]:.2f})")
    for column in ("way", "wall s", "CPU s (all processes)"):
        table.add_column(column)
    for way, rows in figures.items():
        table.add_row(way, " / ".join(f"{w:.2f}" for w, _ in rows), " / ".join(f"{c:.2f}" for _, c in rows))
    console.print(table)
    best = {way: min(c for _, c in rows) for way, rows in figures.items()}
    print(json.dumps({"torchrun_cpu_s": round(best["torchrun"], 2), "launcher_cpu_s": round(best["train.launcher"], 2),
                      "saved_cpu_s_per_host": round(best["torchrun"] - best["train.launcher"], 2),
                      "load": round(os.getloadavg()[0], 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    app()
