"""What every command shares: the consoles, the options several commands take, one error line and its exit code,
and the job file, inventory and job id as the commands read them (an error names the file and how to fix it)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from train.config import ConfigError, JobConfig, load_job
from ugro.checks import jobcheck
from ugro.checks.preflight import render
from ugro.checks.prelaunch import ChecksFailed
from ugro.hosts.inventory import Cluster, InventoryError, read_cluster
from ugro.hosts.playbook import REPO, PlaybookRun, runs_dir
from ugro.run import settings
from ugro.run.launch import Refused

if TYPE_CHECKING:
    from ugro.checks.datafacts import Tokenized

# soft_wrap: a line longer than the console stays whole (a terminal wraps it for the eye, a pipe or a log keeps it on
# one line); rich would otherwise cut a path, a command or a key in the middle at its width (80 where not a terminal).
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

JobOpt = Annotated[Path, typer.Option("--job", help="job file (YAML)")]
InventoryOpt = Annotated[Path, typer.Option("--inventory", "-i", help="Ansible inventory of the cluster")]
JobIdOpt = Annotated[str | None, typer.Option(help="job id (default: runs/latest)")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="KEY=VALUE over the job file, e.g. optim.lr=1e-4 (repeatable)")
]
MapOpt = Annotated[
    Path, typer.Option("--profile-map", help="which memory profile a node gets (GPU type / node feature -> profile)")
]
DEFAULT_JOB = Path("jobs/default.yaml")
DEFAULT_INVENTORY = Path("inventory/local.yml")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line; the exit to raise."""
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def refused(refusal: Refused) -> typer.Exit:
    """A launch refused (ugro/run/launch.py, ugro/checks/prelaunch.py): the fast checks' report where they FAILed,
    its lines, then its error."""
    if isinstance(refusal, ChecksFailed):
        render(refusal.report, err, "preflight (fast checks)")
    for line in refusal.lines:
        err.print(f"[bold red]{line}[/]", highlight=False)
    return fail(refusal.message, refusal.code)


def say(text: str) -> None:
    """A line with paths and commands to copy: never wrapped."""
    console.print(text, highlight=False)


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def dim(text: str) -> None:
    console.print(f"[dim]{text}[/]", highlight=False)


def warn(line: str) -> None:
    """One warning line, taken as it is (no markup), never wrapped: a tracker that cannot be reached, say."""
    err.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False)


def checked(job_file: Path) -> tuple[JobConfig, jobcheck.DataSummary]:
    """The job file and its data, checked before anything starts (an error names the file and line)."""
    try:
        job = load_job(job_file)
        return job, jobcheck.check_data(job, REPO)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def load(job_file: Path) -> JobConfig:
    return checked(job_file)[0]


def cluster(inventory: Path, missing: str = "inventory not found (the default is inventory/local.yml)") -> Cluster:
    """The inventory's cluster, or one error naming the file (``missing`` when there is none)."""
    if not inventory.is_file():
        raise fail(f"{inventory}: {missing}")
    try:
        return read_cluster(inventory)
    except InventoryError as exc:
        raise fail(str(exc)) from None


def clock(epoch: object) -> str:
    """'14:05:09': an epoch time recorded in a run's files, on this machine's clock."""
    return time.strftime("%H:%M:%S", time.localtime(float(epoch or 0)))  # type: ignore[arg-type]


def tokenized(job: JobConfig) -> Tokenized | None:
    """The job's training rows as the ranks will pack them (None without the tokenizer here); a job that cannot
    train on them is refused. (torch and the tokenizer are imported here, not for every command.)"""
    from ugro.checks import datafacts

    try:
        return datafacts.tokenized(job, REPO)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def with_settings(job_file: Path, setting: list[str] | None) -> Path:
    """The job file to use: ``job_file``, or with SET= settings laid over it, their own (ugro/run/settings.py)."""
    if not setting:
        return job_file
    try:
        path, _ = settings.job_with(job_file, setting, REPO)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    shown = path.relative_to(REPO)
    dim(escape(f"{job_file} with {' '.join(setting)}: {shown}"))  # [mlflow] is a value, not markup
    return shown if Path.cwd().resolve() == REPO.resolve() else path


def convert_model(job: JobConfig) -> None:
    """The base model converted from its wheel where it comes from one (once; its config.json sizes the plan)."""
    try:
        jobcheck.prepare_model(job, REPO, dim)
    except ConfigError as exc:
        raise fail(str(exc)) from None


def check_targets(job: JobConfig) -> None:
    """The LoRA target modules against the base's structure (skipped where its config is not here yet)."""
    try:
        jobcheck.check_targets(job, REPO, cache=runs_dir() / ".control" / "targets")
    except ConfigError as exc:
        raise fail(str(exc)) from None


def job_id_or_latest(job_id: str | None) -> str:
    """``job_id``, or the run runs/latest points at."""
    if job_id:
        return job_id
    link = runs_dir() / "latest"
    if not link.is_symlink():
        raise fail("no job id given and runs/latest does not exist: pass --job-id (see runs/)")
    return os.readlink(link)


def playbook_failed(run: PlaybookRun, what: str) -> typer.Exit:
    """A playbook that failed: each host's message, then the error (exit 1)."""
    for host, message in run.failures.items():
        err.print(f"[bold red]{host}:[/] {message}", highlight=False)
    if not run.failures:
        err.print(f"ansible-playbook ended with status {run.runner.status if run.runner else 'unknown'}")
    return fail(f"{what} failed", code=1)
