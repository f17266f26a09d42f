"""Follow a launched job to its end: live step, loss, tokens/s and ETA, from the hosts' own state.

Where the hosts write into the controller's checkout (inventory/local.yml) the state is read from
the run directory directly; on a cluster it comes from `playbooks/status.yml` every few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ugro.hosts.playbook import PlaybookRun, run_playbook
from ugro.module_utils import ugro_jobstate

Statuses = dict[str, dict[str, Any]]
StatusSource = Callable[[], Statuses]
Until = Callable[[Statuses], bool]
ENDED = {"finished", "failed", "stopped", "lost", "absent"}


def local_source(run_dir: Path, hosts: list[str]) -> StatusSource:
    """The run in the controller's own checkout, read with the code the hosts' fact module runs."""
    return lambda: {host: ugro_jobstate.status(run_dir, host, main=True) for host in hosts}


def remote_source(inventory: Path, job_id: str, private_dir: Path, hosts: list[str], main: str) -> StatusSource:
    """Each poll runs playbooks/status.yml on ``hosts``; a host that does not answer reads "unreachable"."""
    extravars = {"ugro_job_id": job_id, "ugro_rendezvous_host": main}

    def answers(run: PlaybookRun) -> Statuses:
        """Each host's job state as soon as its fact module answered (the play's next task waits for every host)."""
        found: Statuses = {}
        for host, facts in run.facts.items():
            status = facts.get("train_job_status") or (facts.get("ugro_host") or {}).get("job")
            if isinstance(status, dict):
                found[host] = status
        return found

    def enough(run: PlaybookRun) -> bool:
        """The hosts that have not answered yet are hosts that the answering ones cannot reach either: a cut link
        would hold the poll for the status timeout, and recovery.Watch counts them gone at once."""
        found = answers(run)
        missing = [host for host in hosts if host not in found]
        vouched = {str(peer) for status in found.values() for peer in status.get("silent_peers") or []}
        return bool(found) and bool(missing) and all(host in vouched for host in missing)

    def poll() -> Statuses:
        run = run_playbook("status.yml", inventory, extravars, private_dir, limit=hosts, enough=enough)
        found: Statuses = answers(run)
        for host, message in run.failures.items():
            found[host] = {"host": host, "state": "unreachable", "error": message}
        for host in hosts:
            found.setdefault(host, {"host": host, "state": "unreachable", "error": "no answer"})
        return found

    return poll


def ended(statuses: Statuses) -> bool:
    return bool(statuses) and all(s.get("state") in ENDED for s in statuses.values())


# While the ranks start (every host running, none with a step yet) a poll has nothing to show, and on the 3-host
# test cluster each one costs the machine ~3 CPU-s that the starting ranks' imports wait for (docs/results.md,
# "Recovery"): a remote cluster is polled at most this often until the first step, and a failed start is seen
# within it.
START_POLL_S = 5.0


class Pacer:
    """How long to wait before the next poll: ``poll_s``, except right after a host stopped answering, and at least
    ``start_s`` while the ranks start.

    A host silent on one poll counts as gone only on the next (or when its peers vouch it silent), and a poll that
    was under way when its link went down has already waited out the status timeout for it: ask again at once,
    once per host that turned silent, so that a cut link is not also held for ``poll_s``."""

    def __init__(self, poll_s: float, start_s: float = 0.0) -> None:
        self.poll_s = poll_s
        self.start_s = start_s
        self.silent: set[str] = set()

    def pause(self, statuses: Statuses) -> float:
        silent = {host for host, status in statuses.items() if status.get("state") == "unreachable"}
        newly, self.silent = silent - self.silent, silent
        if newly:
            return 0.0
        starting = all(s.get("state") == "running" and "step" not in s for s in statuses.values())
        return max(self.poll_s, self.start_s) if statuses and starting else self.poll_s


def _progress_row(statuses: Statuses) -> dict[str, Any] | None:
    return next((s for s in statuses.values() if "step" in s), None)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def follow(
    source: StatusSource, console: Console, poll_s: float, until: Until = ended, start_poll_s: float = 0.0
) -> Statuses:
    """Poll until ``until`` says so (by default: every host's job has ended), every ``poll_s`` (``start_poll_s``
    at least while the ranks start: ``Pacer``); Ctrl-C propagates to the caller (the job keeps running)."""
    pacer = Pacer(poll_s, start_poll_s)
    if not console.is_terminal:
        return _follow_plain(source, console, pacer, until)
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=None, loss="-", tps="-", eta="--:--")
        while True:
            statuses = source()
            row = _progress_row(statuses)
            if row is not None:
                progress.update(task, completed=row["step"], total=row["total_steps"], loss=f"{row['loss']:.4f}",
                                tps=f"{row['tokens_per_s']:.0f}", eta=_eta(row["eta_s"]))  # fmt: skip
            if until(statuses):
                return statuses
            time.sleep(pacer.pause(statuses))


def _follow_plain(source: StatusSource, console: Console, pacer: Pacer, until: Until) -> Statuses:
    last_step, next_report = -1, 0.0
    while True:
        statuses = source()
        row = _progress_row(statuses)
        now = time.monotonic()
        done = until(statuses)
        if row is not None and row["step"] != last_step and (now >= next_report or done):
            console.print(f"step {row['step']}/{row['total_steps']}  loss {row['loss']:.4f}  "
                          f"{row['tokens_per_s']:.0f} tok/s  ETA {_eta(row['eta_s'])}")  # fmt: skip
            last_step, next_report = row["step"], now + 5
        if done:
            return statuses
        time.sleep(pacer.pause(statuses))
