"""The ``ugro`` command, which the Makefile's targets call: it parses the options and prints; the work is elsewhere.

train, validate                    a job on the inventory's hosts (ugro/run/, ugro/checks/jobcheck.py)
plan                               which rank holds which layers: data parallel or pipeline stages (ugro/checks/plan.py)
preflight, doctor                  checks before a launch and after a failure (ugro/checks/)
status, logs, stop                 a running or finished job on its hosts (playbooks/)
export, chat                       use the run's model: merged, GGUF for llama.cpp / Ollama, a chat (ugro/model/)
dashboard, prometheus-config       watching the cluster (ugro/monitoring/)
slurm-script, k8s-manifest         the same job under a batch scheduler (ugro/schedulers/)

Runs go to runs/ of this repository, or to $UGRO_RUNS_DIR (a bigger disk; the tests' temporary directories):
the controller's records, collected logs and results, runs/latest and the playbooks' private directories.
Hosts that run this checkout itself (ugro_code_sync: false, inventory/local.yml) write their runs into its runs/.
"""

from __future__ import annotations

import datetime
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from train.config import ConfigError, JobConfig, load_job
from train.layout.stageplan import PlanError
from train.metrics import read_eval, read_metrics, read_samples, write_status
from ugro.checks import doctor, jobcheck, ranks
from ugro.checks import plan as stageplan
from ugro.checks import preflight as preflight_run
from ugro.checks.preflight_report import Thresholds
from ugro.checks.preflight_stack import lock_cuda
from ugro.hosts import codesync
from ugro.hosts.inventory import Cluster, InventoryError, read_cluster
from ugro.hosts.playbook import REPO, RUNS_ENV, PlaybookRun, run_playbook, runs_dir
from ugro.model.jsonfile import read_object
from ugro.module_utils import ugro_jobkey
from ugro.run import attach, phases, settings
from ugro.run.supervisor import LaunchError, Outcome, Supervisor
from ugro.schedulers import render as schedulers
from ugro.stack import cuda as stack

if TYPE_CHECKING:
    from ugro.checks.datafacts import Tokenized
    from ugro.model.gguf_export import GgufExport

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ugro: LoRA fine-tuning across the GPUs of a LAN.")
console = Console()
err = Console(stderr=True)

JobOpt = Annotated[Path, typer.Option("--job", help="job file (YAML)")]
InventoryOpt = Annotated[Path, typer.Option("--inventory", "-i", help="Ansible inventory of the cluster")]
JobIdOpt = Annotated[str | None, typer.Option(help="job id (default: runs/latest)")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="KEY=VALUE over the job file, e.g. optim.lr=1e-4 (repeatable)")
]
MinFreeOpt = Annotated[float, typer.Option(envvar="MIN_FREE_GB", help="GiB free needed on the main host")]
BusbwOpt = Annotated[float, typer.Option(envvar="BUSBW_FLOOR", help="all-reduce busbw floor, GB/s (WARN below)")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def _checked(job_file: Path) -> tuple[JobConfig, jobcheck.DataSummary]:
    """The job file and its data, checked before anything starts (an error names the file and line)."""
    try:
        job = load_job(job_file)
        return job, jobcheck.check_data(job, REPO)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _load(job_file: Path) -> JobConfig:
    return _checked(job_file)[0]


def _cluster(inventory: Path, missing: str = "inventory not found (the default is inventory/local.yml)") -> Cluster:
    """The inventory's cluster, or one error naming the file (``missing`` when there is none)."""
    if not inventory.is_file():
        raise _fail(f"{inventory}: {missing}")
    try:
        return read_cluster(inventory)
    except InventoryError as exc:
        raise _fail(str(exc)) from None


def _clock(epoch: object) -> str:
    """'14:05:09': an epoch time recorded in a run's files, on this machine's clock."""
    return time.strftime("%H:%M:%S", time.localtime(float(epoch or 0)))  # type: ignore[arg-type]


def _tokenized(job: JobConfig) -> Tokenized | None:
    """The job's training rows as the ranks will pack them (None without the tokenizer here); a job that cannot
    train on them is refused. (torch and the tokenizer are imported here, not for every command.)"""
    from ugro.checks import datafacts

    try:
        return datafacts.tokenized(job, REPO)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _set(job_file: Path, setting: list[str] | None) -> Path:
    """The job file to use: ``job_file``, or with SET= settings laid over it, their own (ugro/run/settings.py)."""
    if not setting:
        return job_file
    try:
        path, _ = settings.job_with(job_file, setting, REPO)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    shown = path.relative_to(REPO)
    console.print(f"[dim]{job_file} with {' '.join(setting)}: {shown}[/]", highlight=False)
    return shown if Path.cwd().resolve() == REPO.resolve() else path


def _prepare_model(job: JobConfig) -> None:
    """Convert the base model from its wheel where it comes from one, then check the LoRA targets against it."""
    _convert_model(job)
    _check_targets(job)


def _convert_model(job: JobConfig) -> None:
    """The base model converted from its wheel where it comes from one (once; its config.json sizes the plan)."""
    try:
        jobcheck.prepare_model(job, REPO, lambda line: console.print(f"[dim]{line}[/]", highlight=False))
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _check_targets(job: JobConfig) -> None:
    """The LoRA target modules against the base's structure (skipped where its config is not here yet)."""
    try:
        jobcheck.check_targets(job, REPO, cache=runs_dir() / ".control" / "targets")
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def _relative_to_repo(path: Path) -> str:
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(REPO))
    except ValueError:
        raise _fail(f"{path}: the job file must live inside the repository ({REPO}) so it can be synced") from None


