"""A launch of `make train`, once the checks before it passed (ugro/checks/prelaunch.py): where its run goes and
under which job id, the code it ships, the variables the launch playbook gets, its launch record, the controller
that follows it to its end, and that end (every host's logs collected, the run's record written).

Its decisions, in the order the launch takes them:

1. the runs directory (``runs_for``): the controller's, unless the hosts run this very checkout;
2. the job id (``pick_job_id``): a new one, or with ``--resume auto`` the newest earlier run of the job;
3. the code archive and the job key (``prepare``), and what the fast checks already read on each host;
4. the launch itself (``follow_new``): its record for `make follow`, runs/latest once it started, no empty run
   left behind when it never started;
5. its end (``conclude``).

ugro/commands/train.py parses and prints around them.
"""

from __future__ import annotations

import datetime
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ugro.hosts import codesync
from ugro.hosts.inventory import Cluster
from ugro.hosts.playbook import REPO, RUNS_ENV, run_playbook, runs_dir
from ugro.module_utils import ugro_jobkey
from ugro.run import attach
from ugro.run.supervisor import LaunchError, Outcome, Supervisor


class Refused(Exception):
    """A launch refused before anything started: the message (one line naming what and how to fix it), the exit
    code, and the lines to show before it (a host each, say)."""

    def __init__(self, message: str, code: int = 2, lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.lines = list(lines)


def runs_for(cluster: Cluster, inventory: Path) -> Path:
    """The runs directory of a launch on ``cluster``: the controller's (runs_dir), which must be this checkout's
    runs/ where the hosts run this checkout itself (ugro_code_sync: false) and write into it."""
    runs = runs_dir()
    if not cluster.remote and runs != REPO / "runs":
        raise Refused(f"{RUNS_ENV}={runs}: the hosts of {inventory} run this checkout (ugro_code_sync: false) and "
                      f"keep their runs in {REPO / 'runs'}; unset {RUNS_ENV} for them")  # fmt: skip
    return runs


def pick_job_id(name: str, resume: str, runs: Path) -> tuple[str, str | None]:
    """A new job id, or with ``resume`` 'auto' the newest earlier run of the job ``name``; and a line to show
    where resuming found none.

    Its checkpoints live on the main host, not necessarily here: the main rank there loads the newest intact one
    (or starts from step 0 and says so in its log).
    """
    if resume not in ("none", "auto"):
        raise Refused(f"--resume must be 'none' or 'auto', not '{resume}'")
    note = None
    if resume == "auto":
        candidates = sorted(p for p in runs.glob(f"{name}-*") if (p / ".control").is_dir())
        if candidates:
            return candidates[-1].name, None
        note = f"no earlier run of job '{name}' in {runs}: starting fresh"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}", note


def known_facts(
    facts: dict[str, dict[str, Any]], code_sync: dict[str, bool], code_hash: str
) -> dict[str, dict[str, Any]]:
    """Per host, the fast checks' facts that the launch reads instead of asking the host the same again
    (playbooks/train.yml ``ugro_known_facts``): where they hold the run's state, the files the launch runs and the
    interface of the host's cluster address, and where the code they saw is the code being launched (the host has
    the controller's hash, or runs the controller's own checkout). Other hosts answer the launch themselves."""
    known: dict[str, dict[str, Any]] = {}
    for host, found in facts.items():
        if not (found.get("job") and found.get("files") and (found.get("cluster") or {}).get("interface")):
            continue
        if code_sync.get(host, True) and (found.get("code") or {}).get("hash") != code_hash:
            continue
        known[host] = found
    return known


@dataclass(frozen=True)
class Checked:
    """What the fast checks read on the hosts before the launch, as the launch uses it."""

    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> its ugro_host facts
    code_sync: dict[str, bool] = field(default_factory=dict)  # host -> whether the launch syncs the code there


@dataclass(frozen=True)
class Prepared:
    """A run about to launch: its directory, the launch playbook's variables, the hash of the code it ships."""

    run_dir: Path
    extravars: dict[str, Any]
    code_hash: str


def prepare(run_dir: Path, launch: dict[str, str], model_dirs: Any, checked: Checked | None) -> Prepared:
    """The code archive and the job key in the run's directory, and the launch playbook's variables: ``launch``
    (job id, job file) and ``model_dirs`` (jobcheck.model_dirs) with them; ``checked`` (None: the fast checks
    were skipped) spares the first launch asking the hosts again."""
    control = run_dir / ".control"
    code_hash = codesync.pack(REPO, control / "code.tar.gz")
    ugro_jobkey.controller_key(run_dir)  # made at the first launch, the same at every relaunch
    extravars = launch | {
        "ugro_job_key_file": str(run_dir / ugro_jobkey.FILE),
        "ugro_code_archive": str(control / "code.tar.gz"),
        "ugro_code_hash": code_hash,
        "ugro_model_dirs": model_dirs,
        # What the fast checks just read on each host, for the first launch not to ask it again.
        "ugro_known_facts": known_facts(checked.facts, checked.code_sync, code_hash) if checked else {},
    }
    return Prepared(run_dir, extravars, code_hash)


def latest_link(run_dir: Path) -> None:
    """runs/latest -> this run (replaced in one step)."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name)
    os.replace(tmp, link)


def poll_seconds(cluster: Cluster, poll: float) -> float:
    """Seconds between status polls: ``poll`` for hosts over SSH, 1 s for this checkout's own hosts."""
    return poll if cluster.remote else 1.0


def record(prepared: Prepared, job_file: Path, inventory: Path, poll_s: float) -> None:
    """The launch record that `make follow` takes the run up from (ugro/run/attach.py)."""
    launch = attach.Launch(str(job_file.resolve()), str(inventory.resolve()), prepared.extravars, poll_s)
    launch.write(prepared.run_dir)


def follow_new(supervisor: Supervisor, resume: bool) -> Outcome:
    """Launch the run and follow it to its end; runs/latest points at it once it started. A launch that failed
    before anything started leaves no empty run behind (a resumed run keeps its directory) and raises
    LaunchError."""
    run_dir = supervisor.run_dir
    try:
        with attach.following(run_dir):
            return supervisor.run(resume, on_started=lambda: latest_link(run_dir))
    except LaunchError:
        if not resume and not (run_dir / "hosts").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def conclude(outcome: Outcome, inventory: Path, run_dir: Path) -> None:
    """The run ended: its logs and results from every host it ended on, and the controller's record."""
    collect = {"ugro_job_id": run_dir.name, "ugro_main_host": outcome.main, "ugro_runs_dir": str(runs_dir())}
    run_playbook("logs.yml", inventory, collect, run_dir / ".control" / "ansible", limit=outcome.hosts)
    outcome.record().write(run_dir)
