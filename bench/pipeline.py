"""`make bench-pipeline`: pipeline stages on emulated unequal devices, the planner's layer split against an equal one.

Runs the real trainer (torchrun, gloo, 1F1B stages: train/layout/pipeline.py) as 3 ranks on this machine forming one
3-stage pipeline, each rank emulating a device of speed 1.0 / 0.6 / 0.5 the way `make bench` does
(bench/bench.py): the job's benchmark-only section ``benchmark: {emulate_speed, seconds_per_token}`` makes a
stage's micro-batch last its tokens x ``seconds_per_token / f`` x (the stage's layers, + the head's work on the last
stage, over the model's), a
third forward and two thirds backward, before its result leaves. The real compute runs inside that time;
``seconds_per_token`` is this machine's measured time per token for the whole model on one core (the bare loop of
bench/bench.py on the same model), divided by ``--scale``.

The model is the tiny test Llama (models/tiny-llama, random init, its tokenizer) with ``--layers`` decoder layers
(12 by default: its 4 layers cannot be cut unevenly in any useful way); its config.json is written into the
output directory. Measured, tokens/s over the steps after ``--skip``:

* planned -- the layer counts ``train.layout.stageplan.plan`` chooses for 3 stages when it is given three members of
             these speeds (hosts dev0, dev1, ...; memory 16 GiB each, so memory does not bind). On one machine every
             rank has the same host and the ranks look alike to the planner, so the benchmark plans here and runs
             the result as ``parallel: {stages: [a, b, c]}``; identical ranks take the stages in rank order, so
             ``emulate_speed`` is ordered as the planner ordered the devices (checked against run.json's layout);
* equal   -- ``parallel: {stages: [L/3, L/3, L/3]}``, the devices in the order given (fastest first).

Computed, not run:

* ideal   -- the bubble-free bound: a step's device work over the devices' summed speed. The emulated work of a
             step is ``tokens x seconds_per_token`` of a speed-1.0 device, spread over stages with speeds f_i, so
             ``ideal tokens/s = sum(f_i) / seconds_per_token``;
* 1F1B    -- the same bound with the pipeline's bubble at a perfect balance: ``ideal x M / (M + S - 1)`` (S stages,
             M micro-batches a step);
* model   -- each split's own 1F1B estimate: with t_i = a micro-batch's forward and backward on stage i, a step
             takes ``sum(t_i) + (M - 1) x max(t_i)``.

Bubble: ``1 - busy / step``, where busy is the busiest stage's emulated device time a step (its tokens x
seconds_per_token x its layers / L / f) and step the measured time a step; what it includes beyond the pipeline's
fill and drain: the optimizer step, the per-step all-reduces and logging. Every process gets one thread
(OMP_NUM_THREADS=1). The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from bench.bench import REPO, Setup, _env, _job, _rate, bare_loop
from testbed.net import free_port
from train.config import load_job
from train.layout import stageplan
from train.layout.topology import Layout

TINY = REPO / "models" / "tiny-llama"
console = Console(width=150, soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


def _model(layers: int, out: Path) -> Path:
    """The tiny Llama's config.json with ``layers`` decoder layers, in its own directory under ``out``."""
    config = json.loads((TINY / "config.json").read_text())
    config["num_hidden_layers"] = layers
    directory = out / f"tiny-llama-{layers}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def _pipeline_job(setup: Setup, model: Path, counts: list[int] | None, speeds: tuple[float, ...]) -> dict[str, Any]:
    """make bench's job on the ``model`` as pipeline stages of these layer counts (None: no stages, the bare loop)."""
    job = _job(setup, "equal", speeds)
    job["name"] = "bench-pipeline"
    job["model"] |= {"source": str(model), "tokenizer": str(TINY.relative_to(REPO))}
    job["rank_local"]["memory_gib"] = 16.0  # the same on every rank: the ranks are interchangeable to the planner
    if counts is not None:
        job["parallel"] = {"stages": counts}
    return job