def _pick_run(job: JobConfig, resume: str, runs: Path) -> str:
    """A new job id, or with --resume auto the newest earlier run of this job.

    Its checkpoints live on the main host, not necessarily here: the main rank there loads the
    newest intact one (or starts from step 0 and says so in its log).
    """
    if resume == "auto":
        candidates = sorted(p for p in runs.glob(f"{job.name}-*") if (p / ".control").is_dir())
        if candidates:
            return candidates[-1].name
        console.print(f"no earlier run of job '{job.name}' in {runs}: starting fresh")
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
    evals = read_eval(run_dir)
    base = next((r for r in evals if r.get("model") == "base"), None)
    tuned = evals[-1] if evals and evals[-1].get("model") != "base" else None
    if base and tuned:
        change = (tuned["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
        console.print(
            f"held-out loss {base['eval_loss']:.4f} (base model) -> {tuned['eval_loss']:.4f} "
            f"(fine-tuned, step {tuned['step']}): [bold]{change:+.1%}[/]"
        )
    samples = read_samples(run_dir)
    if samples:
        first = samples[0]
        console.print(f"[bold]held-out question:[/] {first['question']}", highlight=False)
        console.print(f"  [dim]base model:[/] {first['before']}", highlight=False)
        console.print(f"  [green]fine-tuned:[/] {first['after']}", highlight=False)
        console.print(f"  [dim]reference:[/]  {first['reference']}", highlight=False)
    console.print(f"[bold green]run finished:[/] {run_dir}")
    for name, what in [
        ("adapter", "LoRA adapter (peft save_pretrained)"),
        ("checkpoints", "resumable checkpoints"),
        ("metrics.jsonl", "per-step metrics"),
        ("tensorboard", "TensorBoard events"),
        ("logs", "one log per rank"),
        ("loss.png", "loss curve"),
        ("samples.md", "held-out answers, base model and fine-tuned"),
    ]:
        mark = "[green]ok[/]" if (run_dir / name).exists() else "[red]missing[/]"
        console.print(f"  {mark} {name:<14} {what}")


@app.command()
def validate(
    job_file: JobOpt = Path("jobs/default.yaml"),
    inventory: Annotated[
        Path | None, typer.Option("--inventory", "-i", help="also run make train's fast checks on its hosts")
    ] = None,
    setting: SetOpt = None,
    show: Annotated[int, typer.Option(min=0, help="print this many training rows, the trained tokens marked")] = 0,
) -> None:
    """Check a job file, print its cluster-wide hash, its data as the ranks will pack it (records, tokens, rows,
    padding, steps an epoch) and which backend it runs where; with an inventory, also what make train checks on
    its hosts first (the fast preflight, and the global batch against the ranks)."""
    job_file = _set(job_file, setting)
    job, data = _checked(job_file)
    _check_targets(job)  # a base still in its wheel is converted by make train, not here: nothing downloads
    held = f", {data.eval_records} held-out" if job.eval else ""
    console.print(
        f"{job_file}: ok (job '{job.name}', {data.train_records} training records{held}, "
        f"cluster-wide hash {job.cluster_hash()[:12]})"
    )
    found = _tokenized(job)
    if found is None:
        console.print("[dim]data: its rows and steps are counted once the base model is here (make train converts "
                      "it)[/]", highlight=False)  # fmt: skip
    else:
        console.print(found.facts.line(), highlight=False)
        from ugro.checks.datafacts import show as show_rows

        for text in show_rows(found, show):
            console.print(text, highlight=False)
    cuda, why = lock_cuda()
    if cuda is None:
        raise _fail(f"the node lock cannot be judged: {why}")
    console.print(f"backend: {stack.policy(job.model.backend, cuda)}", highlight=False)
    if inventory is not None:  # _preflight names a missing inventory
        planned = _fast_preflight(inventory, job, job_file).ranks
        console.print(f"{inventory}: ok, {ranks.describe(planned)} for a global batch of "
                      f"{job.train.global_batch_size}", highlight=False)  # fmt: skip


@app.command(name="plan")
def plan_cmd(
    job_file: JobOpt = Path("jobs/default.yaml"),
    inventory: InventoryOpt = Path("inventory/local.yml"),
    offline: Annotated[
        bool, typer.Option("--offline", help="from the inventory alone (profiles' memory_gib), without the hosts")
    ] = False,
    setting: SetOpt = None,
) -> None:
    """Show which rank holds which layers: data parallel where the model fits every rank, else pipeline stages
    sized to each host's memory and speed; exit 2 with the arithmetic when the model fits nowhere."""
    job_file = _set(job_file, setting)
    job = _load(job_file)
    _convert_model(job)
    cluster = _cluster(inventory)
    hosts, hostvars = cluster.hosts, cluster.hostvars
    facts: dict[str, dict[str, object]] | None = None
    found_ranks: dict[str, int] | None = None
    if not offline:
        try:
            outcome = preflight_run.preflight(inventory, runs_dir() / ".control" / "preflight", Thresholds())
            facts, found_ranks = outcome.facts, outcome.ranks
        except preflight_run.PreflightError as exc:
            console.print(f"[yellow]the hosts did not answer ({exc}): planning from the inventory alone[/]",
                          highlight=False)  # fmt: skip
        if facts is not None and set(facts) != set(hosts):
            missing = ", ".join(h for h in hosts if h not in facts)
            console.print(f"[yellow]no facts from {missing}: planning from the inventory alone[/]", highlight=False)
            facts, found_ranks = None, None
    try:
        memory = stageplan.hosts_memory(job, REPO, hosts, hostvars, facts, found_ranks)
        for host in memory:
            console.print(f"[dim]{host.line(job.data.seq_len)}[/]", highlight=False)
        for host in memory:
            console.print(f"[dim]{stageplan.whole_estimates(job, REPO, host)}[/]", highlight=False)
        layout = stageplan.plan_cluster(job, REPO, memory)
    except PlanError as exc:
        raise _fail(f"{job_file}: {exc}") from None
    table = Table(title=f"plan of {job_file} on {inventory}{' (offline)' if facts is None else ''}",
                  title_justify="left")  # fmt: skip
    for column in ("host", "replica", "stage", "layers", "micro-batch", "peak / memory", "busy"):
        table.add_column(column)
    for row in stageplan.rows(layout):
        table.add_row(*row)
    console.print(table)
    speed = sum(r.speed for r in layout.replicas)
    bubble = " (busy: the stage's share of the step time; the rest waits in the pipeline's bubble)"
    console.print(f"{layout.reason}; throughput ~{speed:.2f} x one rank holding the whole model"
                  f"{bubble if layout.pipelined else ''}", highlight=False)  # fmt: skip


def _launch_failed(run: PlaybookRun, what: str) -> typer.Exit:
    for host, message in run.failures.items():
        err.print(f"[bold red]{host}:[/] {message}", highlight=False)
    if not run.failures:
        err.print(f"ansible-playbook ended with status {run.runner.status if run.runner else 'unknown'}")
    return _fail(f"{what} failed", code=1)


def _latest_link(run_dir: Path) -> None:
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def _job_id(job_id: str | None) -> str:
    if job_id:
        return job_id
    link = runs_dir() / "latest"
    if not link.is_symlink():
        raise _fail("no job id given and runs/latest does not exist: pass --job-id (see runs/)")
    return os.readlink(link)


@app.command()
def train(
    job_file: JobOpt = Path("jobs/default.yaml"),
    inventory: InventoryOpt = Path("inventory/local.yml"),
    resume: Annotated[
        str, typer.Option(help="'auto' continues the newest run of this job from its last checkpoint")
    ] = "none",
    poll: Annotated[float, typer.Option(help="seconds between status polls of a remote cluster")] = 5.0,
    skip_preflight: Annotated[
        bool, typer.Option("--skip-preflight", envvar="SKIP_PREFLIGHT", help="launch even when a fast check FAILs")
    ] = False,
    setting: SetOpt = None,
) -> None:
    """Sync the code, launch the job on every host of the inventory, and follow it to the end."""
    timing = phases.Phases()
    timing.mark("controller start")
    if resume not in ("none", "auto"):
        raise _fail(f"--resume must be 'none' or 'auto', not '{resume}'")
    job_file = _set(job_file, setting)
    job = _load(job_file)
    cluster = _cluster(inventory)
    if job.train.min_hosts > len(cluster.hosts):
        raise _fail(f"{job_file}: train.min_hosts is {job.train.min_hosts} but {inventory} has only "
                    f"{len(cluster.hosts)} host(s) in ugro_cluster; lower train.min_hosts")  # fmt: skip
    runs = runs_dir()
    if not cluster.remote and runs != REPO / "runs":
        raise _fail(f"{RUNS_ENV}={runs}: the hosts of {inventory} run this checkout (ugro_code_sync: false) and "
                    f"keep their runs in {REPO / 'runs'}; unset {RUNS_ENV} for them")  # fmt: skip
    _prepare_model(job)
    job_id = _pick_run(job, resume, runs)
    launch = {"ugro_job_id": job_id, "ugro_job_file": _relative_to_repo(job_file)}
    checked = None if skip_preflight else _fast_preflight(inventory, job, job_file, launch)
    planned = checked.ranks if checked else {}
    timing.mark("preflight")
    run_dir = runs / job_id
    control = run_dir / ".control"
    code_hash = codesync.pack(REPO, control / "code.tar.gz")
    timing.mark("code archive")
    ugro_jobkey.controller_key(run_dir)  # made at the first launch, the same at every relaunch
    extravars = launch | {
        "ugro_job_key_file": str(run_dir / ugro_jobkey.FILE),
        "ugro_code_archive": str(control / "code.tar.gz"),
        "ugro_code_hash": code_hash,
        "ugro_model_dirs": jobcheck.model_dirs(job, REPO),
        # What the fast checks just read on each host, for the first launch not to ask it again.
        "ugro_known_facts": preflight_run.launch_facts(checked, code_hash) if checked else {},
    }
    length = f"{job.train.max_steps} steps"
    if job.train.epochs is not None:  # the steps come from the rows: counted here as the ranks will
        found = _tokenized(job)
        length = (f"{found.facts.steps} steps ({job.train.epochs:g} epochs of {found.facts.rows} rows)" if found
                  else f"{job.train.epochs:g} epochs")  # fmt: skip
    console.print(
        f"job [bold]{job_id}[/] on {inventory}: {length}, global batch "
        f"{job.train.global_batch_size}{' over ' + ranks.describe(planned) if planned else ''}, "
        f"model {job.model.source}, code {code_hash[:12]}"
    )
    poll_s = poll if cluster.remote else 1.0
    attach.Launch(str(job_file.resolve()), str(inventory.resolve()), extravars, poll_s).write(run_dir)
    supervisor = Supervisor(job, cluster, inventory, run_dir, extravars, console, poll_s,
                            on_task=lambda name: console.print(f"[dim]- {name}[/]", highlight=False))  # fmt: skip
    try:
        with attach.following(run_dir):
            outcome = supervisor.run(resume == "auto", on_started=lambda: _latest_link(run_dir))
    except LaunchError as exc:
        if resume == "none" and not (run_dir / "hosts").exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing started: leave no empty run behind
        raise _launch_failed(exc.run, "launch") from None
    except KeyboardInterrupt:
        raise _detached(job_id) from None
    _conclude(outcome, inventory, run_dir)
    # The first main rank's, as a poll saw them, else as collected with the logs.
    ranks_phases = supervisor.ranks_phases or read_object(run_dir / "run.json").get("phases")
    seconds = timing.seconds(supervisor.first_launch, ranks_phases if isinstance(ranks_phases, dict) else None)
    write_status(run_dir, launch_phases=seconds)
    console.print(f"[dim]to the first step: {phases.line(seconds)}[/]", highlight=False)
    _report(outcome, run_dir)


@app.command()
def follow(
    job_id: JobIdOpt = None,
    poll: Annotated[float | None, typer.Option(help="seconds between status polls (default: the launch's)")] = None,
) -> None:
    """Follow a running job again (after Ctrl-C, a closed terminal or a controller that died): its progress and
    faults, and what only a controller does: relaunching after a fault, copying checkpoints and results here."""
    job_id = _job_id(job_id)
    run_dir = runs_dir() / job_id
    launch = attach.Launch.read(run_dir)
    if launch is None:
        raise _fail(f"{run_dir}: no launch record (.control/launch.json): `make follow` takes up runs that "
                    "`make train` launched from this checkout")  # fmt: skip
    live = attach.follower(run_dir)
    if live is not None:
        since = _clock(live.get("since"))
        raise _fail(f"job {job_id} is followed already: process {live.get('pid')} on {live.get('machine')} since "
                    f"{since}; end that one (Ctrl-C) or follow from there")  # fmt: skip
    job = _load(Path(launch.job_file))
    inventory = Path(launch.inventory)
    cluster = _cluster(inventory, f"the run's inventory is gone; put it back to follow job {job_id}")
    left = attach.Supervision.read(run_dir) or attach.Supervision(list(cluster.hosts), cluster.main_host, [], [])
    console.print(f"following job [bold]{job_id}[/] on {', '.join(left.hosts)} (main host {left.main}); "
                  f"{len(left.restarts)} restart(s) so far", highlight=False)  # fmt: skip
    for restart in left.restarts:
        console.print(f"[yellow]{escape(restart.line())}[/]", highlight=False)
    supervisor = Supervisor(job, cluster, inventory, run_dir, launch.extravars, console, poll or launch.poll_s)
    try:
        with attach.following(run_dir):
            outcome = supervisor.run(False, attached=left)
    except KeyboardInterrupt:
        raise _detached(job_id) from None
    _conclude(outcome, inventory, run_dir)
    _report(outcome, run_dir)


def _detached(job_id: str) -> typer.Exit:
    """Ctrl-C while following: the hosts go on; say how to take the run up again."""
    console.print(f"\ndetached: job {job_id} keeps running on its hosts; `make follow JOB_ID={job_id}` follows it "
                  "again (and relaunches after a fault), `make status`, `make stop`", highlight=False)  # fmt: skip
    return typer.Exit(130)


def _conclude(outcome: Outcome, inventory: Path, run_dir: Path) -> None:
    """The run ended: its logs and results from every host it ended on, and the controller's record."""
    collect = {"ugro_job_id": run_dir.name, "ugro_main_host": outcome.main, "ugro_runs_dir": str(runs_dir())}
    run_playbook("logs.yml", inventory, collect, run_dir / ".control" / "ansible", limit=outcome.hosts)
    outcome.record().write(run_dir)


def _report(outcome: Outcome, run_dir: Path) -> None:
    """Every restart, and the cause of a run that did not finish (exit 1), else the run's summary."""
    for restart in outcome.restarts:
        console.print(f"[yellow]{escape(restart.line())}[/]", highlight=False)
    if outcome.state != "finished":
        for host, state in outcome.statuses.items():
            code = f" (exit code {state['exit_code']})" if state.get("exit_code") is not None else ""
            err.print(f"[bold red]{host}:[/] {state.get('state')}{code}", highlight=False)
        cause_line = (
            outcome.cause.line()
            if outcome.cause
            else next((s["error"] for s in outcome.statuses.values() if s.get("error")), None)
        )
        if cause_line:
            err.print(f"[bold red]cause:[/] {cause_line}", highlight=False)
        raise _fail(f"the run {outcome.state}; logs are in {run_dir / 'logs'} (`make doctor` explains)", code=1)
    _summary(run_dir)


def _preflight(
    inventory: Path,
    thresholds: Thresholds,
    job_file: str | None,
    heavy: bool,
    backend: str,
    launch: dict[str, str] | None = None,
) -> preflight_run.Outcome:
    if not inventory.is_file():
        raise _fail(f"{inventory}: inventory not found (the default is inventory/local.yml)")
    control = runs_dir() / ".control" / "preflight"
    try:
        return preflight_run.preflight(inventory, control, thresholds, job_file, heavy, backend, launch)
    except preflight_run.PreflightError as exc:
        raise _fail(f"preflight could not run on {inventory}: {exc}") from None


def _plan_before_launch(
    inventory: Path, job: JobConfig, job_file: Path, facts: dict[str, dict[str, object]], found_ranks: dict[str, int]
) -> None:
    """Refuse a model the hosts cannot hold, with the planner's arithmetic, before anything starts; show the
    stages when the model needs them. Where the controller cannot know (a hub model, a host without facts),
    the ranks plan at the start from what they measure."""
    try:
        cluster = read_cluster(inventory)
        hosts, hostvars = cluster.hosts, cluster.hostvars
        stageplan.read_shape(job, REPO)
        memory = stageplan.hosts_memory(job, REPO, hosts, hostvars, facts, found_ranks)
    except (InventoryError, PlanError) as exc:
        console.print(f"[dim]plan: left to the ranks ({exc})[/]", highlight=False)
        return
    try:
        layout = stageplan.plan_cluster(job, REPO, memory)
    except PlanError as exc:
        raise _fail(f"{job_file}: {exc}", code=2) from None
    caps = {h.host: h.rank_local.cap(job.data.seq_len) for h in memory}
    smaller = any(0 < s.micro < caps[s.host] for r in layout.replicas for s in r.stages)
    if layout.pipelined:
        console.print(f"[dim]plan: {layout.describe()} ({layout.reason}; make plan shows it all)[/]", highlight=False)
    elif smaller:
        console.print(f"[dim]plan: {layout.reason} (make plan shows it all)[/]", highlight=False)


def _fast_preflight(
    inventory: Path, job: JobConfig, job_file: Path, launch: dict[str, str] | None = None
) -> preflight_run.Outcome:
    """The fast checks before a launch: refuse on a FAIL, a backend a host cannot run or a global batch smaller
    than the ranks the inventory starts; show WARNs. With ``launch`` (the run about to start), the facts they read
    also answer the launch's own questions."""
    backend = job.model.backend
    outcome = _preflight(inventory, Thresholds(), None, heavy=False, backend=backend, launch=launch)
    unable = preflight_run.backend_problems(outcome.facts, backend)
    if unable:
        for line in unable:
            err.print(f"[bold red]{line}[/]", highlight=False)
        raise _fail("not launching: use model.backend 'auto' (unsloth where it can run) or 'hf'", code=2)
    problem = ranks.batch_problem(job, job_file, inventory, outcome.ranks)
    if problem:
        raise _fail(problem, code=2)
    _plan_before_launch(inventory, job, job_file, outcome.facts, outcome.ranks)
    report = outcome.report
    line = f"preflight: {preflight_run.summary(report)} in {outcome.seconds['fast']:.1f} s"
    if report.failed():
        preflight_run.render(report, err, "preflight (fast checks)")
        raise _fail(f"{line}; not launching. Fix the FAILs, or launch anyway with --skip-preflight "
                    "(make train SKIP_PREFLIGHT=1)", code=1)  # fmt: skip
    console.print(f"[dim]{line}[/]", highlight=False)
    for name, host, cell in report.problems():
        if name != "gpu":  # a CPU host is not news on every launch
            console.print(f"[yellow]WARN[/] {name} @ {host}: {cell.cause}", highlight=False)
    return outcome


@app.command(name="preflight")
def preflight_cmd(
    job_file: JobOpt = Path("jobs/default.yaml"),
    inventory: InventoryOpt = Path("inventory/local.yml"),
    fast: Annotated[bool, typer.Option("--fast", help="only the fast checks (what make train runs)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    min_free_gb: MinFreeOpt = 2.0,
    busbw_floor: BusbwOpt = 0.05,
) -> None:
    """Check every host before a launch: versions, names, ports, interfaces, all-reduce, memory."""
    job = _load(job_file)
    _prepare_model(job)
    thresholds = Thresholds(min_free_gb=min_free_gb, busbw_floor_gbps=busbw_floor)
    outcome = _preflight(inventory, thresholds, _relative_to_repo(job_file), heavy=not fast, backend=job.model.backend)
    if as_json:
        print(outcome.report.to_json())
    else:
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in outcome.seconds.items())
        preflight_run.render(outcome.report, console, f"preflight of {inventory} ({timing})")
        console.print(preflight_run.summary(outcome.report))
    if outcome.report.failed():
        raise typer.Exit(1)


@app.command(name="doctor")
def doctor_cmd(
    job_id: JobIdOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="a run directory (default: runs/<job-id>)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the findings as JSON")] = False,
) -> None:
    """Explain a run's failure from its collected logs: host, cause and fix for each known failure."""
    directory = run_dir if run_dir is not None else runs_dir() / _job_id(job_id)
    if not directory.is_dir():
        raise _fail(f"{directory}: no such run directory (see runs/, or `make logs` to collect one)")
    findings = doctor.diagnose(directory)
    if as_json:
        print(doctor.to_json(directory, findings))
    else:
        doctor.render(directory, findings, console)
    if findings:
        raise typer.Exit(1)


@app.command(name="export")
def export_cmd(
    job_id: JobIdOpt = None,
    out: Annotated[Path | None, typer.Option(help="merged model directory (default: runs/<job-id>/merged)")] = None,
    fmt: Annotated[str, typer.Option("--format", help="merged (safetensors) | gguf (llama.cpp, Ollama)")] = "merged",
    quant: Annotated[str, typer.Option(help="GGUF types, comma-separated (f16, q8_0, q4_k_m, f32, bf16, q5_k_m)")] = (
        "f16,q8_0,q4_k_m"
    ),
    job: Annotated[Path | None, typer.Option("--job", help="the job file, for a run that did not record it")] = None,
    questions: Annotated[int | None, typer.Option(min=1, help="GGUF: ask only the first N held-out questions")] = None,
) -> None:
    """The run's model: merged into its base (safetensors), or as GGUF files with an Ollama Modelfile, each with a
    model card."""
    from ugro.model import card, gguf_export, merge
    from ugro.model.basemodel import ModelError

    if fmt not in ("merged", "gguf"):
        raise _fail(f"FORMAT={fmt}: choose merged (safetensors, the default) or gguf (llama.cpp and Ollama)")
    try:
        types = gguf_export.parse_types(quant)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    run_dir = runs_dir() / _job_id(job_id)
    adapter = run_dir / "adapter"
    if not adapter.is_dir():
        raise _fail(f"{adapter}: no adapter here (did the run finish? `make logs JOB_ID=...` collects it)")
    try:
        if fmt == "gguf":
            job_config = _load(job) if job else None
            result = gguf_export.export(run_dir, REPO, types, job_config, log=console.print, questions=questions)
        else:
            target = out or run_dir / "merged"
            merged = merge.export(adapter, target, REPO)
            card.write_card(target, run_dir, REPO, artifact="merged", files=merge.listing(target))
    except (ConfigError, ModelError) as exc:
        raise _fail(str(exc)) from None
    if fmt == "merged":
        console.print(
            f"merged model in {merged.out}: logits equal base + adapter (max difference "
            f"{merged.max_diff_vs_adapter:.1e}), differ from the base (max {merged.max_diff_vs_base:.2f}); "
            f"model card {merged.out / 'README.md'}"
        )
        return
    _print_gguf(result)
    if not result.passed:
        raise _fail(f"a GGUF file does not hold the fine-tuned model (see {result.out / 'check.json'})", 1)


def _print_gguf(result: GgufExport) -> None:
    table = Table(title=f"GGUF files in {result.out} (held-out loss of the merged model: {result.reference_loss:.4f})")
    for column in ("type", "MB", "held-out loss", "vs merged", "answers identical", "first tokens agree", "passed"):
        table.add_column(column)
    for r in result.reports:
        a = r.answers
        passed = "yes" if r.passed else "[red]NO[/]"
        table.add_row(r.kind, f"{r.size_mb:.0f}", f"{r.loss:.4f}", f"{r.loss_rel_diff:+.2%}",
                      f"{a.identical}/{a.questions}", str(a.same_tokens_min), passed)  # fmt: skip
    console.print(table)
    if result.modelfile is not None:
        console.print(f"Ollama: ollama create NAME -f {result.modelfile}; ollama run NAME")
    else:
        console.print(f"[yellow]no Modelfile:[/] {result.modelfile_note}")
    console.print(f"model card: {result.out / 'README.md'}")


@app.command()
def chat(
    job_id: JobIdOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="the longest answer, in tokens")] = 256,
    system: Annotated[str | None, typer.Option(help="a system message to start every conversation with")] = None,
) -> None:
    """Talk to a run's fine-tuned model in the terminal (its chat template, streamed); /base, /tuned, /reset, /quit."""
    from ugro.model import chat as chat_session

    run_dir = runs_dir() / _job_id(job_id)
    try:
        raise typer.Exit(chat_session.chat(run_dir, REPO, max_new_tokens=max_new_tokens, system=system))
    except ConfigError as exc:
        raise _fail(str(exc)) from None


