"""Who is left after a lost host, agreed by the survivors themselves when no controller follows the run.

A controller that follows the run names the survivors (``playbooks/regroup.yml`` writes ``membership.json``:
train/recovery/watch.py ``Watcher``). Once the user pressed Ctrl-C, closed the terminal, or the laptop that ran the
controller went to sleep, nobody would: the survivors would wait ``distributed.regroup_timeout_s`` and fail. So
each host records when the following controller last asked it, and while that is older than three of its polls the
ranks decide themselves. The record is the node exporter's where the controller polls it over HTTP
(``/run/ugro-exporter/followed/<job-id>/<host>.json``: only a poll from the controller's address sets it,
ugro/module_utils/ugro_exporter.py ``FollowMarks``), and ``hosts/<host>/followed.json`` where it polls through
Ansible or reads its own checkout (written as the job's user: ugro/module_utils/ugro_jobstate.py ``mark_followed``):

- ``probe``: every other host's regroup store, a TCP connect each, ``watch.SILENT_AFTER`` rounds. A refused
  connect is a host that is up but whose job is gone (``down``); one that never answers is a cut link or a dead
  host (``silent``).
- ``propose``: the hosts that answered go on, if they are more than half of the hosts that may still run (every
  host but the ``down`` ones). Two halves that cannot reach each other cannot both have a majority, so a network
  split never leaves two groups training apart; a 1-1 split waits for a controller (``make follow``). The main
  host stays where it is, or moves to the first survivor in rank order: the controller's rule too
  (ugro/run/recovery.py ``main_host_for``; the ranks' host order is the launch's node order).
- ``agree``: the first proposal to reach the new main host's store wins (``compare_set``), and every rank takes
  that one, so ranks whose probes differed still form the same group, or none (the group's forming times out).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from train.recovery import jobkey, storedata
from train.recovery.group import Group
from train.recovery.watch import HEARTBEAT_S, SILENT_AFTER

log = logging.getLogger(__name__)

FOLLOWED = "followed.json"  # ugro/module_utils/ugro_jobstate.py FOLLOWED
AGREE_TRIES = 8  # keys tried when the store holds values no survivor proposed
FOLLOW_GRACE_S = 10.0  # beyond three polls: a playbook poll's own time on a busy controller
EXPORTER_MARKS = Path("/run/ugro-exporter/followed")  # ugro/module_utils/ugro_exporter.py STATE_DIR / FOLLOWED_DIR


def controller_follows(run_dir: Path, host: str, now: float | None = None, marks: Path = EXPORTER_MARKS) -> bool:
    """Whether a controller asked this host recently enough that it will name who is left after a fault: the node
    exporter's record of its polls (in ``marks``) or the run's own."""
    now = time.time() if now is None else now
    records = (marks / run_dir.name / f"{host}.json", run_dir / "hosts" / host / FOLLOWED)
    return any(_asked_within(path, now) for path in records)


def _asked_within(record: Path, now: float) -> bool:
    try:
        found = json.loads(record.read_text(encoding="utf-8"))
        asked, poll_s = float(found["time"]), float(found["poll_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return now - asked <= 3 * poll_s + FOLLOW_GRACE_S


@dataclass(frozen=True)
class View:
    """This rank's view of the other hosts: those whose job is gone, and those that do not answer at all."""

    down: frozenset[str]
    silent: frozenset[str]

    @property
    def gone(self) -> frozenset[str]:
        return self.down | self.silent


def probe(stores: dict[str, str], rounds: int = SILENT_AFTER, timeout_s: float = HEARTBEAT_S) -> View:
    """Connect to every host's regroup store (host -> address:port) ``rounds`` times: refused on the last round is
    ``down``, no answer on every round ``silent``."""
    unanswered: dict[str, int] = {}
    refused: set[str] = set()
    for round_ in range(rounds):
        began = time.monotonic()
        for host, endpoint in stores.items():
            address, port = endpoint.rsplit(":", 1)
            try:
                socket.create_connection((address, int(port)), timeout=timeout_s).close()
                refused.discard(host)
            except ConnectionRefusedError:
                refused.add(host)
            except OSError:
                refused.discard(host)
                unanswered[host] = unanswered.get(host, 0) + 1
        if round_ < rounds - 1:
            time.sleep(max(0.0, timeout_s - (time.monotonic() - began)))
    silent = {h for h, n in unanswered.items() if n >= rounds}
    return View(frozenset(refused), frozenset(silent))


def propose(group: Group, view: View) -> Group | None:
    """The group after ``group`` that ``view`` supports, or None: nobody is gone (a frozen rank, a crashed one whose
    host's store still answers: the controller's to judge), or the hosts that answer are no majority of those that
    may still run."""
    if not view.gone:
        return None
    hosts = group.members
    alive = group.without(view.gone)
    may_run = len(hosts) - len(view.down & set(hosts))
    if 2 * len(alive) <= may_run:
        return None
    return group.survivors(group.generation + 1, alive, group.main if group.main in alive else alive[0])


def agree(proposal: Group, store: dist.Store, current: Group, key: bytes, tries: int = AGREE_TRIES) -> Group:
    """The group the survivors of ``current`` take for ``proposal``'s generation: the first proposed at the new main
    host's store (``store``), this one if it came first. Each is proven with the run's key (train/recovery/jobkey.py);
    a value there that no survivor could have proposed (anyone who reaches the store can write it first) is refused,
    named in the log, and the next key tried: every survivor reads the same values in the same order, so they skip
    the same ones and still agree."""
    fields = proposal.proposal()
    mine = json.dumps(fields | {"proof": jobkey.proof(key, fields)})
    for attempt_key in range(tries):
        name = f"ugro-membership-{current.attempt}-{proposal.generation}" + (f"-{attempt_key}" if attempt_key else "")
        decided = storedata.membership(bytes(store.compare_set(name, "", mine)), current, proposal.generation, key)
        if isinstance(decided, Group):
            return decided
        log.warning("refused the membership under %s in %s's store: %s", name, proposal.main, decided)
    raise RuntimeError(f"no membership could be agreed in {proposal.main}'s store: {tries} keys held values no "
                       "survivor could have proposed")  # fmt: skip
