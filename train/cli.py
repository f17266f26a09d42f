"""The controller: ``python -m train.cli train|validate``. The Makefile targets call this.

It validates the job before anything starts, runs the launch playbook through ansible-runner,
follows the run's progress, and says where the results are.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from train.config import ConfigError, JobConfig, load_job
from train.follow import follow
from train.launcher import REPO, start_playbook
from train.metrics import STATUS, read_metrics

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ugro: LoRA fine-tuning across the GPUs of a LAN.")
console = Console()
err = Console(stderr=True)

JobOpt = Annotated[Path, typer.Option("--job", help="job file (YAML)")]
InventoryOpt = Annotated[Path, typer.Option("--inventory", "-i", help="Ansible inventory of the cluster")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def _load(job_file: Path) -> JobConfig:
    try:
        return load_job(job_file)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _relative_to_repo(path: Path) -> str:
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(REPO))
    except ValueError:
        raise _fail(f"{path}: the job file must live inside the repository ({REPO}) so it can be synced") from None


def _pick_run(job: JobConfig, resume: str, runs: Path) -> str:
    """A new job id, or with --resume auto the newest earlier run of this job that has a checkpoint."""
    if resume == "auto":
        candidates = sorted(p for p in runs.glob(f"{job.name}-*") if (p / "checkpoints").is_dir())
        if candidates:
            return candidates[-1].name
        console.print(f"no earlier run of job '{job.name}' with checkpoints in {runs}: starting fresh")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{job.name}-{stamp}"


def _summary(run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    if rows:
        first, last = rows[0], rows[-1]
        console.print(
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']}), "
            f"{last['tokens_per_s']:.0f} tokens/s"
        )
    console.print(f"[bold green]run finished:[/] {run_dir}")
    for name, what in [
        ("adapter", "LoRA adapter (peft save_pretrained)"),
        ("checkpoints", "resumable checkpoints"),
        ("metrics.jsonl", "per-step metrics"),
        ("tensorboard", "TensorBoard events"),
        ("logs", "one log per rank"),
        ("loss.png", "loss curve"),
    ]:
        mark = "[green]ok[/]" if (run_dir / name).exists() else "[red]missing[/]"
        console.print(f"  {mark} {name:<14} {what}")


@app.command()
def validate(job_file: JobOpt = Path("jobs/default.yaml")) -> None:
    """Check a job file and print its cluster-wide hash."""
    job = _load(job_file)
    console.print(f"{job_file}: ok (job '{job.name}', cluster-wide hash {job.cluster_hash()[:12]})")


@app.command()
def train(
    job_file: JobOpt = Path("jobs/default.yaml"),
    inventory: InventoryOpt = Path("inventory/local.yml"),
    resume: Annotated[
        str, typer.Option(help="'auto' continues the newest run of this job from its last checkpoint")
    ] = "none",
) -> None:
    """Launch the job on every host of the inventory and follow it to the end."""
    if resume not in ("none", "auto"):
        raise _fail(f"--resume must be 'none' or 'auto', not '{resume}'")
    job = _load(job_file)
    if not inventory.is_file():
        raise _fail(f"{inventory}: inventory not found (the default is inventory/local.yml)")
    runs = REPO / "runs"
    job_id = _pick_run(job, resume, runs)
    run_dir = runs / job_id
    extravars = {"ugro_job_id": job_id, "ugro_job_file": _relative_to_repo(job_file), "ugro_resume": resume}
    console.print(
        f"job [bold]{job_id}[/] on {inventory}: {job.train.max_steps} steps, "
        f"global batch {job.train.global_batch_size}, model {job.model.source}"
    )
    run = start_playbook(
        "train.yml",
        inventory,
        extravars,
        run_dir / "ansible",
        on_task=lambda name: console.print(f"[dim]- {name}[/]", highlight=False),
    )
    try:
        follow(run, run_dir, console)
        run.wait()
    except KeyboardInterrupt:
        run.cancel()
        run.wait(10)
        console.print(f"\ndetached: the job keeps running on its hosts; results will be in {run_dir}")
        raise typer.Exit(130) from None
    if not run.ok:
        status = json.loads((run_dir / STATUS).read_text()) if (run_dir / STATUS).is_file() else {}
        for host, message in run.failures.items():
            err.print(f"[bold red]{host}:[/] {message}", highlight=False)
        if status.get("error"):
            err.print(f"[bold red]cause:[/] {status['error']}", highlight=False)
        raise _fail(f"the run failed; logs are in {run_dir / 'logs'} and {run_dir / 'hosts'}", code=1)
    _summary(run_dir)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
