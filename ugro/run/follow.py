"""Follow a launched job to its end: live step, loss, tokens/s and ETA, from the hosts' own state.

Where the hosts write into the controller's checkout (inventory/local.yml) the state is read from
the run directory directly; on a cluster it comes every few seconds from the hosts' node exporters, and from
`playbooks/status.yml` for a host whose exporter gives none.
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
from ugro.monitoring.jobstates import ExporterStates

Statuses = dict[str, dict[str, Any]]
StatusSource = Callable[[], Statuses]
Until = Callable[[Statuses], bool]
ENDED = {"finished", "failed", "stopped", "lost", "absent"}


def local_source(run_dir: Path, hosts: list[str], follow_poll_s: float = 0.0) -> StatusSource:
    """The run in the controller's own checkout, read with the code the hosts' fact module runs (``follow_poll_s``:
    a controller that follows the run reads, every that many seconds)."""
    return lambda: {host: ugro_jobstate.status(run_dir, host, True, follow_poll_s) for host in hosts}


class RemoteSource:
    """Each poll reads the hosts' exporters (``exporters``: ugro/monitoring/jobstates.py) and runs playbooks/status.yml
    on the hosts whose exporter gave no state; a host that answers neither way reads "unreachable"."""

    def __init__(
        self,
        inventory: Path,
        job_id: str,
        private_dir: Path,
        hosts: list[str],
        main: str,
        exporters: ExporterStates | None = None,
        on_note: Callable[[str], None] | None = None,
        follow_poll_s: float = 0.0,
    ) -> None:
        self.inventory, self.private_dir, self.hosts = inventory, private_dir, hosts
        self.main = main
        # ugro_follow_poll_s > 0: the controller that follows the run asks (ugro_jobstate.mark_followed)
        self.extravars = {"ugro_job_id": job_id, "ugro_main_host": main, "ugro_follow_poll_s": follow_poll_s}
        self.exporters = exporters
        self.on_note = on_note
        self.ran_playbook = True  # whether the last poll ran the status playbook

    def __call__(self) -> Statuses:
        found, missed = self.exporters.read(self.hosts, self.main) if self.exporters is not None else ({}, {})
        rest = [host for host in self.hosts if host not in found]
        self.ran_playbook = bool(rest) and not _vouched_silent(found, rest)
        if self.ran_playbook:
            heard = _Reread(self.exporters, found, self.main)
            run = run_playbook(
                "status.yml", self.inventory, self.extravars, self.private_dir, limit=rest,
                enough=lambda run: _vouched_silent(heard.now() | _answers(run), self.hosts),
            )  # fmt: skip
            answered = _answers(run)
            self._polled_by_ansible({host: missed[host] for host in answered if host in missed})
            found = heard.states | answered
            for host, message in run.failures.items():
                found.setdefault(host, {"host": host, "state": "unreachable", "error": message})
        for host in self.hosts:
            found.setdefault(host, {"host": host, "state": "unreachable", "error": "no answer"})
        return found

    def _polled_by_ansible(self, why: dict[str, str]) -> None:
        """Hosts that Ansible reached where their exporter gave no state are asked through Ansible for a while, and
        their exporters again later (ugro/monitoring/jobstates.py: from 30 s, twice as long after each failure)."""
        if self.exporters is None or not why:
            return
        waits = {host: self.exporters.give_up(host, reason) for host, reason in why.items()}
        if self.on_note is not None:
            self.on_note(
                f"the job's state on {', '.join(why)} comes through Ansible, a playbook each poll, until its exporter "
                f"answers again (asked again in {round(min(waits.values()))} s): {'; '.join(why.values())}"
            )


class _Reread:
    """The states the exporters gave, read again at most every ``every_s`` while a status playbook asks the other
    hosts: a peer that names an unanswering host silent ends that playbook (``_vouched_silent``) without waiting
    out its status timeout, as a poll of every host through Ansible would hear it."""

    def __init__(self, exporters: ExporterStates | None, states: Statuses, main: str, every_s: float = 0.5) -> None:
        self.exporters, self.states, self.main, self.every_s = exporters, dict(states), main, every_s
        self.last = time.monotonic()

    def now(self) -> Statuses:
        if self.exporters is not None and self.states and time.monotonic() - self.last >= self.every_s:
            self.states |= self.exporters.read(list(self.states), self.main)[0]
            self.last = time.monotonic()
        return self.states


def _answers(run: PlaybookRun) -> Statuses:
    """Each host's job state as soon as its fact module answered (the play's next task waits for every host)."""
    found: Statuses = {}
    for host, facts in run.facts.items():
        status = facts.get("train_job_status") or (facts.get("ugro_host") or {}).get("job")
        if isinstance(status, dict):
            found[host] = status
    return found


def _vouched_silent(found: Statuses, hosts: list[str]) -> bool:
    """The hosts that have not answered are hosts that the answering ones cannot reach either: a cut link would
    hold a status poll for its timeout, and recovery.Watch counts them gone at once."""
    missing = [host for host in hosts if host not in found]
    vouched = {str(peer) for status in found.values() for peer in status.get("silent_peers") or []}
    return bool(found) and bool(missing) and all(host in vouched for host in missing)


def ended(statuses: Statuses) -> bool:
    return bool(statuses) and all(s.get("state") in ENDED for s in statuses.values())


# While the ranks start (every host running, none with a step yet) a poll has nothing to show, and on the 3-host
# test cluster a poll through Ansible costs the machine ~3 CPU-s that the starting ranks' imports wait for
# (docs/results.md, "Recovery"): such polls come at most this often until the first step, and a failed start is seen
# within it.
START_POLL_S = 5.0


class Pacer:
    """How long to wait before the next poll: ``poll_s``, except right after a host stopped answering, and at least
    ``start_s`` while the ranks start where the last poll was ``costly`` (it ran a playbook).

    A host silent on one poll counts as gone only on the next (or when its peers vouch it silent), and a poll that
    was under way when its link went down has already waited out the status timeout for it: ask again at once,
    once per host that turned silent, so that a cut link is not also held for ``poll_s``."""

    def __init__(self, poll_s: float, start_s: float = 0.0, costly: Callable[[], bool] = lambda: True) -> None:
        self.poll_s = poll_s
        self.start_s = start_s
        self.costly = costly
        self.silent: set[str] = set()

    def pause(self, statuses: Statuses) -> float:
        silent = {host for host, status in statuses.items() if status.get("state") == "unreachable"}
        newly, self.silent = silent - self.silent, silent
        if newly:
            return 0.0
        starting = all(s.get("state") == "running" and "step" not in s for s in statuses.values())
        return max(self.poll_s, self.start_s) if statuses and starting and self.costly() else self.poll_s


def _progress_row(statuses: Statuses) -> dict[str, Any] | None:
    return next((s for s in statuses.values() if "step" in s), None)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def follow(source: StatusSource, console: Console, pacer: Pacer, until: Until = ended) -> Statuses:
    """Poll until ``until`` says so (by default: every host's job has ended), as often as ``pacer`` says; Ctrl-C
    propagates to the caller (the job keeps running)."""
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
