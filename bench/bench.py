"""`make bench`: balanced training on an emulated heterogeneous cluster, and the trainer's own overhead.

Part 1 runs the real trainer (the hosts' launcher, train/launcher.py: torchrun with its ranks forked from one
process; gloo, the default tiny model and data) as 3 ranks on this
machine that emulate devices of speed 1.0 / 0.6 / 0.5. The benchmark-only job section
``benchmark`` gives every rank a device time per token (train/balance/step.py ``StepClock``): a rank
computes each micro-batch for real, then sleeps until the micro-batch has taken its tokens x
``seconds_per_token / f``. ``seconds_per_token`` (the speed-1.0 device) is this machine's time per
token, measured once by the bare loop at the start, divided by ``--scale``, so the real compute
fits inside every device time and the emulated speeds hold however busy the machine is. Measured:

* ideal    -- the sum of the ranks' throughputs when each trains alone (three independent 1-rank
              jobs side by side),
* equal    -- the 3 ranks with equal shares (plain DDP: every step waits for the slowest),
* balanced -- the 3 ranks with ``balance: auto`` (calibration, then measured shares).

Part 2 compares the trainer's tokens/s on one rank at full speed, no emulation, with a bare
hand-written loop (forward, backward, AdamW) on the same model, data and batch shape, on one thread
of the benchmark's own process: ``--pairs`` runs of each, in A-B-B-A order so that a machine getting slower or faster
during the benchmark hits both alike.

Throughput counts only the steps after ``--skip`` (start-up, warm-up and calibration excluded,
the same steps for every variant); every process gets one thread (OMP_NUM_THREADS=1). The last
line printed is the balanced/ideal ratio.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
import yaml
from rich.console import Console
from rich.table import Table

from testbed.net import free_port
from train.config import load_job
from train.data.blocks import model_inputs, prepare
from train.metrics import read_metrics
from train.model.load import load_model

REPO = Path(__file__).resolve().parent.parent
console = Console(soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


@dataclass(frozen=True)
class Setup:
    factors: tuple[float, ...]
    scale: float
    seconds_per_token: float  # the emulated speed-1.0 device
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
    job: dict[str, Any] = yaml.safe_load((REPO / "jobs" / "tiny.yaml").read_text())
    job["name"] = f"bench-{balance}"
    job["data"]["seq_len"] = setup.seq_len
    job["schedule"]["warmup_steps"] = 2
    job["train"].update(max_steps=setup.steps, global_batch_size=setup.global_batch, log_every=1)
    job["checkpoint"]["every"] = setup.steps  # one checkpoint, after the last measured step
    job["rank_local"]["micro_batch_size"] = setup.micro_batch
    job["balance"] = balance
    if setup.seconds_per_token > 0:  # else this machine's full speed: no emulated device
        job["benchmark"] = {"emulate_speed": list(factors), "seconds_per_token": setup.seconds_per_token}
    return job


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
        sys.executable, "-m", "train.launcher", f"--nproc-per-node={len(factors)}", "--nnodes=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
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


def _alone(setup: Setup, root: Path) -> list[float]:
    """Each emulated device as its own 1-rank job, all at the same time."""
    names = [f"alone-{r}" for r in range(len(setup.factors))]
    speeds = ", ".join(map(str, setup.factors))
    with console.status(f"{len(names)} independent 1-rank runs side by side, speed {speeds}"):
        procs = [_start(n, setup, "equal", (f,), root) for n, f in zip(names, setup.factors, strict=True)]
        return [_rate(n, proc, setup, root) for n, proc in zip(names, procs, strict=True)]


def _bare(setup: Setup, root: Path) -> float:
    """The bare loop, in this process on one thread (as a rank); its sequences/s."""
    job_file = root / "bare.yaml"
    job_file.write_text(yaml.safe_dump(_job(setup, "equal", (1.0,)), sort_keys=False))
    with console.status("bare loop: the same model and batches, no trainer, one thread"):
        return bare_loop(job_file, setup.steps, setup.skip)


def _trainer(setup: Setup, root: Path) -> float:
    """The trainer on one rank at this machine's full speed (no emulated device); its sequences/s."""
    return _train("trainer", replace(setup, seconds_per_token=0.0), "equal", (1.0,), root)


