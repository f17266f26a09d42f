"""What went wrong with a launch, and whether and where to relaunch: the controller's recovery policy.

Pure functions over the hosts' job states (ugro/module_utils/ugro_jobstate.py ``status``, one per host, with
``state`` "unreachable" where the host did not answer): no Ansible, no processes, so every rule is tested
on its own (tests/test_failure_records.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ugro.run.records import Cause, Restart

Statuses = Mapping[str, Mapping[str, Any]]

# A rank's own record of one of these means the relaunch would fail the same way (train/recovery/failure.py).
NOT_RESTARTABLE = frozenset({"config", "non_finite"})
# Record kinds that are consequences of a failure elsewhere, not causes.
SECONDARY = ("collective", "stopped")
# Polls in a row without an answer before a host counts as unreachable (one slow SSH login is not a fault).
UNREACHABLE_POLLS = 2


@dataclass
class Watch:
    """The state of one launch as the controller follows it, poll after poll."""

    hosts: list[str]
    silent: dict[str, int] = field(default_factory=dict)  # host -> polls in a row without an answer
    main: str = ""
    regrouped: bool = False  # the launch lost a host and went on without it (its agents wait for it at the end)
    vouched: set[str] = field(default_factory=set)  # hosts that the answering hosts' ranks cannot reach either

    def note(self, statuses: Statuses) -> None:
        answering = [statuses.get(h, {}) for h in self.hosts]
        answering = [s for s in answering if s.get("state") not in (None, "unreachable")]
        self.vouched = {str(peer) for s in answering for peer in s.get("silent_peers") or []}
        for host in self.hosts:
            answered = statuses.get(host, {}).get("state") not in (None, "unreachable")
            self.silent[host] = 0 if answered else self.silent.get(host, 0) + 1

    def unreachable(self, polls: int = UNREACHABLE_POLLS) -> list[str]:
        """Hosts that did not answer the last ``polls`` polls, or the last one where their peers cannot reach them
        either (train/recovery/watch.py Heartbeat). A fault is declared on two silent polls, or on one its peers
        confirm."""
        silent = self.silent
        return [h for h in self.hosts if silent.get(h, 0) >= polls or (silent.get(h, 0) and h in self.vouched)]

    def gone_at_fault(self, statuses: Statuses) -> list[str]:
        """Once a fault is declared, the hosts that stopped answering: those ``unreachable`` names, and a host silent on
        the last poll alone only where nothing else explains the fault (a cut link hangs its SSH session while the
        hosts that talk to it fail with collective errors). Where another host's job vanished or stopped answering, a
        host that missed one poll was slow to answer (a loaded controller or host), and stays in the group."""
        sure = self.unreachable()
        return sure if blamed(statuses, self.hosts, sure) else self.unreachable(polls=1)

    def verdict(self, statuses: Statuses) -> str:
        """running / finished / stopped (someone ran `make stop`) / fault (a host or rank failed or is gone)."""
        states = {h: statuses.get(h, {}).get("state") for h in self.hosts}
        if any(s == "stopped" for s in states.values()):
            over = all(s in ("stopped", "finished", "failed", "lost") for s in states.values())
            return "stopped" if over else "running"
        if self.unreachable() or any(s in ("failed", "lost", "absent") for s in states.values()):
            return "fault"
        if rejoining(statuses, self.hosts):  # its ranks crashed: the others go on without it until it is back
            return "fault"
        if all(s == "finished" for s in states.values()):
            return "finished"
        if self.regrouped and _finished_without_workers(statuses, self.hosts, self.main):
            return "finished"
        return "running"


def _ranks_alive(status: Mapping[str, Any]) -> bool:
    """Whether a rank (not only the launcher) of the host's job still runs."""
    return any(name.startswith("worker") for name in status.get("pids") or {})


