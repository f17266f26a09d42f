"""The rank's membership in the run's group: what it holds alive, who may propose the next group, and the one
transition that takes the rank into it.

A ``Membership`` is owned by the rank (train/worker.py makes it, train/loop.py uses it) and holds everything that
lives as long as the rank does and belongs to the group: the group itself (train/recovery/group.py), this host's
regroup store, the group's health (train/dist/health.py), the watcher of the controller's proposals and the
heartbeat (train/recovery/watch.py), the broken groups kept until exit, the door where hosts ask to rejoin
(train/recovery/door.py) and the scheduler's preemption warning (train/recovery/preempt.py).

Three deciders may propose the next group, each as a ``Change``, and only at the loop's one commit point, between two
steps (or where a step broke off):

- the controller that follows the run names the survivors of a lost host (``after_loss``: its proposal file);
- where none follows, the survivors agree among themselves (``after_loss``: train/recovery/consensus.py);
- the main rank takes in hosts whose ranks came back (``after_step``: announced through the step's exchange), and a
  host that came back asks for its place (``come_back``);
- a host whose owner takes it back (train/recovery/lending.py) leaves after a step: its ranks say so in the step's
  exchange, so every rank decides the same group without asking anyone (``after_step``).

``enter`` applies any of them the same way: form the new process group through the main host's store, agree on the
step (the newest any member completed), take the state of a member that holds it, re-wrap the model and re-plan the
shares, and record it. Nothing is redone; no checkpoint is read.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from train.config import JobConfig
from train.dist import comm, distributed
from train.dist.distributed import RankInfo, StoreServer
from train.dist.health import GroupHealth, GroupLost
from train.layout import engine
from train.metrics import RANK_STATUS, last_logged_step, write_status
from train.recovery import comeback, consensus, failure, jobkey, lending, rejoin
from train.recovery.door import Door
from train.recovery.group import Group
from train.recovery.preempt import Preemption
from train.recovery.watch import Heartbeat, Watcher, scheduler

log = logging.getLogger(__name__)

AGREE_EVERY_S = 0.5  # between two looks for a controller's word or the survivors' own view


@dataclass(frozen=True)
class Change:
    """A proposed next group, this rank's place in it, who decided it and why."""

    group: Group
    rank: int
    decided_by: str  # "controller", "survivors" (a host was lost), "rejoin" (hosts taken back in), "released"
    cause: str
    began: float  # time.time() when the rank began the change

    @property
    def grows(self) -> bool:
        return self.decided_by == "rejoin"

    @property
    def leaves(self) -> bool:
        """This rank's host was taken back: the rank leaves the run (``rank`` is -1)."""
        return self.rank < 0


class Training(Protocol):
    """What a change of group carries over: the rank's training state (train/loop.py ``Rank``)."""

    trainer: engine.Engine
    optimizer: torch.optim.Optimizer
    scheduler: Any
    run_dir: Path
    job: JobConfig