@app.command()
def status(
    inventory: InventoryOpt = Path("inventory/local.yml"),
    job_id: JobIdOpt = None,
    run_dir: Annotated[Path | None, typer.Option(help="a SLURM run's directory (shared filesystem)")] = None,
) -> None:
    """Per host: running / finished / failed / stopped, step, last loss, process ids."""
    if run_dir is not None or (runs_dir() / _job_id(job_id) / "slurm").is_dir():
        # A SLURM run (`ugro slurm-script`): read from its directory, no inventory (ugro/schedulers/render.py).
        raise typer.Exit(schedulers.status(run_dir or runs_dir() / _job_id(job_id), console))
    job_id = _job_id(job_id)
    run = run_playbook("status.yml", inventory, {"ugro_job_id": job_id}, runs_dir() / ".control" / "status")
    table = Table(title=f"job {job_id}")
    for column in ("host", "state", "step", "loss", "tokens/s", "computes", "pids"):
        table.add_column(column)
    for host in run.hosts:
        s = run.facts.get(host, {}).get("train_job_status", {})
        state = s.get("state") or ("unreachable" if host in run.failures else "?")
        step = f"{s['step']}/{s['total_steps']}" if "step" in s else ""
        computes = "; ".join(f"rank {r}: {part}" for r, part in s.get("parts", {}).items())
        table.add_row(host, state, step, f"{s['loss']:.4f}" if "loss" in s else "",
                      f"{s['tokens_per_s']:.0f}" if "tokens_per_s" in s else "", computes,
                      " ".join(str(p) for p in s.get("pids", {}).values()))  # fmt: skip
    console.print(table)
    _follower_line(runs_dir() / job_id)
    for host, message in run.failures.items():
        err.print(f"[bold red]{host}:[/] {message}", highlight=False)
    if run.failures:
        raise typer.Exit(1)