def _finished_without_workers(statuses: Statuses, hosts: list[str], main: str) -> bool:
    """The main rank recorded the run finished and no rank runs anywhere: after a regroup, torchrun's agents on the
    survivors wait at their exit barrier for the lost host's agent, which never comes."""
    if statuses.get(main, {}).get("run_state") != "finished":
        return False
    return not any(_ranks_alive(statuses.get(h, {})) for h in hosts)


def _records(statuses: Statuses, hosts: Iterable[str]) -> list[dict[str, Any]]:
    found = [r for h in hosts for r in statuses.get(h, {}).get("failures") or [] if isinstance(r, dict)]
    return sorted(found, key=lambda r: float(r.get("time") or 0))


def _cause(record: Mapping[str, Any]) -> Cause:
    return Cause(str(record.get("kind")), str(record.get("message")), str(record.get("host")), record.get("rank"))


def root_cause(statuses: Statuses, hosts: list[str], unreachable: Iterable[str]) -> Cause | None:
    """The first cause, not its consequences: a rank's own failure (OOM, an error) before a host that stopped
    answering, before a host whose every job process vanished, before a rank that ended without a record,
    before the collective errors and stops the others saw as a result."""
    records = _records(statuses, hosts)
    for record in records:
        if record.get("kind") not in SECONDARY:
            return _cause(record)
    for host in unreachable:
        error = str(statuses.get(host, {}).get("error") or "no answer").splitlines()[0]
        return Cause("unreachable", f"the host stopped answering the controller ({error})", host)
    for host in hosts:
        if statuses.get(host, {}).get("state") in ("lost", "absent"):
            return Cause(
                "lost", "every process of the job on this host vanished (killed, crashed, or the host rebooted)", host
            )
    for host in hosts:
        status = statuses.get(host, {})
        if status.get("state") != "failed":
            continue
        recorded = {r.get("rank") for r in status.get("failures") or []}
        for rank in status.get("ranks") or []:
            if rank not in recorded:
                return Cause(
                    "vanished",
                    "the rank ended without recording why: killed by a signal (SIGKILL, the kernel's OOM killer) "
                    "or crashed in native code; see its log and the host's kernel log",
                    host,
                    int(rank),
                )
    for host in rejoining(statuses, hosts):
        note = statuses[host]["rejoining"]
        return Cause("crashed", f"{note.get('why') or 'a rank crashed'}; its launcher starts this host's ranks again "
                     "to rejoin the others", host)  # fmt: skip
    for kind in SECONDARY:
        for record in records:
            if record.get("kind") == kind:
                return _cause(record)
    failed = next((h for h in hosts if statuses.get(h, {}).get("state") == "failed"), None)
    if failed is not None:
        code = statuses[failed].get("exit_code")
        return Cause("error", f"torchrun exited with code {code}; see the host's torchrun log", failed)
    return None


def rejoining(statuses: Statuses, hosts: Iterable[str]) -> list[str]:
    """Hosts whose ranks crashed and whose launcher starts them again to rejoin the group (train/recovery/comeback.py):
    the others go on without them meanwhile (a regroup, not a relaunch), and they come back by themselves."""
    return [h for h in hosts if statuses.get(h, {}).get("state") == "running" and statuses[h].get("rejoining")]


def blamed(statuses: Statuses, hosts: list[str], unreachable: Iterable[str]) -> list[str]:
    """Hosts the next launch leaves out: those that stopped answering and those whose job vanished whole.
    A host with a crashed rank but a live launcher stays: its rank is restarted in place."""
    gone = set(unreachable) | {h for h in hosts if statuses.get(h, {}).get("state") in ("lost", "absent")}
    return [h for h in hosts if h in gone]


def regroup_survivors(statuses: Statuses, hosts: list[str], main: str, gone: list[str]) -> list[str] | None:
    """The hosts that can go on in their own processes without ``gone`` (train/recovery/membership.py), or None when the
    fault needs a relaunch: no host is gone (a rank crashed on a host that stays up), a survivor's job is not
    running whole, or the ranks hold pipeline stages. Where the main host is gone, the first survivor takes up
    the run's records (``main_host_for``)."""
    survivors = [h for h in hosts if h not in gone]
    if not gone or not survivors:
        return None
    for host in survivors:
        status = statuses.get(host, {})
        if status.get("state") != "running" or not _ranks_alive(status):
            return None
        if any(part != "the whole model" for part in (status.get("parts") or {}).values()):
            return None
    return survivors


