"""`ugro train`: launch a job on every host of the inventory and follow it to its end. The checks before it are
ugro/checks/prelaunch.py's, the launch and its end ugro/run/launch.py's; this module parses and prints."""

from __future__ import annotations

from typing import Annotated

import typer

from train.config import JobConfig
from train.metrics import write_status
from ugro.checks import prelaunch, ranks
from ugro.commands import ending
from ugro.commands import eval as evaluation
from ugro.commands.common import (
    DEFAULT_INVENTORY,
    DEFAULT_JOB,
    InventoryOpt,
    JobOpt,
    SetOpt,
    cluster,
    console,
    dim,
    fail,
    load,
    playbook_failed,
    refused,
    tokenized,
    warn,
    with_settings,
)
from ugro.commands.preflight import show_fast
from ugro.hosts.playbook import REPO
from ugro.model.jsonfile import read_object
from ugro.run import launch, phases
from ugro.run.supervisor import LaunchError, Supervisor
from ugro.tracking.feed import Feed


def _length(job: JobConfig) -> str:
    """'30 steps', or where the steps come from the rows, counted here as the ranks will: '12 steps (2 epochs of
    48 rows)'."""
    if job.train.epochs is None:
        return f"{job.train.max_steps} steps"
    found = tokenized(job)
    if found is None:
        return f"{job.train.epochs:g} epochs"
    if job.train.method != "sft":  # epochs of pairs (kto: examples), each two rows (ugro/checks/datafacts.py)
        what = "examples" if job.train.method == "kto" else "pairs"
        return f"{found.facts.steps} steps ({job.train.epochs:g} epochs of {getattr(found.facts, 'items', '?')} {what})"
    return f"{found.facts.steps} steps ({job.train.epochs:g} epochs of {found.facts.rows} rows)"


def train(
    job_file: JobOpt = DEFAULT_JOB,
    inventory: InventoryOpt = DEFAULT_INVENTORY,
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
        raise fail(f"--resume must be 'none' or 'auto', not '{resume}'")
    job_file = with_settings(job_file, setting)
    job = load(job_file)
    hosts = cluster(inventory)
    try:
        ready = prelaunch.ready(prelaunch.Request(job, job_file, inventory, hosts, resume, skip_preflight), dim)
    except launch.Refused as exc:
        raise refused(exc) from None
    if ready.fresh_note:
        console.print(ready.fresh_note)
    if ready.fast:
        show_fast(ready.fast)
    timing.mark("preflight")
    prepared = launch.prepare(ready.runs / ready.job_id, ready.launch_vars, ready.model_dirs, ready.checked)
    timing.mark("code archive")
    planned = ready.fast.outcome.ranks if ready.fast else {}
    console.print(
        f"job [bold]{ready.job_id}[/] on {inventory}: {_length(job)}, global batch "
        f"{job.train.global_batch_size}{' over ' + ranks.describe(planned) if planned else ''}, "
        f"model {job.model.source}, code {prepared.code_hash[:12]}"
    )
    poll_s = launch.poll_seconds(hosts, poll)
    launch.record(prepared, job_file, inventory, poll_s)
    # The job's trackers (report_to): one tracker run per job, continued by RESUME=auto and `make follow`.
    feed = Feed.start(job, prepared.run_dir, prepared.code_hash, list(hosts.hosts), hosts.remote, warn, REPO)
    supervisor = Supervisor(job, hosts, inventory, prepared.run_dir, prepared.extravars, console, poll_s,
                            on_task=lambda name: dim(f"- {name}"), on_poll=feed.poll)  # fmt: skip
    try:
        outcome = launch.follow_new(supervisor, resume == "auto")
    except LaunchError as exc:
        feed.finish("failed")
        raise playbook_failed(exc.run, "launch") from None
    except KeyboardInterrupt:
        feed.detach()
        raise ending.detached(ready.job_id) from None
    except BaseException:
        feed.finish("failed")
        raise
    launch.conclude(outcome, inventory, prepared.run_dir)  # a remote run's records are here now
    try:
        # The first main rank's, as a poll saw them, else as collected with the logs.
        ranks_phases = supervisor.ranks_phases or read_object(prepared.run_dir / "run.json").get("phases")
        seconds = timing.seconds(supervisor.first_launch, ranks_phases if isinstance(ranks_phases, dict) else None)
        write_status(prepared.run_dir, launch_phases=seconds)
        dim(f"to the first step: {phases.line(seconds)}")
        ending.report(outcome, prepared.run_dir)  # a run that did not finish ends here (exit 1)
        evaluation.after_training(prepared.run_dir)  # eval.tasks: `make eval`, its results kept by the trackers too
    finally:
        feed.finish(outcome.state)


def register(app: typer.Typer) -> None:
    app.command()(train)