def _follower_line(run_dir: Path) -> None:
    """Whether a controller follows the run (and so relaunches it after a fault), for a run `make train` launched."""
    if attach.Launch.read(run_dir) is None:
        return
    live = attach.follower(run_dir)
    if live is not None:
        since = _clock(live.get("since"))
        console.print(f"followed by the controller: process {live.get('pid')} on {live.get('machine')} since {since}",
                      highlight=False)  # fmt: skip
        return
    state = str(read_object(run_dir / "run.json").get("state") or "")
    if state in ("finished", "failed", "stopped") and (run_dir / "logs").is_dir():
        return  # over, and its results collected
    console.print(f"[yellow]no controller follows this run[/]: a fault now waits for one; `make follow "
                  f"JOB_ID={run_dir.name}` takes it up", highlight=False)  # fmt: skip


@app.command()
def stop(
    inventory: InventoryOpt = Path("inventory/local.yml"),
    job_id: JobIdOpt = None,
) -> None:
    """Stop the job's own processes on every host (recorded process group and pids) and confirm."""
    job_id = _job_id(job_id)
    run = run_playbook("stop.yml", inventory, {"ugro_job_id": job_id}, runs_dir() / ".control" / "stop")
    if not run.ok:
        raise _launch_failed(run, "stop")
    console.print(f"job {job_id}: no process of it is left on {', '.join(run.hosts)}")


