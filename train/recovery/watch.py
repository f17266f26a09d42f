"""What tells a rank that its group is broken or that a newer group is proposed, besides a failed collective.

``Watcher``: a thread reading this host's proposal file from the controller (``hosts/<host>/membership.json``, written
by ``playbooks/regroup.yml``: the survivors the controller names after a lost host). A newer generation than the
rank's group breaks the group (``GroupHealth.fail``) and wakes a rank waiting to learn who is left
(train/recovery/membership.py).

``Heartbeat``: a thread on each host's first rank that connects to the other hosts' regroup stores; a peer that turns
silent or refuses breaks the group too, and the silent ones are written where the controller reads them. What it
finds lost is written for the host's other ranks as well (``hosts/<host>/lost.json``), whose watchers break their
group on it: they run no heartbeat, and a collective waiting on a dead NCCL peer ends only at the watchdog's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from train.dist.health import GroupHealth
from train.recovery.group import Group

log = logging.getLogger(__name__)

MEMBERSHIP = "membership.json"
LOST = "lost.json"  # hosts/<host>/lost.json: the hosts this host's heartbeat lost, for its other ranks
POLL_S = 0.2
# hosts/<host>/peers.json: the hosts this host cannot reach (ugro/module_utils/ugro_jobstate.py reads it).
PEERS = "peers.json"
HEARTBEAT_S = 0.5  # between two rounds of connects to the peers, and each connect's timeout
SILENT_AFTER = 2  # failed connects in a row before a peer counts as silent


class Watcher:
    """Reads this host's proposal file every POLL_S seconds; a generation newer than the rank's group breaks the group
    (``health.fail``) and wakes a rank waiting in ``newer``. The proposal names the surviving hosts; the group it
    proposes is the rank's group without the others (``Group.survivors``)."""

    def __init__(self, run_dir: Path, host: str, group: Group, health: GroupHealth) -> None:
        self.path = run_dir / "hosts" / host / MEMBERSHIP
        self.lost_path = run_dir / "hosts" / host / LOST
        self.health = health
        self.group = group  # the group this rank is in
        self.started = time.time()  # a heartbeat's word older than this rank is an earlier launch's
        self._newest: tuple[int, tuple[str, ...], str] | None = None  # (generation, hosts, main) proposed
        self._changed = threading.Event()
        self.path.unlink(missing_ok=True)  # a proposal of an earlier launch is not this one's
        threading.Thread(target=self._watch, name="ugro-membership", daemon=True).start()

    def _watch(self) -> None:
        mtime = 0.0
        while True:
            time.sleep(POLL_S)
            self._heard_lost()
            try:
                stamp = self.path.stat().st_mtime
            except OSError:
                continue
            if stamp == mtime:
                continue
            found = read_proposal(self.path)
            if found is None:
                continue
            mtime = stamp
            generation, hosts, _ = found
            if generation > self.group.generation:
                self._newest = found
                self.health.fail(f"the controller named a new membership (generation {generation}: "
                                 f"{', '.join(hosts)})")  # fmt: skip
                self._changed.set()

    def _heard_lost(self) -> None:
        """The host's heartbeat (on its first rank) lost a peer of this rank's group: the group is broken here too."""
        try:
            found = json.loads(self.lost_path.read_text(encoding="utf-8"))
            generation, lost, when = int(found["generation"]), [str(h) for h in found["lost"]], float(found["time"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if when >= self.started and generation == self.group.generation and self.health.broken is None:
            self.health.fail(f"this host's heartbeat cannot reach the regroup store of {', '.join(lost)}")

    def newer(self, timeout_s: float) -> Group | None:
        """Wait up to ``timeout_s`` for a proposal newer than the rank's group: the group it proposes."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self._newest
            if found is not None and found[0] > self.group.generation:
                return self.group.survivors(*found)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(min(left, POLL_S))
            self._changed.clear()

    def joined(self, group: Group) -> None:
        self.group = group


def read_proposal(path: Path) -> tuple[int, tuple[str, ...], str] | None:
    """The controller's proposal (generation, surviving hosts, main host), or None while absent or being replaced."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return int(data["generation"]), tuple(str(h) for h in data["hosts"]), str(data["main"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the next read sees it whole


class Heartbeat:
    """This host's view of its peers, from its first rank: every HEARTBEAT_S seconds a TCP connect to each peer's
    regroup store (open from the start on every host). A refused connect is an answer: the host is up and only its
    job's process is gone (a killed rank is the controller's to tell, from the host's own status; counting its
    host silent would make a crash look like a cut link). The peers whose connects went unanswered (a time-out,
    no route) SILENT_AFTER times in a row are written to ``hosts/<host>/peers.json`` ({"silent": [host, ...]})
    whenever the list changes; the controller's status poll reads it, and a host that neither the controller nor
    its peers can reach is gone after one poll instead of two (ugro/run/recovery.py ``Watch``).

    A peer that turns silent or refuses breaks the group (``health.fail``): a collective waiting on a cut link hears
    no reset and would wait out ``distributed.timeout_s``, and a dead NCCL peer is not always noticed either. The
    loop stops the heartbeat when its last step is done: a peer that then ends its process breaks nothing."""

    def __init__(self, run_dir: Path, host: str, peers: dict[str, str], health: GroupHealth | None = None,
                 generation: int = 0) -> None:  # fmt: skip
        self.path = run_dir / "hosts" / host / PEERS
        self.lost_path = run_dir / "hosts" / host / LOST
        self.generation = generation  # of the group whose peers it watches
        self.host = host
        self.health = health  # None: it only reports (under a batch scheduler)
        self._peers = dict(peers)  # host -> address:port of its regroup store
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.path.unlink(missing_ok=True)  # an earlier launch's view is not this one's
        threading.Thread(target=self._beat, name="ugro-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def follow(self, group: Group) -> None:
        """After a change of group: the other hosts of the new group are the peers."""
        with self._lock:
            self._peers = group.peers(self.host)
            self.generation = group.generation

    def _beat(self) -> None:
        failed: dict[str, int] = {}
        written: list[str] = []
        while not self._stopped.is_set():
            with self._lock:
                peers = dict(self._peers)
            refused: list[str] = []
            for host, endpoint in peers.items():
                address, port = endpoint.rsplit(":", 1)
                try:
                    socket.create_connection((address, int(port)), timeout=HEARTBEAT_S).close()
                    failed[host] = 0
                except ConnectionRefusedError:
                    failed[host] = 0  # the host answered: it is up, its rank is not (the controller's poll says so)
                    refused.append(host)
                except OSError:
                    failed[host] = failed.get(host, 0) + 1
            silent = sorted(h for h in peers if failed.get(h, 0) >= SILENT_AFTER)
            with self._lock:  # a regroup may have left them out since this round began (``keep``)
                lost = sorted(h for h in {*silent, *refused} if h in self._peers)
                generation = self.generation
            if lost and self.health is not None and not self._stopped.is_set():
                self.health.fail(f"cannot reach the regroup store of {', '.join(lost)}")
                _write(self.lost_path, {"generation": generation, "lost": lost, "time": round(time.time(), 3)})
            if silent != written:
                _write(self.path, {"silent": silent, "time": round(time.time(), 3)})
                written = silent
                if silent:
                    log.warning("cannot reach the regroup store of %s", ", ".join(silent))
            self._stopped.wait(HEARTBEAT_S)


def _write(path: Path, data: dict[str, object]) -> None:
    """``data`` as ``path``'s JSON, whole for any reader (replaced, never written in place)."""
    partial = path.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(json.dumps(data), encoding="utf-8")
    os.replace(partial, path)


# Where a batch scheduler runs the job, its scancel, preemption or time limit ends every rank at nearly the same
# moment: a rank that outlived the others by a second must not take the run over. There the survivors never decide
# themselves (they wait for a proposal and then fail, and the scheduler's requeue resumes).
SCHEDULERS = {"SLURM_JOB_ID": "SLURM", "KUBERNETES_SERVICE_HOST": "Kubernetes"}


def scheduler() -> str | None:
    """The batch scheduler that runs this rank (SLURM, Kubernetes), or None on ugro's own launch."""
    return next((name for variable, name in SCHEDULERS.items() if os.environ.get(variable)), None)