def survivors_regroups(statuses: Statuses, attempt: int, generation: int) -> list[dict[str, Any]]:
    """The regroups of launch ``attempt`` newer than ``generation``, oldest first: those the ranks agreed on
    themselves while no controller followed (train/recovery/consensus.py), and the hosts they took back in after a crash
    (train/recovery/rejoin.py), from the main rank's history in run.json (``regroups``) and every rank's newest
    (``rank_regrouped``)."""
    found: dict[int, dict[str, Any]] = {}
    for status in statuses.values():
        newest = status.get("rank_regrouped")
        earlier = newest.get("earlier") if isinstance(newest, dict) else None
        for record in [newest, *(status.get("regroups") or []), *(earlier if isinstance(earlier, list) else [])]:
            if not isinstance(record, dict) or record.get("attempt") != attempt or not record.get("hosts"):
                continue
            number = int(record.get("generation") or 0)
            if number > generation:
                found.setdefault(number, record)
    return [found[number] for number in sorted(found)]


def adopted(
    agreed: list[dict[str, Any]], hosts: list[str], inventory: list[str], restarts_before: int,
    lent: Iterable[str] = (),
) -> tuple[list[Restart], tuple[list[str], str, int]]:  # fmt: skip
    """The survivors' own regroups (``survivors_regroups``) as the run's restarts, numbered after
    ``restarts_before``, and the hosts, main host and generation the run has after them. ``lent``: the hosts taken
    back from the run before these (train/recovery/lending.py), so that one coming back is told from a crashed one."""
    restarts: list[Restart] = []
    main, generation = hosts[0], 0
    away = set(lent)
    for record in agreed:
        after = [str(h) for h in record["hosts"]]
        left = [h for h in hosts if h not in after]
        main, generation = str(record.get("main") or after[0]), int(record["generation"])
        step = int(record.get("from_step") or 0)
        decided_by = str(record.get("decided_by") or "survivors")
        if decided_by == "rejoin":
            came = [h for h in after if h not in hosts]
            why = ("lent to the run again, its ranks came back into the group" if set(came) <= away else
                   "its ranks crashed, were started again and came back into the group")  # fmt: skip
            cause = Cause("rejoined", why, ", ".join(came) or "?")
            away -= set(came)
        elif decided_by == "released":
            cause = Cause("lent", f"{record.get('cause') or 'taken back'}; the others went on without it",
                          ", ".join(left) or "?")  # fmt: skip
            away |= set(left)
        else:
            cause = Cause("lost", "its job was gone or it did not answer; the survivors went on without it",
                          ", ".join(left) or "?")  # fmt: skip
        restart = Restart(
            attempt=restarts_before + len(restarts) + 1, time=float(record.get("time") or 0.0), cause=cause,
            hosts_before=hosts, hosts_after=after, left_out=[h for h in inventory if h not in after],
            main_host=main, checkpoint_step=None, last_step_seen=step, how="regroup",
            regroup_s=record.get("seconds"), decided_by=decided_by,
        )  # fmt: skip
        restart.settle(step, step)  # nothing redone: the survivors went on from the newest step any of them had
        restarts.append(restart)
        hosts = after
    return restarts, (hosts, main, generation)


def main_host_for(hosts: list[str], preferred: str) -> str:
    """The rendezvous (and main) host of a relaunch: the same one while it takes part, else the first left."""
    return preferred if preferred in hosts else hosts[0]


def replicas_for(hosts: list[str], main: str, count: int) -> list[str]:
    """The hosts besides the main one that keep a copy of every checkpoint (``checkpoint.replicas``)."""
    return [h for h in hosts if h != main][:count]