def _write(job: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _calibrate(setup: Setup, model: Path, out: Path) -> float:
    """The bare loop of bench/bench.py on this model, on one thread of this process: sequences/s of one core."""
    job_file = _write(_pipeline_job(setup, model, None, (1.0,)), out / "calibration.yaml")
    with console.status("bare loop: this machine's speed on one core (the emulated speed-1.0 device follows it)"):
        return bare_loop(job_file, max(setup.skip + 3, 8), 3)


def planned_split(setup: Setup, model: Path, speeds: tuple[float, ...], out: Path) -> tuple[list[int], list[float]]:
    """The planner's layer counts for one pipeline of these devices, and the device speed of each stage."""
    job = load_job(_write(_pipeline_job(setup, model, None, speeds), out / "plan.yaml"), benchmark=True)
    job = job.model_copy(update={"parallel": stageplan.StagesConfig(stages=len(speeds))})
    members = [
        stageplan.Member(host=f"dev{i}", memory_gib=16.0, speed=f, device="cpu", rank_local=job.rank_local)
        for i, f in enumerate(speeds)
    ]
    stages = stageplan.plan(job, stageplan.ModelShape.from_dir(model), members).replicas[0].stages
    return [s.end - s.start for s in stages], [speeds[s.rank] for s in stages]


def micro_batches(setup: Setup, stages: int) -> int:
    """Micro-batches a step of one pipeline (train/balance/batchplan.py: the rank's cap, at most the share over the
    stages)."""
    micro = min(setup.micro_batch, max(1, setup.global_batch // stages))
    return math.ceil(setup.global_batch / micro)


def busy_s(setup: Setup, counts: list[int], speeds: list[float], head: float) -> list[float]:
    """Every stage's emulated device time in one step: its layers, and on the last stage the head (``head``
    layers' worth of work, as the planner and the emulation count it: train/balance/batchplan.py)."""
    work = setup.tokens_per_step * setup.seconds_per_token / (sum(counts) + head)  # one layer's, speed 1.0
    last = len(counts) - 1
    return [work * (n + (head if i == last else 0.0)) / f for i, (n, f) in enumerate(zip(counts, speeds, strict=True))]


def model_rate(setup: Setup, counts: list[int], speeds: list[float], head: float) -> float:
    """A split's 1F1B estimate of tokens/s: a step is sum(t_i) + (M - 1) x max(t_i), t_i a micro-batch on stage i."""
    m = micro_batches(setup, len(counts))
    per_micro = [b / m for b in busy_s(setup, counts, speeds, head)]
    return setup.tokens_per_step / (sum(per_micro) + (m - 1) * max(per_micro))


def best_split(setup: Setup, layers: int, speeds: tuple[float, ...], head: float) -> tuple[list[int], list[float]]:
    """The split and device order of highest 1F1B estimate (a brute force the planner's choice is judged by)."""
    splits = [
        (list(counts), list(order))
        for counts in itertools.product(range(1, layers), repeat=len(speeds))
        if sum(counts) == layers
        for order in set(itertools.permutations(speeds))
    ]
    # Rounded: orders of the same time differ in the last bits; then the faster devices first.
    return max(splits, key=lambda split: (round(model_rate(setup, split[0], split[1], head), 6), split[1]))


def _launch(name: str, job: dict[str, Any], ranks: int, out: Path) -> subprocess.Popen[str]:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # the worker appends to what it finds
    job_file = _write(job, out / f"{name}.yaml")
    # The hosts' launcher (train/launcher.py): torchrun, its ranks forked from one process that imported torch.
    torchrun = [sys.executable, "-m", "train.launcher", f"--nproc-per-node={ranks}", "--nnodes=1"]
    torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0"]
    worker = ["-m", "train.worker", "--job", str(job_file), "--run-dir", str(run_dir), "--code-dir", str(REPO)]
    return subprocess.Popen(
        [*torchrun, *worker, "--benchmark"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _ran(run_dir: Path) -> list[tuple[int, int, int]]:
    """(rank, first layer, last layer + 1) of every stage as the run's layout in run.json has it, first to last."""
    layout = Layout.from_dict(json.loads((run_dir / "run.json").read_text())["layout"])
    return [(s.rank, s.start, s.end) for s in layout.replicas[0].stages]


def train(
    name: str, setup: Setup, model: Path, counts: list[int], speeds: list[float], out: Path, head: float
) -> dict[str, Any]:
    """One run of the 3-stage pipeline; its tokens/s, and the stages as they ran."""
    split = " | ".join(f"{n} @ {f}" for n, f in zip(counts, speeds, strict=True))
    with console.status(f"{name}: layers @ device speed, stage by stage: {split}"):
        job = _pipeline_job(setup, model, counts, tuple(speeds))
        sequences_per_s = _rate(name, _launch(name, job, len(counts), out), setup, out)
    ran = _ran(out / name)
    expected, start = [], 0
    for rank, n in enumerate(counts):
        expected.append((rank, start, start + n))
        start += n
    if ran != expected:  # the trainer put the stages on other ranks than their emulated devices: the figures lie
        console.print(f"[red]bench-pipeline: {name} ran the stages as {ran}, expected {expected}[/red]")
        raise typer.Exit(1)
    tokens_per_s = sequences_per_s * setup.seq_len
    busy = busy_s(setup, counts, speeds, head)
    return {
        "counts": counts,
        "speeds": speeds,
        "stages_ran": ran,
        "tokens_per_s": tokens_per_s,
        "model_tokens_per_s": model_rate(setup, counts, speeds, head),
        "busy_s": busy,
        "step_s": setup.tokens_per_step / tokens_per_s,
        "bubble": 1 - max(busy) * tokens_per_s / setup.tokens_per_step,
    }


@app.command()
def run(
    factors: Annotated[str, typer.Option(help="Speed factor of each emulated device, fastest first.")] = "1.0,0.6,0.5",
    layers: Annotated[int, typer.Option(help="Decoder layers of the benchmark's tiny Llama.")] = 12,
    steps: Annotated[int, typer.Option(help="Optimizer steps per run.")] = 12,
    skip: Annotated[int, typer.Option(help="Steps left out of the measurement (start-up, warm-up).")] = 3,
    global_batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 48,
    micro_batch: Annotated[int, typer.Option(help="Largest micro-batch of a stage.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    scale: Annotated[
        float,
        typer.Option(
            help="Speed of the fastest emulated device relative to one core of this machine; 0 = chosen so that "
            "all ranks' real compute together keeps at most 30 % of the cores busy (as make bench)."
        ),
    ] = 0.0,
    out: Annotated[Path, typer.Option(help="Where the runs and results.json go.")] = REPO / "runs" / "bench-pipeline",
) -> None:
    """Emulated 1.0 / 0.6 / 0.5 devices as one 3-stage pipeline: planned vs equal layer split vs ideal."""
    speeds = tuple(float(f) for f in factors.split(","))
    if not 1 <= skip < steps or any(not 0 < f <= 1 for f in speeds) or not len(speeds) <= layers:
        console.print("[red]bench-pipeline: need 1 <= --skip < --steps, factors in (0, 1], --layers >= ranks[/red]")
        raise typer.Exit(2)
    if layers % len(speeds):
        console.print(f"[red]bench-pipeline: --layers must split equally over {len(speeds)} stages[/red]")
        raise typer.Exit(2)
    if scale <= 0:
        scale = min(1.0, 0.3 * (os.cpu_count() or 1) / sum(speeds))
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    model = _model(layers, out)
    setup = Setup(speeds, scale, 0.0, steps, skip, global_batch, micro_batch, seq_len)
    calibration = _calibrate(setup, model, out)
    setup = replace(setup, seconds_per_token=1.0 / (calibration * seq_len * scale))
    console.print(
        f"bare loop {calibration:.1f} sequences/s on one core ({layers} layers): the speed-1.0 device needs "
        f"{setup.seconds_per_token * 1e3:.3f} ms per token (x {scale:.2f} of a core)"
    )
    head = stageplan.ModelShape.from_dir(model).head_work
    planned = train("planned", setup, model, *planned_split(setup, model, speeds, out), out, head)
    equal = train("equal", setup, model, [layers // len(speeds)] * len(speeds), list(speeds), out, head)
    stages, m = len(speeds), micro_batches(setup, len(speeds))
    ideal = sum(speeds) / setup.seconds_per_token
    bound = ideal * m / (m + stages - 1)
    best = best_split(setup, layers, speeds, head)
    best_rate = model_rate(setup, *best, head)

    table = Table(
        title=f"make bench-pipeline: {stages} stages on emulated devices of speed {factors} (1.0 = {scale:.2f} of a "
        f"core); {layers} layers; global batch {global_batch} x {seq_len} tokens in {m} micro-batches a step"
    )
    for column in ("variant", "layers @ device speed, stage by stage", "tokens/s", "of ideal", "1F1B model", "bubble"):
        table.add_column(column, justify="left" if column.startswith(("variant", "layers")) else "right")

    def split_text(counts: list[int], devices: list[float]) -> str:
        return " | ".join(f"{n} @ {f}" for n, f in zip(counts, devices, strict=True))

    for name, what in (("planned (stageplan.plan)", planned), ("equal", equal)):
        table.add_row(
            name,
            split_text(what["counts"], what["speeds"]),
            f"{what['tokens_per_s']:.0f}",
            f"{what['tokens_per_s'] / ideal:.2f}",
            f"{what['model_tokens_per_s']:.0f}",
            f"{what['bubble']:.0%}",
        )
    table.add_row("best split for the emulation (model only)", split_text(*best), "", "", f"{best_rate:.0f}")
    table.add_row(f"1F1B bound: ideal x M/(M+S-1), {m}/{m + stages - 1}", "", f"{bound:.0f}", f"{bound / ideal:.2f}")
    table.add_row("ideal: sum(f) / seconds_per_token (no bubble)", "", f"{ideal:.0f}", "1.00", "", "0%")
    console.print(table)

    load = os.getloadavg()[0]
    figures = {
        "planned_tokens_per_s": round(planned["tokens_per_s"], 1),
        "equal_tokens_per_s": round(equal["tokens_per_s"], 1),
        "ideal_tokens_per_s": round(ideal, 1),
        "planned_over_equal": round(planned["tokens_per_s"] / equal["tokens_per_s"], 3),
        "planned_over_ideal": round(planned["tokens_per_s"] / ideal, 3),
        "bubble_planned": round(planned["bubble"], 3),
        "load": round(load, 2),
    }
    results = {
        **figures,
        "setup": asdict(setup),
        "layers": layers,
        "micro_batches": m,
        "calibration_sequences_per_s": calibration,
        "bound_1f1b_tokens_per_s": bound,
        "planned": planned,
        "equal": equal,
        "best_split_for_emulation": {"counts": best[0], "speeds": best[1], "model_tokens_per_s": best_rate},
        "seconds": round(time.monotonic() - began, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    console.print(f"runs and results.json in {out}; took {results['seconds']:.0f} s; load average {load:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    app()