class Membership:
    """One rank's membership in the group (see the module)."""

    def __init__(self, info: RankInfo, server: StoreServer | None, run_dir: Path, job: JobConfig,
                 health: GroupHealth) -> None:  # fmt: skip
        self.info = info
        self.group = Group(info.attempt, 0, info.hosts, info.hosts[info.main_rank], info.stores, job.cluster_hash())
        self.server, self.run_dir, self.job, self.health = server, run_dir, job, health
        self.preemption = Preemption(health)
        self.door = Door()
        self.watcher: Watcher | None = None
        self.heartbeat: Heartbeat | None = None
        self.history: list[dict[str, Any]] = []  # the changes this rank went through, for the run's records
        self.refused: set[float] = set()  # requests to take a host back that were refused (logged once each)
        # Broken groups and the DDP wrappers over them, kept until the process ends (train/dist/distributed.py
        # ``form`` says why): held by the exit handlers' list, destroyed only after ``finish`` let their work end.
        self.retired: list[Any] = []
        atexit.register(self.retired.__len__)

    # -- watching --------------------------------------------------------------------------------------------------

    def watch(self, publish: bool, group: Group | None = None) -> None:
        """Ranks on several hosts watch their group (and go on without a lost host); ``publish``: where a host whose
        ranks crash may come back, this host's first rank publishes the group for them."""
        group = group or self.group
        if len(group.members) < 2 or self.watcher is not None:
            return
        self.health.watched = True
        self.watcher = Watcher(self.run_dir, self.info.host, self.group, self.health)
        if self.info.local_rank == 0:
            # Under a batch scheduler the stores' addresses are the main host's (its node script names no cluster
            # address) and every rank ends at once: the heartbeat only reports there.
            health = None if scheduler() is not None else self.health
            self.heartbeat = Heartbeat(self.run_dir, self.info.host, group.peers(self.info.host), health,
                                       group.generation)  # fmt: skip
        if publish:
            self.publish()

    def publish(self) -> None:
        """This host's first rank: the group as it is now, for ranks of its host that come back; the main rank keeps
        the door."""
        if self.info.local_rank != 0:
            return
        store = self.server.store if self.server is not None else None
        rejoin.publish(self.run_dir, self.info.host, self.group, store)
        self.door.keep(store if self.info.is_main else None, self.info.attempt)

    def lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` ended a step because the group lost a member. Not a non-finite loss: every rank found it,
        and going on would repeat it."""
        return not isinstance(exc, failure.NonFiniteError) and self.health.lost(exc)

    # -- the deciders ------------------------------------------------------------------------------------------------

    def wanted_back(self, in_place: bool) -> int:
        """At a step's start: whether this rank's host is wanted back (its term of the step's exchange: 0, or who
        wants it: train/recovery/lending.py ``CODES``). Only where the group can go on without it: ranks of several
        hosts that each hold the whole model."""
        asked = lending.request(self.host_dir)
        if asked is None or self.watcher is None:
            return 0
        if not in_place:
            self._refuse(asked, "the ranks hold pipeline stages, cut for the hosts that hold them: `make stop` and "
                                "`make train RESUME=auto` re-cut them for the hosts left")  # fmt: skip
            return 0
        return asked.code

    @property
    def host_dir(self) -> Path:
        return self.run_dir / "hosts" / self.info.host

    def _refuse(self, asked: lending.Request, why: str) -> None:
        if asked.since not in self.refused:
            self.refused.add(asked.since)
            log.warning("%s; refused: %s", asked.line(self.info.host), why)

    def after_step(self, proposed: int, leavers: dict[int, int] | None = None) -> Change | None:
        """After a step whose exchange summed ``proposed`` (the main rank's count of hosts at its door) and named
        ``leavers`` (ranks whose host is wanted back, and by whom): collective over the group. Hosts wanted back
        leave first (the hosts at the door wait for the next step); else the main rank proposes the group grown by
        those at its door. None when the group stays as it is."""
        if leavers:
            return self._release(leavers)
        if proposed <= 0:
            return None
        began = time.time()
        grown = self.door.propose(self.group, jobkey.ensure(self.run_dir)) if self.info.is_main else None
        chosen = self.health.gather_objects(grown, comm.control_group())[self.info.main_rank]
        if chosen is None:
            return None
        came = ", ".join(h for h in chosen.members if h not in self.group.members)
        return Change(chosen, self.info.rank, "rejoin", f"{came} came back", began)

    def _release(self, leavers: dict[int, int]) -> Change | None:
        """The group without the hosts wanted back, decided alike on every rank from the step's exchange. The main
        host, where it leaves, hands the run's records to the first host that stays. Every rank stops watching the
        leaving hosts before they go (one barrier of the old group), so that their ending breaks nothing."""
        began, group = time.time(), self.group
        going = {group.hosts[r]: code for r, code in sorted(leavers.items())}
        staying = group.without(frozenset(going))
        if not staying:  # nobody would train: the run goes on, the request stays until it is withdrawn
            asked = lending.request(self.host_dir)
            if asked is not None:
                self._refuse(asked, f"{', '.join(going)} {'is' if len(going) == 1 else 'are'} the last host(s) of "
                                    "the run; `make stop` ends the run (its checkpoints stay: `make train "
                                    "RESUME=auto` continues)")  # fmt: skip
            return None
        main = group.main if group.main in staying else staying[0]
        after = group.survivors(group.generation + 1, staying, main)
        if self.heartbeat is not None:  # the leaving hosts are no peers any more; a leaving host watches nobody
            self.heartbeat.follow(after) if self.info.host in staying else self.heartbeat.stop()
        self.health.gather_objects(None, comm.control_group())  # every rank has let go of the leaving hosts
        own = lending.request(self.host_dir) if self.info.host in going else None
        cause = "; ".join(own.line(h) if own is not None and h == self.info.host else lending.taken_back(h, code)
                          for h, code in going.items())  # fmt: skip
        rank = group.survivor_rank(self.info.rank, after)
        return Change(after, -1 if rank is None else rank, "released", cause, began)

    def after_loss(self, exc: Exception, done: int, in_place: bool) -> Change:
        """A peer is gone (``exc`` broke step ``done`` + 1): the group of the survivors, as the controller names it
        or the survivors agree it. Raises ``exc`` when it was no group loss, when a relaunch must re-cut a pipeline's
        stages, or when nobody names who is left within ``distributed.regroup_timeout_s`` (a controller then
        relaunches from a checkpoint); GroupLost when this rank cannot go on in the group named. ``in_place``: whether
        the rank's engine can go on in a new group (a pipeline's stages cannot: a relaunch re-cuts them)."""
        if not self.lost(exc) or not in_place:
            raise exc
        began = time.time()
        log.warning("step %d: the group lost a member (%s); learning who is left, for up to %d s",
                    done + 1, failure.one_line(exc), self.job.distributed.regroup_timeout_s)  # fmt: skip
        found = self._who_is_left()
        if found is None:
            raise exc
        group, decided_by = found
        if group.main != self.group.main and self.group.main in group.members:  # it moves only when it is lost
            raise GroupLost(f"the new membership moved the main host from {self.group.main}, which is left, to "
                            f"{group.main}")  # fmt: skip
        rank = self.group.survivor_rank(self.info.rank, group)
        if rank is None:
            raise GroupLost(f"the new membership left this host out of the group ({', '.join(group.members)})")
        return Change(group, rank, decided_by, failure.one_line(exc), began)

    def _who_is_left(self) -> tuple[Group, str] | None:
        """The group to go on in, and who decided it ("controller" or "survivors"), or None after
        ``distributed.regroup_timeout_s``.

        While a controller follows the run (it asked this host within three of its polls), or a batch scheduler runs
        it, the controller's word is awaited; otherwise the survivors probe each other and agree
        (train/recovery/consensus.py). A controller that stops asking in the meantime (its laptop went to sleep)
        leaves the decision to the survivors."""
        assert self.watcher is not None  # only a watched group is lost
        deadline = time.monotonic() + self.job.distributed.regroup_timeout_s
        host = self.info.host
        while True:
            found = self.watcher.newer(min(AGREE_EVERY_S, max(0.0, deadline - time.monotonic())))
            if found is not None:
                return found, "controller"
            if time.monotonic() >= deadline:
                return None
            if scheduler() is not None or consensus.controller_follows(self.run_dir, host):
                continue
            proposal = consensus.propose(self.group, consensus.probe(self.group.peers(host)))
            if proposal is None:
                continue
            try:
                store = self.store_of(proposal.main, self.group)
                agreed = consensus.agree(proposal, store, self.group, jobkey.ensure(self.run_dir))
                return agreed, "survivors"
            except (RuntimeError, GroupLost) as exc:  # the new main host went too: look again
                log.warning("could not agree on %s through %s's store: %s", ", ".join(proposal.members),
                            proposal.main, failure.one_line(exc))  # fmt: skip

    def come_back(self, in_place: bool) -> Change:
        """This host's ranks were started again after a crash (train/recovery/rejoin.py): find the running group, ask
        to come in, and take the place it gives."""
        began = time.time()
        if not in_place:
            raise failure.RejoinError("a pipeline's stages cannot be rejoined: a controller relaunches the run")
        timeouts = (self.job.distributed.startup_timeout_s, self.job.distributed.timeout_s)
        grown, rank = rejoin.come_in(self.run_dir, self.info, self.group.job_hash, timeouts, self.health)
        self.watch(publish=False, group=grown)
        return Change(grown, rank, "rejoin", f"{self.info.host} came back", began)

    def store_of(self, host: str, group: Group) -> dist.Store:
        """``host``'s regroup store: this process's own where ``host`` is this rank's and it serves it, else a client
        of the store ``group`` names."""
        if self.server is not None and host == self.info.host:
            return self.server.store
        endpoint = group.store_of(host)
        if endpoint is None:
            raise GroupLost(f"no regroup store is known for the new main host {host}")
        return distributed.endpoint_store(endpoint, self.job.distributed.timeout_s)

    # -- the one transition ------------------------------------------------------------------------------------------

    def enter(self, change: Change, training: Training, done: int) -> dict[str, Any]:
        """Every member of the next group, in it: form the group, agree on the step, take the state of the rank that
        holds it, re-wrap the model and re-plan the shares; record it. ``done``: the steps this rank completed (-1: it
        has just come back). Returns the record for this rank's status file (``from_step``: where it goes on)."""
        before, group = self.info, change.group
        main_before = self.group.main
        new = RankInfo(change.rank, before.local_rank, group.world_size, before.host, before.device, group.main_rank,
                       group.hosts, group.attempt, group.stores)  # fmt: skip
        kind = "grow" if change.grows else "regroup"  # apart in the store: a failed grow leaves nothing a regroup reads
        prefix = f"ugro-{kind}-{group.attempt}-{group.generation}"
        distributed.form(new, self.store_of(group.main, group), prefix, self.job.distributed.timeout_s, self.retired)
        self.info, self.group = new, group
        if change.grows and done < 0 and new.local_rank == 0:
            rejoin.clear_mark(self.run_dir, new.host)  # the launcher's note that this host is coming back is answered
            lending.back(self.host_dir)
        if self.heartbeat is not None:
            self.heartbeat.follow(group)  # the lost hosts are no peers any more, the hosts taken in are
        if self.watcher is not None:
            self.watcher.joined(group)
        self.health.renewed()
        # A step the change broke off left its gradients (this rank's own, not reduced, scaled for the old group): the
        # step is taken again from none, as after an update. Kept, the new DDP wrapper would copy them into its
        # buckets (gradient_as_bucket_view) and the step's backward would add to them on every survivor alike.
        training.optimizer.zero_grad(set_to_none=True)
        target, source, behind = agree_step(done, self.health)
        if behind:
            share_state(training.optimizer, training.scheduler, source, self.health)
        how = training.trainer.regroup(new, source, self.retired)
        if change.grows:
            rejoin.catch_up(self.run_dir, new, done < 0, self.health)
        if new.rank != before.rank:
            (self.run_dir / "hosts" / before.host / RANK_STATUS.format(rank=before.rank)).unlink(missing_ok=True)
        self.publish()
        return self._record(change, target, done, how, main_before, training)

    def _record(self, change: Change, target: int, done: int, how: str, main_before: str,
                training: Training) -> dict[str, Any]:  # fmt: skip
        """The change in the log, in the rank's status file and, on the main rank, in run.json."""
        group, new = change.group, self.info
        seconds = round(time.time() - change.began, 2)
        record = {"generation": group.generation, "attempt": group.attempt, "from_step": target, "seconds": seconds,
                  "hosts": list(group.members), "main": group.main, "decided_by": change.decided_by,
                  "time": round(time.time(), 3), "cause": change.cause}  # fmt: skip
        log.info("%s %d (%s decided): rank %d of %d on %s, from step %d (%d step(s) applied by another rank only), "
                 "in %.2f s: %s", "rejoin" if change.grows else "regroup", group.generation, change.decided_by,
                 new.rank, new.world_size, ", ".join(group.members), target, target - max(done, 0), seconds,
                 how)  # fmt: skip
        self.history.append(record | {"main_before": main_before})
        if new.is_main:
            regrouped = record | {"last_step_logged": last_logged_step(self.run_dir), "world_size": new.world_size,
                                  "main_before": main_before}  # fmt: skip
            # Every change of this launch, also where no controller followed: this rank went through each of them.
            write_status(self.run_dir, world_size=new.world_size, plan=training.trainer.balancer.plan.to_dict(),
                         regrouped=regrouped, regroups=self.history)  # fmt: skip
        # The rank's status file keeps the launch's earlier changes too: a controller that takes the run up reads the
        # whole history from any host, also where a rejoin followed a regroup before it looked.
        return record | {"earlier": [dict(r) for r in self.history[:-1]]}

    def finish(self) -> None:
        """The last step is done: the peers end their processes from now on, which breaks no group."""
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def settle(self) -> None:
        """Before the process ends: the collectives that a change abandoned end first (at most the collective
        timeout), so that the retired groups are destroyed at exit without waiting on them. After a change of group,
        the host's launcher is told that the run is over here (train/recovery/comeback.py ``EndWatch``)."""
        if self.watcher is not None:
            self.health.settle(self.job.distributed.timeout_s)
        if self.group.generation > 0 and self.info.local_rank == 0:
            comeback.ended(self.host_dir, self.group.attempt, self.group.generation)


