"""`make bench`: balanced training on an emulated heterogeneous cluster, and the trainer's own overhead.

Part 1 runs the real trainer (torchrun, gloo, the default tiny model and data) as 3 ranks on this
machine whose speed factors are 1.0 / 0.6 / 0.5: the benchmark-only job key
``benchmark.emulate_speed`` stretches each stretch of a rank's compute to (1/f) x its CPU time
(train/step.py ``StepClock``), so the rank behaves like a device f times as fast. It measures:

* ideal    -- the sum of the ranks' throughputs when each trains alone (three independent 1-rank
              jobs side by side, so they meet the same CPU contention as the 3-rank runs),
* equal    -- the 3 ranks with equal shares (plain DDP: every step waits for the slowest),
* balanced -- the 3 ranks with ``balance: auto``.

Part 2 compares the trainer's tokens/s on one rank at full speed with a bare hand-written loop
(forward, backward, AdamW) on the same model, data and batch shape, in one process.

Throughput counts only the steps after ``--skip`` (start-up, warm-up and calibration excluded,
the same steps for every variant). Every process gets one thread (OMP_NUM_THREADS=1), and the
emulated devices run at ``--scale`` of a core (by default small enough that all ranks together
keep at most 30 % of the cores busy), so that the ranks of a small machine do not slow each other
down: the ratios then measure the balancing, not the CPU contention. Every variant runs
``--rounds`` times, interleaved, and the figures are means, because a shared machine has slow
minutes. The last line printed is the balanced/ideal ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
import yaml
from rich.console import Console
from rich.table import Table

from train.config import load_job
from train.data import prepare
from train.metrics import read_metrics
from train.model import load_model

REPO = Path(__file__).resolve().parent.parent
console = Console()
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


@dataclass(frozen=True)
class Setup:
    factors: tuple[float, ...]
    scale: float
    steps: int
    skip: int
    global_batch: int
    micro_batch: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def _job(setup: Setup, balance: str, factors: tuple[float, ...]) -> dict[str, Any]:
    """The default job, shortened, with the benchmark's speed factors."""
    job: dict[str, Any] = yaml.safe_load((REPO / "jobs" / "default.yaml").read_text())
    job["name"] = f"bench-{balance}"
    job["data"]["seq_len"] = setup.seq_len
    job["schedule"]["warmup_steps"] = 2
    job["train"].update(max_steps=setup.steps, global_batch_size=setup.global_batch, log_every=1)
    job["checkpoint"]["every"] = setup.steps  # one checkpoint, after the last measured step
    job["rank_local"]["micro_batch_size"] = setup.micro_batch
    job["balance"] = balance
    job["benchmark"] = {"emulate_speed": list(factors)}
    return job


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _fail(what: str, log: Path, output: str) -> None:
    console.print(f"[red]bench: {what} failed[/red]; last lines of {log}:")
    console.print(output[-3000:], markup=False, highlight=False)
    raise typer.Exit(1)


def _start(name: str, setup: Setup, balance: str, factors: tuple[float, ...], root: Path) -> subprocess.Popen[str]:
    """Start the trainer with one rank per (absolute) speed factor."""
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time: the worker appends to what it finds
    job_file = root / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(_job(setup, balance, factors), sort_keys=False))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={len(factors)}", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--max-restarts=0",
        "-m", "train.worker", "--job", str(job_file), "--run-dir", str(run_dir), "--code-dir", str(REPO),
        "--benchmark",
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _rate(name: str, proc: subprocess.Popen[str], setup: Setup, root: Path) -> float:
    """Wait for a run; its sequences/s over the measured steps."""
    output, _ = proc.communicate()
    if proc.returncode != 0:
        _fail(name, root / name / "logs", output)
    rows = {row["step"]: row for row in read_metrics(root / name)}
    first, last = rows[setup.skip], rows[setup.steps]
    return setup.global_batch * (setup.steps - setup.skip) / (last["time"] - first["time"])


def _train(name: str, setup: Setup, balance: str, factors: tuple[float, ...], root: Path) -> float:
    with console.status(f"{name}: {len(factors)} rank(s) at speed {', '.join(map(str, factors))}, balance {balance}"):
        return _rate(name, _start(name, setup, balance, factors, root), setup, root)


def _alone(setup: Setup, emulated: tuple[float, ...], root: Path) -> list[float]:
    """Each emulated device as its own 1-rank job, all at the same time (the same CPU contention as a cluster run)."""
    names = [f"alone-{r}" for r in range(len(emulated))]
    with console.status(f"{len(emulated)} independent 1-rank runs side by side, speed {', '.join(map(str, emulated))}"):
        procs = [_start(n, setup, "equal", (e,), root) for n, e in zip(names, emulated, strict=True)]
        return [_rate(n, proc, setup, root) for n, proc in zip(names, procs, strict=True)]


def _bare(setup: Setup, root: Path) -> float:
    """The bare loop in its own process (same thread count as a rank); its sequences/s."""
    job_file = root / "bare.yaml"
    job_file.write_text(yaml.safe_dump(_job(setup, "equal", (1.0,)), sort_keys=False))
    cmd = [sys.executable, "-m", "train.bench", "bare", str(job_file), "--steps", str(setup.steps)]
    cmd += ["--skip", str(setup.skip)]
    with console.status("bare loop: 1 process, the same model and batches, no trainer"):
        done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        _fail("bare loop", job_file, done.stdout + done.stderr)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["sequences_per_s"])