def bare_loop(job_file: Path, steps: int, skip: int) -> float:
    """A hand-written loop on one thread: forward, backward, AdamW, on the job's model and batches; its sequences/s
    over the steps after ``skip``. Run in the benchmark's own process (which trains nothing else meanwhile): a
    process of its own would import torch, transformers and peft again for each measurement."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        job = load_job(job_file, benchmark=True)
        model, tokenizer, _ = load_model(job, REPO, torch.device("cpu"))
        blocks = prepare(job.data, tokenizer, REPO, job.train.seed)
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
                rows = blocks.batch(chunk.tolist(), torch.device("cpu"))
                out = model(**model_inputs(rows), labels=rows["labels"])
                (out.loss * len(chunk) / batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return batch * (steps - skip) / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


@app.callback()
def commands() -> None:
    """`make bench` runs ``run``."""  # a callback keeps ``run`` a subcommand: typer folds a lone command into the app


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
            help="Speed of the fastest emulated device relative to one core of this machine; 0 = chosen so that "
            "all ranks' real compute together keeps at most 30 % of the cores busy."
        ),
    ] = 0.0,
    rounds: Annotated[int, typer.Option(help="Rounds of ideal / equal / balanced; figures are their mean.")] = 2,
    pairs: Annotated[int, typer.Option(help="Runs of the bare loop and of the trainer each (A-B-B-A order).")] = 4,
    out: Annotated[Path, typer.Option(help="Where the runs and results.json go.")] = REPO / "runs" / "bench",
) -> None:
    """Emulated 1.0 / 0.6 / 0.5 cluster: ideal vs equal vs balanced; trainer vs bare loop."""
    speeds = tuple(float(f) for f in factors.split(","))
    if not 1 <= skip < steps or rounds < 1 or pairs < 1 or any(not 0 < f <= 1 for f in speeds):
        console.print("[red]bench: need 1 <= --skip < --steps, --rounds and --pairs >= 1, factors in (0, 1][/red]")
        raise typer.Exit(2)
    if scale <= 0:
        scale = min(1.0, 0.3 * (os.cpu_count() or 1) / sum(speeds))
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    setup = Setup(speeds, scale, 0.0, steps, skip, global_batch, micro_batch, seq_len)
    calibration = _bare(setup, out)  # this machine's sequences/s on one core, now
    setup = replace(setup, seconds_per_token=1.0 / (calibration * seq_len * scale))
    console.print(
        f"bare loop {calibration:.1f} sequences/s on one core: the speed-1.0 device needs "
        f"{setup.seconds_per_token * 1e3:.3f} ms per token (x {scale:.2f} of a core)"
    )
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        console.print(f"round {r + 1}/{rounds}")
        alone = _alone(setup, out)
        per_round.append(
            {
                "alone": alone,
                "ideal": sum(alone),
                "equal": _train("equal", setup, "equal", speeds, out),
                "balanced": _train("balanced", setup, "auto", speeds, out),
            }
        )
    bare_rates: list[float] = []
    trainer_rates: list[float] = []
    for p in range(pairs):  # A-B-B-A: a drifting machine speed cancels out of the sums
        console.print(f"trainer vs bare loop {p + 1}/{pairs}")
        if p % 2 == 0:
            bare_rates.append(_bare(setup, out))
            trainer_rates.append(_trainer(setup, out))
        else:
            trainer_rates.append(_trainer(setup, out))
            bare_rates.append(_bare(setup, out))

    def mean(key: str) -> float:
        return statistics.fmean(x[key] for x in per_round)

    alone = [statistics.fmean(x["alone"][i] for x in per_round) for i in range(len(speeds))]
    ideal, equal, balanced = (mean(k) for k in ("ideal", "equal", "balanced"))
    bare_rate, trainer = statistics.fmean(bare_rates), statistics.fmean(trainer_rates)
    table = Table(
        title=f"make bench: {len(speeds)} emulated ranks, speed {factors} (1.0 = {scale:.2f} of a core); "
        f"global batch {global_batch} x {seq_len} tokens; {rounds} round(s), {pairs} pair(s)"
    )
    table.add_column("variant")
    table.add_column("sequences/s", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("ratio", justify="right")
    # How well the emulated devices hold their speeds on this machine: each alone, against rank 0 alone.
    rows = [
        (f"rank {r} alone (speed {f})", rate, f"{rate / alone[0]:.2f} of rank 0")
        for r, (f, rate) in enumerate(zip(speeds, alone, strict=True))
    ]
    rows += [
        ("ideal: sum of the ranks alone", ideal, "1.00 of ideal"),
        ("plain DDP, equal shares", equal, f"{equal / ideal:.2f} of ideal"),
        ("ugro balance: auto", balanced, f"{balanced / ideal:.2f} of ideal"),
        ("bare loop, 1 process, full speed", bare_rate, "1.00 of bare"),
        ("trainer, 1 rank, full speed", trainer, f"{trainer / bare_rate:.2f} of bare"),
    ]
    for name, rate, ratio in rows:
        table.add_row(name, f"{rate:.2f}", f"{rate * seq_len:.0f}", ratio)
    console.print(table)
    results = {
        "setup": asdict(setup),
        "calibration_sequences_per_s": calibration,
        "alone": alone,
        "alone_over_fastest": [rate / alone[0] for rate in alone],  # vs the factors: the emulation's accuracy
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
        "bare_runs": bare_rates,
        "trainer_runs": trainer_rates,
        "seconds": round(time.monotonic() - began, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    console.print(f"runs and results.json in {out}; took {results['seconds']:.0f} s")
    print(f"balanced/ideal = {balanced / ideal:.3f}")


if __name__ == "__main__":
    app()