@app.command()
def logs(
    inventory: InventoryOpt = Path("inventory/local.yml"),
    job_id: JobIdOpt = None,
) -> None:
    """Collect every host's logs (and the main host's results) into runs/<job-id>/."""
    job_id = _job_id(job_id)
    run_dir = runs_dir() / job_id
    collect = {"ugro_job_id": job_id, "ugro_runs_dir": str(runs_dir())}
    run = run_playbook("logs.yml", inventory, collect, run_dir / ".control" / "ansible")
    if not run.ok:
        raise _launch_failed(run, "collecting logs")
    _latest_link(run_dir)
    console.print(f"logs of {', '.join(run.hosts)} in {run_dir / 'logs'} (runs/latest -> {job_id})")


@app.command()
def dashboard(
    inventory: InventoryOpt = Path("inventory/local.yml"),
    interval: Annotated[float, typer.Option(help="seconds between polls of the exporters")] = 2.0,
) -> None:
    """Live view of every node's exporter: GPUs or CPU, the job's progress, loss, per-rank balance; q quits."""
    from ugro.monitoring import dashboard as dash
    from ugro.monitoring.monitor import MonitorError

    try:
        dash.run(inventory, interval)
    except MonitorError as exc:
        raise _fail(str(exc)) from None


@app.command(name="prometheus-config")
def prometheus_config_cmd(
    inventory: InventoryOpt = Path("inventory/local.yml"),
    out: Annotated[Path, typer.Option(help="where to write it")] = Path("runs/monitoring/prometheus.yml"),
    scrape_interval: Annotated[str, typer.Option(help="Prometheus scrape interval")] = "15s",
) -> None:
    """A Prometheus scrape configuration: every node's exporter, and node_exporter where the inventory sets one."""
    from ugro.monitoring.monitor import MonitorError, render_prometheus_config

    try:
        text = render_prometheus_config(inventory, scrape_interval)
    except MonitorError as exc:
        raise _fail(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"{out}: scrape configuration of {inventory} (prometheus --config.file={out}); Grafana: import "
                  f"{REPO / 'ugro' / 'monitoring' / 'grafana-dashboard.json'}", highlight=False)  # fmt: skip


# The same job under a batch scheduler (ugro/schedulers/render.py): an sbatch script, a Kubernetes manifest.
app.command(name="slurm-script")(schedulers.slurm_script)
app.command(name="k8s-manifest")(schedulers.k8s_manifest)
# The names these had before "export" came to mean the model only; kept for users' scripts.
app.command(name="export-slurm", hidden=True)(schedulers.slurm_script)
app.command(name="export-k8s", hidden=True)(schedulers.k8s_manifest)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