@app.command("bare", hidden=True)
def bare(job_file: Path, steps: int = 20, skip: int = 4) -> None:
    """A hand-written loop: forward, backward, AdamW. Prints its sequences/s as JSON."""
    torch.manual_seed(0)
    job = load_job(job_file, benchmark=True)
    model, tokenizer, _ = load_model(job, REPO, torch.device("cpu"))
    blocks = prepare(job.data, tokenizer, REPO)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.optim.lr)
    batch, micro = job.train.global_batch_size, job.rank_local.micro_batch_size
    order = torch.randperm(len(blocks))
    model.train()
    started = 0.0
    for step in range(steps):
        if step == skip:
            started = time.perf_counter()
        ids = order[torch.arange(step * batch, (step + 1) * batch) % len(blocks)]
        for chunk in ids.split(micro):
            out = model(
                input_ids=blocks.input_ids[chunk],
                attention_mask=blocks.attention_mask[chunk],
                labels=blocks.labels[chunk],
            )
            (out.loss * len(chunk) / batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"sequences_per_s": batch * (steps - skip) / (time.perf_counter() - started)}))


@app.command("run")
def run(
    factors: Annotated[str, typer.Option(help="Speed factor of each emulated rank, fastest first.")] = "1.0,0.6,0.5",
    steps: Annotated[int, typer.Option(help="Optimizer steps per run.")] = 16,
    skip: Annotated[int, typer.Option(help="Steps left out of the measurement (warm-up, calibration).")] = 6,
    global_batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 48,
    micro_batch: Annotated[int, typer.Option(help="Largest micro-batch per rank.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    scale: Annotated[
        float,
        typer.Option(
            help="Speed of the fastest emulated device relative to one CPU core; 0 = chosen so that all ranks "
            "together keep at most 30 % of this machine's cores busy (ranks must not slow each other down)."
        ),
    ] = 0.0,
    rounds: Annotated[int, typer.Option(help="Rounds of every variant, interleaved; figures are their mean.")] = 2,
    out: Annotated[Path, typer.Option(help="Where the runs and results.json go.")] = REPO / "runs" / "bench",
) -> None:
    """Emulated 1.0 / 0.6 / 0.5 cluster: ideal vs equal vs balanced; trainer vs bare loop."""
    speeds = tuple(float(f) for f in factors.split(","))
    if not 1 <= skip < steps or rounds < 1 or any(not 0 < f <= 1 for f in speeds):
        console.print("[red]bench: need 1 <= --skip < --steps, --rounds >= 1 and every factor in (0, 1][/red]")
        raise typer.Exit(2)
    if scale <= 0:
        scale = min(1.0, 0.3 * (os.cpu_count() or 1) / sum(speeds))
    setup = Setup(speeds, scale, steps, skip, global_batch, micro_batch, seq_len)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    emulated = tuple(round(f * scale, 4) for f in speeds)
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):  # interleaved, so that a slow minute of a shared machine hits every variant alike
        console.print(f"round {r + 1}/{rounds}")
        alone = _alone(setup, emulated, out)
        per_round.append(
            {
                "alone": alone,
                "ideal": sum(alone),
                "equal": _train("equal", setup, "equal", emulated, out),
                "balanced": _train("balanced", setup, "auto", emulated, out),
                "bare": _bare(setup, out),
                "trainer": _train("trainer", setup, "equal", (1.0,), out),  # full speed: no emulation
            }
        )

    def mean(key: str) -> float:
        return statistics.fmean(x[key] for x in per_round)

    alone = [statistics.fmean(x["alone"][i] for x in per_round) for i in range(len(speeds))]
    ideal, equal, balanced, bare_rate, trainer = (mean(k) for k in ("ideal", "equal", "balanced", "bare", "trainer"))
    table = Table(
        title=f"make bench: {len(speeds)} emulated ranks, speed {factors} (x {scale:.2f} of a core); "
        f"global batch {global_batch} x {seq_len} tokens; mean of {rounds} round(s)"
    )
    table.add_column("variant")
    table.add_column("sequences/s", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("ratio", justify="right")
    rows = [(f"rank {r} alone (speed {f})", rate, "") for r, (f, rate) in enumerate(zip(speeds, alone, strict=True))]
    rows += [
        ("ideal: sum of the ranks alone", ideal, "1.00 of ideal"),
        ("plain DDP, equal shares", equal, f"{equal / ideal:.2f} of ideal"),
        ("ugro balance: auto", balanced, f"{balanced / ideal:.2f} of ideal"),
        ("bare loop, 1 process", bare_rate, "1.00 of bare"),
        ("trainer, 1 rank", trainer, f"{trainer / bare_rate:.2f} of bare"),
    ]
    for name, rate, ratio in rows:
        table.add_row(name, f"{rate:.2f}", f"{rate * seq_len:.0f}", ratio)
    console.print(table)
    results = {
        "setup": setup.__dict__,
        "alone": alone,
        "ideal": ideal,
        "equal": equal,
        "balanced": balanced,
        "bare": bare_rate,
        "trainer": trainer,
        "balanced_over_ideal": balanced / ideal,
        "equal_over_ideal": equal / ideal,
        "trainer_over_bare": trainer / bare_rate,
        "rounds": per_round,
        "balanced_over_ideal_per_round": [x["balanced"] / x["ideal"] for x in per_round],
        "seconds": round(time.monotonic() - began, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    console.print(f"runs and results.json in {out}; took {results['seconds']:.0f} s")
    print(f"balanced/ideal = {balanced / ideal:.3f}")


if __name__ == "__main__":
    app()