def agree_step(done: int, health: GroupHealth) -> tuple[int, int, int]:
    """Collective over the new group: the step to continue from (the newest any member completed), the lowest rank
    that completed it (whose state the others take), and how many ranks had not."""
    mine = comm.tensor([done, dist.get_rank()], torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    rows = health.result(comm.all_gather(everyone, mine, async_op=True), lambda: [t.tolist() for t in everyone])
    target = max(row[0] for row in rows)
    source = min(row[1] for row in rows if row[0] == target)
    behind = sum(1 for row in rows if row[0] < target)
    if behind:
        log.info("regroup: %d rank(s) had not applied step %d; they take rank %d's state", behind, target, source)
    return target, source, behind


def share_state(optimizer: torch.optim.Optimizer, scheduler: Any, source: int, health: GroupHealth) -> None:
    """Collective: every rank takes ``source``'s optimizer and scheduler state (the weights follow with the
    re-wrap's broadcast of the trainable parameters)."""
    mine = (optimizer.state_dict(), scheduler.state_dict()) if dist.get_rank() == source else None
    payload = health.broadcast_objects(mine, source)
    if dist.get_rank() != source:
        optimizer_state, scheduler_state = payload
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(scheduler_state)


def weights_digest(params: list[torch.nn.Parameter]) -> str:
    """sha256 of the trainable weights' bytes, in order (every member's must be the same after a change)."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
