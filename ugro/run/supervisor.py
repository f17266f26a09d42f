"""Run a job to its end across failures: launch, follow, copy checkpoints off the main host, recover, record.

One launch = torchrun on every host of the launch (playbooks/train.yml with a limit). While it runs the
controller polls every host; each new checkpoint on the main host is fetched into the controller's run
directory (and pushed to ``checkpoint.replicas`` other hosts). When a host stops answering, its job
vanishes, or a rank fails, the controller finds the root cause (ugro/run/recovery.py), stops what is left,
leaves out the hosts that are gone, places the newest intact checkpoint on the (possibly new) main host
and launches again, up to ``train.max_restarts`` times and down to ``train.min_hosts`` hosts. Every restart
goes into the run's record (run.json ``restarts``) with its cause, the hosts before and after, and the
steps redone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from train.config import JobConfig
from ugro.hosts.inventory import Cluster
from ugro.hosts.playbook import PlaybookRun, run_playbook
from ugro.monitoring import monitor
from ugro.monitoring.jobstates import ExporterStates
from ugro.run import recovery, replicas
from ugro.run.attach import Supervision
from ugro.run.follow import ENDED, START_POLL_S, Pacer, RemoteSource, Statuses, follow, local_source
from ugro.run.records import Cause, Restart, RunRecord

# After a checkpoint copy that took d seconds, the next one waits COPY_REST x d (Supervisor._replicate): the copier
# is busy at most a third of the time.
COPY_REST = 2.0


class LaunchError(RuntimeError):
    """The first launch failed before the job started (the playbook's failures say where)."""

    def __init__(self, run: PlaybookRun) -> None:
        super().__init__("launch failed")
        self.run = run


@dataclass
class Outcome:
    state: str  # finished / failed / stopped
    statuses: Statuses
    hosts: list[str]
    main: str
    cause: Cause | None = None
    restarts: list[Restart] = field(default_factory=list)
    copy_failures: list[str] = field(default_factory=list)

    def record(self) -> RunRecord:
        return RunRecord(self.hosts, self.main, self.state, self.cause, self.restarts, self.copy_failures)


class State(Enum):
    """Where the follow loop is (Supervisor.advance): each state is one method of the supervisor, which returns the
    next.

    launching -> following            the launch playbook started the job (a relaunch that fails somewhere: regrouping)
    following -> finished             every rank finished, or the run was stopped
    following -> adopting             the ranks changed their group themselves (survivors without a controller, a
                                      host taken back in) -> following that group
    following -> regrouping           a host or rank failed: the survivors go on in their processes -> following,
                                      or where they cannot -> relaunching
    relaunching -> launching | failed  the next attempt on the hosts left, or no restart is possible
    """

    LAUNCHING = "launching"
    FOLLOWING = "following"
    ADOPTING = "adopting"
    REGROUPING = "regrouping"
    RELAUNCHING = "relaunching"
    FINISHED = "finished"  # the run finished or was stopped (Outcome.state says which)
    FAILED = "failed"


@dataclass(frozen=True)
class Fault:
    """A fault as the controller detected it: what recovering from it (regrouping, relaunching) needs."""

    cause: Cause
    gone: list[str]  # the hosts the next group or launch leaves out
    detected: float  # epoch seconds: the restart's figures count from here
    last_step: int  # the main rank's newest step a poll saw
    last_checkpoint: int | None  # the main host's newest checkpoint's step (a relaunch on it resumes there)


@dataclass
class Loop:
    """The follow loop's state, in one place: the run's hosts and main host now, which launch attempt and which
    membership generation of it run (ugro/run/attach.py Supervision: the same two counters, read back), and what
    the last state learned for the next."""

    hosts: list[str]
    main: str
    state: State = State.LAUNCHING
    attempt: int = 0  # the launch attempt: one more for every relaunch
    generation: int = 0  # the membership generation since that launch: one more for every regroup
    resume: bool = False  # the first launch resumes from the newest checkpoint (a relaunch always does)
    on_started: Callable[[], None] | None = None  # called once the first launch started
    statuses: Statuses = field(default_factory=dict)  # the hosts' job states at the last poll (or failed launch)
    agreed: list[dict[str, Any]] = field(default_factory=list)  # adopting: the regroups the ranks agreed on
    fault: Fault | None = None  # regrouping, relaunching: the fault being recovered from
    outcome: Outcome | None = None  # finished, failed: how the run ended


@dataclass
class Supervisor:
    job: JobConfig
    cluster: Cluster
    inventory: Path
    run_dir: Path
    extravars: dict[str, Any]  # ugro_job_id, ugro_job_file, code archive ...
    console: Console
    poll_s: float
    on_task: Callable[[str], None] | None = None
    # Called on every poll with the main host and every host's state (the trackers' feed: ugro/tracking/feed.py).
    on_poll: Callable[[str, Statuses], None] | None = None

    def __post_init__(self) -> None:
        self.private = self.run_dir / ".control" / "ansible"
        self.copies = replicas.Replicator(  # its own ansible-runner directory: it runs beside the polls
            self.inventory, self.run_dir, self.private / "replicas", self.job.checkpoint.keep_last, self.cluster.remote
        )
        self.restarts: list[Restart] = []
        self.copy_failures: list[str] = []  # checkpoint copies that failed with an error: the run's record keeps them
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ugro-checkpoint-copy")
        self._copying: Future[None] | None = None
        self._next_copy_at = 0.0  # time.monotonic() before which no new copy starts (_replicate)
        self._copy_hosts: set[str] = set()  # the hosts the copy under way talks to now
        self._members: set[str] = set()  # the run's hosts as the supervisor last knew them (run() keeps it)
        self._exporters: ExporterStates | None = None  # one for the run: a host given up on stays given up
        self.first_launch: PlaybookRun | None = None  # its events time the launch's phases (ugro/run/phases.py)
        # The first launch's main rank's own phases (run.json ``phases``), as a poll saw them: the main host may be
        # lost before the end, when the run's records are collected from another.
        self.ranks_phases: dict[str, Any] | None = None

    def _copies_settled(self, hosts: list[str]) -> None:
        """Wait for a checkpoint copy under way (a fault must not race it); ``hosts``: the run's hosts now. A copy
        with a host that is not among them is given up instead: where its link was cut, it would wait minutes for
        SSH's keepalives."""
        self._members = set(hosts)
        if self._copying is not None:
            self._copying.result()

    def _copy_given_up(self) -> bool:
        """The copy under way talks to a host that left the run (the copy's playbook asks every 0.2 s)."""
        return not self._copy_hosts <= self._members

    # -- one launch ---------------------------------------------------------------------------------------

    def _launch(self, attempt: int, hosts: list[str], main: str, resume: bool) -> PlaybookRun:
        # The fast checks' facts are the first launch's only: a relaunch asks the hosts what holds now.
        first = {k: v for k, v in self.extravars.items() if attempt == 0 or k != "ugro_known_facts"}
        extravars = first | {
            "ugro_attempt": attempt,
            "ugro_main_host": main,
            "ugro_resume": "auto" if resume else "none",
            "ugro_wait": False,
        }
        return run_playbook("train.yml", self.inventory, extravars, self.private, on_task=self.on_task, limit=hosts)

    def _source(self, hosts: list[str], main: str) -> tuple[Callable[[], Statuses], Pacer]:
        """Where the hosts' job states come from, and how often to ask."""
        if not self.cluster.remote:  # a local poll reads files: it costs nothing
            return local_source(self.run_dir, hosts, self.poll_s), Pacer(self.poll_s)
        if self._exporters is None:
            targets = [monitor.target(h, self.cluster.hostvars.get(h, {})) for h in self.cluster.hosts]
            self._exporters = ExporterStates(targets, self.run_dir.name, follow_poll_s=self.poll_s)
        source = RemoteSource(self.inventory, self.run_dir.name, self.private, hosts, main, self._exporters, self._note,
                              follow_poll_s=self.poll_s)  # fmt: skip
        return source, Pacer(self.poll_s, START_POLL_S, lambda: source.ran_playbook)

    def _note(self, line: str) -> None:
        self.console.print(f"[yellow]note:[/] {line}", highlight=False)

    def _replicate(self, main: str, status: dict[str, Any], hosts: list[str]) -> None:
        """In the background (polls go on): fetch the main host's newest checkpoint if the controller lacks it.

        A copy is a playbook (~4 CPU-s of the controller's and the main host's on the test cluster). Where a run
        writes checkpoints faster than they are copied (every second, on the test cluster), copying one after the
        other kept a core busy for the whole run: after a copy that took d seconds the next one starts no sooner
        than ``COPY_REST`` x d later. A run with minutes between its checkpoints still copies every one."""
        name = Path(str(status.get("last_checkpoint") or "")).name
        ours = self.copies.local_newest()
        if not name or (ours is not None and ours["name"] >= name):
            return
        if (self._copying is None or self._copying.done()) and time.monotonic() >= self._next_copy_at:
            self._copy_hosts = {main}
            self._copying = self._copier.submit(self._copy, main, name, hosts)

    def _copy(self, main: str, name: str, hosts: list[str]) -> None:
        """Fetch checkpoint ``name`` from the main host to the controller, then push it to the replicas. A copy that
        fails (the controller's disk full, a broken archive) is one line on the console and in the run's record;
        supervision goes on, and the next checkpoint is copied as usual."""
        began = time.monotonic()
        try:
            self._copy_unguarded(main, name, hosts)
        except Exception as exc:  # a background copy must never end the supervision of the run
            line = f"checkpoint {name}: the copy from {main} failed: {type(exc).__name__}: {exc}"
            self.copy_failures.append(line)
            self.console.print(f"[yellow]{line}[/]", highlight=False)
        finally:
            ended = time.monotonic()
            self._next_copy_at = ended + COPY_REST * (ended - began)

    def _copy_unguarded(self, main: str, name: str, hosts: list[str]) -> None:
        why = self.copies.fetch(main, name, self._copy_given_up)
        if why is not None:
            self.console.print(f"[yellow]checkpoint {name} not copied to the controller yet:[/] {why}", highlight=False)
            return
        replica_hosts = recovery.replicas_for(hosts, main, self.job.checkpoint.replicas)
        self._copy_hosts = set(replica_hosts)
        for host, problem in self.copies.push(replica_hosts, main, False, self._copy_given_up).items():
            self.console.print(f"[yellow]replica of {name} on {host} failed:[/] {problem}", highlight=False)

    def _follow(
        self, attempt: int, hosts: list[str], main: str, generation: int
    ) -> tuple[str, Statuses, recovery.Watch, int]:
        watch = recovery.Watch(hosts, main=main, regrouped=generation > 0)
        seen: dict[str, Any] = {"step": 0, "verdict": "running"}
        source, pacer = self._source(hosts, main)

        def until(statuses: Statuses) -> bool:
            if self.on_poll is not None:
                self.on_poll(main, statuses)
            watch.note(statuses)
            main_status = dict(statuses.get(main, {}))
            seen["step"] = max(seen["step"], int(main_status.get("step") or 0))
            if self.ranks_phases is None and isinstance(main_status.get("phases"), dict):
                self.ranks_phases = dict(main_status["phases"])
            if (
                self.restarts
                and not self.restarts[-1].settled
                and self._settle_when_seen(statuses, main, attempt, generation)
            ):
                self._record(hosts, main)  # the restart's figures, as soon as the ranks' record gives them
            if self.cluster.remote and main_status.get("state") == "running":
                self._replicate(main, main_status, hosts)
            seen["verdict"] = watch.verdict(statuses)
            # The ranks changed their group themselves (a crashed host's ranks came back): follow the new one.
            return seen["verdict"] != "running" or bool(recovery.survivors_regroups(statuses, attempt, generation))

        statuses = follow(source, self.console, pacer, until)
        return str(seen["verdict"]), statuses, watch, int(seen["step"])

    def _settle_when_seen(self, statuses: Statuses, main: str, attempt: int, generation: int) -> bool:
        """The ranks' record of the relaunch's resume (or of the survivors' regroup) closes the last restart: the main
        rank's in run.json, or for a regroup any survivor's own (the main host may be gone by the next poll)."""
        restart = self.restarts[-1]
        main_status = statuses.get(main, {})
        if restart.how == "regroup":
            # The main rank's whole history too: the group may have changed again since (a host taken back in).
            history = list(main_status.get("regroups") or [])
            found = [main_status.get("regrouped"), *history] + [s.get("rank_regrouped") for s in statuses.values()]
            records = [r for r in found if isinstance(r, dict)]
            record = next((r for r in records if r.get("attempt") == attempt and r.get("generation") == generation), {})
            if not record:
                return False
            restart.regroup_s = record.get("seconds")
        else:
            record = main_status.get("resumed") or {}
            if record.get("attempt") != attempt:
                return False
        restart.settle(int(record.get("from_step") or 0), int(record.get("last_step_logged") or 0))
        restart.recovered_after_s = round(time.time() - restart.time, 1)
        return True

    def _settle_restart(self, attempt: int, generation: int, statuses: Statuses, main: str) -> None:
        """Before the next fault or the end: a restart whose first step no poll saw gets its figures now, from the
        ranks' record if a host answers with it, else estimated from the checkpoint the relaunch was given."""
        if not self.restarts or self.restarts[-1].settled:
            return
        if self._settle_when_seen(statuses, main, attempt, generation):
            return
        restart = self.restarts[-1]
        if restart.how == "regroup":  # the survivors went on from the step they had reached
            restart.settle(restart.last_step_seen, restart.last_step_seen, estimated=True)
            return
        restart.settle(restart.checkpoint_step or 0, 0, estimated=True)

    def _regroup(self, hosts: list[str], main: str, generation: int) -> dict[str, str]:
        """Tell the survivors who is left (playbooks/regroup.yml); host -> why it could not be told."""
        membership = {"generation": generation, "hosts": hosts, "main": main}
        extravars = {"ugro_job_id": self.run_dir.name, "ugro_membership": membership}
        run = run_playbook("regroup.yml", self.inventory, extravars, self.private, limit=hosts)
        return dict(run.failures)

    # -- the whole run ------------------------------------------------------------------------------------

    def _stop(self, hosts: list[str], main: str) -> dict[str, str]:
        """Stop the job's processes on ``hosts``; host -> why it could not be stopped (it did not answer)."""
        if not hosts:
            return {}
        # A short grace: ranks blocked in a collective with a lost peer do not act on SIGTERM, and the
        # checkpoints on disk are complete (written atomically) whatever happens to the ranks now.
        extravars = {"ugro_job_id": self.run_dir.name, "ugro_main_host": main, "ugro_stop_grace_s": 5}
        run = run_playbook("stop.yml", self.inventory, extravars, self.private, limit=hosts)
        return dict(run.failures)

    def _record(self, hosts: list[str], main: str) -> None:
        """The controller's record as it goes (ugro/run/attach.py): a controller that re-attaches continues it."""
        Supervision(hosts, main, self.restarts, self.copy_failures).write(self.run_dir)

    def run(
        self, resume: bool, on_started: Callable[[], None] | None = None, attached: Supervision | None = None
    ) -> Outcome:
        """Launch, follow and recover until the run finishes, is stopped, or fails for good.
        Raises LaunchError if the first launch fails (nothing ran); ``on_started`` runs once it started. With
        ``attached`` (`make follow`), the run is already launched: follow it from where that record left it."""
        loop = self.begin(resume, on_started, attached)
        while loop.outcome is None:
            self.advance(loop)
        return loop.outcome

    def begin(
        self, resume: bool, on_started: Callable[[], None] | None = None, attached: Supervision | None = None
    ) -> Loop:
        """The loop's first state: launching on every host of the inventory, or following the run ``attached`` is the
        record of (its hosts, main host, attempt and generation, and its restarts so far)."""
        loop = Loop(list(self.cluster.hosts), self.cluster.main_host, resume=resume, on_started=on_started)
        if attached is not None:
            loop.hosts, loop.main, loop.state = list(attached.hosts), attached.main, State.FOLLOWING
            loop.attempt, loop.generation = attached.attempt, attached.generation
            self.restarts, self.copy_failures = list(attached.restarts), list(attached.copy_failures)
        elif resume:
            self.copies.place(loop.hosts, loop.main)
        self._record(loop.hosts, loop.main)
        return loop

    def advance(self, loop: Loop) -> None:
        """One transition: the function of the loop's state runs and names the next state."""
        transitions: dict[State, Callable[[Loop], State]] = {
            State.LAUNCHING: self.launching,
            State.FOLLOWING: self.following,
            State.ADOPTING: self.adopting,
            State.REGROUPING: self.regrouping,
            State.RELAUNCHING: self.relaunching,
        }
        if loop.state not in transitions:
            raise ValueError(f"the run has ended ({loop.state.value}): nothing follows")
        loop.state = transitions[loop.state](loop)

    # -- the states ---------------------------------------------------------------------------------------

    def launching(self, loop: Loop) -> State:
        """Launch the job on the loop's hosts -> following; a relaunch that fails somewhere -> regrouping (a fault
        of the hosts that failed: no survivors run, so it relaunches without them). The first launch failing raises
        LaunchError: nothing ran."""
        began = time.time()
        launch = self._launch(loop.attempt, loop.hosts, loop.main, loop.resume or loop.attempt > 0)
        self.first_launch = self.first_launch or launch
        if self.restarts:
            self.restarts[-1].launch_s = round(time.time() - began, 1)
        if launch.ok:
            if loop.attempt == 0 and loop.on_started is not None:
                loop.on_started()
            return State.FOLLOWING
        if loop.attempt == 0:
            raise LaunchError(launch)
        # A relaunch that cannot start somewhere: leave those hosts out and try again.
        host, message = next(iter(launch.failures.items()), (loop.main, "the launch playbook failed"))
        loop.statuses = {h: {"state": "unreachable", "error": m} for h, m in launch.failures.items()}
        loop.fault = self._fault(Cause("launch", message.splitlines()[0], host), list(launch.failures), 0, None)
        return State.REGROUPING

    def following(self, loop: Loop) -> State:
        """Follow the running job until it ends (-> finished), its ranks change their group themselves (-> adopting)
        or a host or rank fails (-> regrouping, with the fault's root cause and the hosts that are gone)."""
        self._members = set(loop.hosts)  # after a regroup: a copy under way with a lost host is given up
        verdict, statuses, watch, last_step = self._follow(loop.attempt, loop.hosts, loop.main, loop.generation)
        loop.statuses = statuses
        self._settle_restart(loop.attempt, loop.generation, statuses, loop.main)
        loop.agreed = recovery.survivors_regroups(statuses, loop.attempt, loop.generation)
        if loop.agreed:  # while no controller followed, the survivors went on without a host: follow them
            return State.ADOPTING
        if verdict in ("finished", "stopped"):
            self._copies_settled(loop.hosts)
            if loop.generation:  # the survivors' torchrun agents wait for the lost host's at their exit barrier
                self._stop([h for h in loop.hosts if statuses.get(h, {}).get("pids")], loop.main)
            loop.outcome = Outcome(verdict, statuses, loop.hosts, loop.main, restarts=self.restarts,
                                   copy_failures=self.copy_failures)  # fmt: skip
            return State.FINISHED
        unreachable = watch.gone_at_fault(statuses)
        cause = recovery.root_cause(statuses, loop.hosts, unreachable) or Cause(
            "error", "a host failed without a recorded cause", loop.hosts[0]
        )
        gone = recovery.blamed(statuses, loop.hosts, unreachable)
        checkpoint = _step_of(statuses.get(loop.main, {}).get("last_checkpoint"))
        loop.fault = self._fault(cause, gone, last_step, checkpoint)
        return State.REGROUPING

    def adopting(self, loop: Loop) -> State:
        """The regroups the ranks agreed on themselves become the run's restarts -> following the group they
        formed (no launch: its ranks run)."""
        loop.hosts, loop.main, loop.generation = self._adopt(loop.agreed, loop.hosts)
        loop.agreed = []
        self._record(loop.hosts, loop.main)
        return State.FOLLOWING

    def regrouping(self, loop: Loop) -> State:
        """After a fault: tell the survivors to go on without the hosts that are gone (and without a host whose
        crashed ranks restart, until they are back) -> following them, or -> relaunching where the fault needs it
        or a survivor could not be told."""
        fault = self._the_fault(loop)
        # A host whose crashed ranks its launcher starts again is left out of the group until they are back.
        rejoining = [h for h in recovery.rejoining(loop.statuses, loop.hosts) if h not in fault.gone]
        survivors = self._survivors(loop.statuses, loop.hosts, loop.main, fault.gone + rejoining, fault.cause)
        if survivors is None:
            return State.RELAUNCHING
        kept = recovery.main_host_for(survivors, loop.main)  # the main host, or the first survivor where it is gone
        unanswered = self._regroup(survivors, kept, loop.generation + 1)
        if unanswered:
            self.console.print(f"[yellow]regroup not possible, relaunching:[/] {unanswered}", highlight=False)
            return State.RELAUNCHING
        loop.generation += 1
        told = time.time()
        self.restarts.append(Restart(
            attempt=len(self.restarts) + 1, time=round(fault.detected, 3), cause=fault.cause, hosts_before=loop.hosts,
            hosts_after=survivors, left_out=[h for h in self.cluster.hosts if h not in survivors],
            main_host=kept, checkpoint_step=None, last_step_seen=fault.last_step, how="regroup",
            membership_s=round(told - fault.detected, 1),
        ))  # fmt: skip
        moved = f"; {kept} keeps the run's records now" if kept != loop.main else ""
        back = f"; {', '.join(rejoining)} rejoins them once its ranks are up again" if rejoining else ""
        self.console.print(
            f"[bold yellow]restart {self._counted()}/{self.job.train.max_restarts}:[/] the ranks on "
            f"{', '.join(survivors)} go on without {', '.join(fault.gone + rejoining)} (no relaunch{moved}{back})",
            highlight=False,
        )
        loop.hosts, loop.main, loop.fault = survivors, kept, None
        self._record(loop.hosts, loop.main)
        return State.FOLLOWING

    def relaunching(self, loop: Loop) -> State:
        """Stop what is left of the job, leave out the hosts that are gone and place the newest intact checkpoint on
        the main host -> launching the next attempt; -> failed where the fault would happen again, the restarts are
        used up, or fewer than ``train.min_hosts`` hosts are left."""
        fault = self._the_fault(loop)
        self._copies_settled([h for h in loop.hosts if h not in fault.gone])
        # Whatever is left of the job stops now (torchrun's survivors would wait for the lost peer): on the
        # hosts of this launch where it still runs, and on those an earlier fault left out (a host that comes
        # back may still run the job's old processes).
        statuses = loop.statuses
        ended = {h for h in loop.hosts if statuses.get(h, {}).get("state") in ENDED and not statuses[h].get("pids")}
        unanswered = self._stop([h for h in self.cluster.hosts if h not in fault.gone and h not in ended], loop.main)
        stopped = time.time()
        candidates = [h for h in self.cluster.hosts if h not in fault.gone and h not in unanswered]
        problem = self._give_up(cause=fault.cause, candidates=candidates)
        if problem is not None:
            self.console.print(f"[bold red]not restarting:[/] {problem}", highlight=False)
            loop.outcome = Outcome("failed", statuses, loop.hosts, loop.main, cause=fault.cause,
                                   restarts=self.restarts, copy_failures=self.copy_failures)  # fmt: skip
            return State.FAILED
        new_main = recovery.main_host_for(candidates, self.cluster.main_host)
        # The main host keeps its own checkpoints; a new one gets the newest intact copy from wherever it is.
        step = fault.last_checkpoint if new_main == loop.main else self.copies.place(candidates, new_main)[0]
        loop.attempt, loop.generation = loop.attempt + 1, 0
        self.restarts.append(Restart(
            attempt=len(self.restarts) + 1, time=round(fault.detected, 3), cause=fault.cause,
            hosts_before=loop.hosts, hosts_after=candidates,
            left_out=[h for h in self.cluster.hosts if h not in candidates], main_host=new_main,
            checkpoint_step=step, last_step_seen=fault.last_step, stop_s=round(stopped - fault.detected, 1),
            place_checkpoint_s=round(time.time() - stopped, 1),
        ))  # fmt: skip
        self.console.print(
            f"[bold yellow]restart {self._counted()}/{self.job.train.max_restarts}:[/] relaunching on "
            f"{', '.join(candidates)} (main host {new_main}) from "
            f"{f'checkpoint step {step}' if step is not None else 'step 0 (no intact checkpoint)'}",
            highlight=False,
        )
        loop.hosts, loop.main, loop.fault = candidates, new_main, None
        self._record(loop.hosts, loop.main)
        return State.LAUNCHING

    def _fault(self, cause: Cause, gone: list[str], last_step: int, last_checkpoint: int | None) -> Fault:
        """A fault as it is detected: one line on the console, and the moment its restart's figures count from."""
        self.console.print(f"[bold red]failure:[/] {cause.line()}", highlight=False)
        return Fault(cause, gone, time.time(), last_step, last_checkpoint)

    @staticmethod
    def _the_fault(loop: Loop) -> Fault:
        if loop.fault is None:
            raise ValueError(f"{loop.state.value}: no fault to recover from")
        return loop.fault

    def _adopt(self, agreed: list[dict[str, Any]], hosts: list[str]) -> tuple[list[str], str, int]:
        """The regroups the survivors agreed on themselves (``agreed``, oldest first) become the run's restarts; the
        hosts, main host and generation the run has now."""
        inventory = list(self.cluster.hosts)
        lent = [h for r in self.restarts if r.cause.kind == "lent" for h in r.cause.host.split(", ")]
        lent = [h for h in lent if h not in hosts]  # taken back and not in the group since
        adopted, (hosts, main, generation) = recovery.adopted(agreed, hosts, inventory, len(self.restarts), lent)
        for restart in adopted:
            self.console.print(f"[bold yellow]{escape(restart.line())}[/]", highlight=False)
        self.restarts += adopted
        return hosts, main, generation

    def _give_up(self, cause: Cause, candidates: list[str] | None = None) -> str | None:
        """Why the run cannot be relaunched after ``cause`` (on ``candidates``, where given), or None."""
        if cause.kind in recovery.NOT_RESTARTABLE:
            return f"a {cause.kind} failure would happen again on a relaunch"
        if self._counted() >= self.job.train.max_restarts:
            return f"restarts exhausted ({self._counted()} of train.max_restarts={self.job.train.max_restarts})"
        if candidates is not None and len(candidates) < self.job.train.min_hosts:
            return (
                f"only {len(candidates)} host(s) left ({', '.join(candidates) or 'none'}), fewer than "
                f"train.min_hosts={self.job.train.min_hosts}"
            )
        return None

    def _counted(self) -> int:
        """The restarts that count against ``train.max_restarts``: neither a host taken back in (its crash was) nor
        one its owner took back or lent again (no fault at all)."""
        return sum(1 for r in self.restarts if r.decided_by not in ("rejoin", "released"))

    def _survivors(
        self, statuses: Statuses, hosts: list[str], main: str, gone: list[str], cause: Cause
    ) -> list[str] | None:
        """The hosts whose ranks go on without a relaunch, or None when this fault needs one."""
        if self.job.distributed.regroup_timeout_s == 0 or self._give_up(cause) is not None:
            return None
        survivors = recovery.regroup_survivors(statuses, hosts, main, gone)
        if survivors is None or len(survivors) < self.job.train.min_hosts:
            return None
        return survivors


def _step_of(checkpoint: object) -> int | None:
    """The step of a checkpoint path such as .../checkpoints/step-000120."""
    digits = Path(str(checkpoint or "")).name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None
