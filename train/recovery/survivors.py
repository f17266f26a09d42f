"""What a surviving rank does when its group lost a member: learn who is left (the following controller's word, or
the survivors' own agreement where no controller follows: train/recovery/consensus.py), form the new group, agree on the
step, and go on in the same process (train/recovery/regroup.py has the group's mechanics)."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from train.config import JobConfig
from train.dist import distributed
from train.dist.distributed import RankInfo
from train.layout import engine
from train.metrics import RANK_STATUS, last_logged_step, write_status
from train.recovery import consensus, failure, jobkey, regroup, rejoin

log = logging.getLogger(__name__)


def weights_digest(params: list[torch.nn.Parameter]) -> str:
    """sha256 of the trainable weights' bytes, in order."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def go_on(
    lost: Exception,
    watch: regroup.Watcher,
    info: RankInfo,
    trainer: engine.Engine,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    done: int,
    run_dir: Path,
    job: JobConfig,
) -> tuple[RankInfo, dict[str, Any]]:
    """A peer is gone: learn who is left, form the new group, agree on the step, go on.
    Where the main host is the one lost, the membership names another; its local rank 0 takes up the run's
    records (the caller starts them: train/loop.py). Raises ``lost`` when nobody names who is left within
    ``distributed.regroup_timeout_s`` (a controller then relaunches from a checkpoint), or when this rank
    cannot go on in the new group. ``done``: the steps this rank
    completed; returns its new place and the regroup's record for its status file (``from_step``: where it goes on)."""
    began = time.time()
    log.warning("step %d: the group lost a member (%s); learning who is left, for up to %d s",
                done + 1, failure.one_line(lost), job.distributed.regroup_timeout_s)  # fmt: skip
    main_host = info.hosts[info.main_rank]
    if not trainer.in_place:  # a relaunch re-cuts the stages: nobody need be named
        raise lost
    found = who_is_left(watch, info, run_dir, job.distributed.regroup_timeout_s, job.distributed.timeout_s)
    if found is None:
        raise lost
    membership, decided_by = found
    if membership.main != main_host and main_host in membership.hosts:  # the main host moves only when it is lost
        raise regroup.GroupLost(f"the new membership moved the main host from {main_host}, which is left, to "
                                f"{membership.main}")  # fmt: skip
    new = distributed.rejoin(info, membership, job.distributed.timeout_s)
    return settle(new, membership, decided_by, failure.one_line(lost), began, info, trainer, optimizer, scheduler, done,
                  run_dir, job)  # fmt: skip


def come_back(
    info: RankInfo,
    trainer: engine.Engine,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    run_dir: Path,
    job: JobConfig,
) -> tuple[RankInfo, dict[str, Any]]:
    """This host's ranks were started again after a crash (train/recovery/rejoin.py): find the running group, ask to
    come in, form the grown group and take the step, weights and optimizer state from a member. Returns this rank's
    place and the record for its status file (``from_step``: where it goes on)."""
    began = time.time()
    if not trainer.in_place:
        raise failure.RejoinError("a pipeline's stages cannot be rejoined: a controller relaunches the run")
    grown, rank = rejoin.come_in(run_dir, info, job.cluster_hash(), job.distributed.startup_timeout_s,
                                 job.distributed.timeout_s)  # fmt: skip
    peers = {h: e for h, e in grown.stores if h != info.host} if info.local_rank == 0 else None
    watch = regroup.start(run_dir, info.host, peers)
    new = distributed.enter(info, grown, rank, job.distributed.timeout_s)
    if info.local_rank == 0:
        rejoin.clear_mark(run_dir, info.host)
    membership = regroup.Membership(grown.generation, tuple(dict.fromkeys(grown.hosts)), grown.main)
    return settle(new, membership, "rejoin", f"{info.host} came back", began, info, trainer, optimizer, scheduler, -1,
                  run_dir, job, watch)  # fmt: skip


def take_in(
    info: RankInfo,
    watch: regroup.Watcher,
    trainer: engine.Engine,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    done: int,
    run_dir: Path,
    job: JobConfig,
) -> tuple[RankInfo, dict[str, Any]] | None:
    """After step ``done``: the group takes in the hosts that asked to come back (train/recovery/rejoin.py ``admit``);
    None when it took nobody in."""
    began = time.time()
    admitted = rejoin.admit(info, watch.generation, job.cluster_hash(), job.distributed.timeout_s,
                            jobkey.ensure(run_dir))  # fmt: skip
    if admitted is None:
        return None
    new, grown = admitted
    membership = regroup.Membership(grown.generation, tuple(dict.fromkeys(grown.hosts)), grown.main)
    came = ", ".join(h for h in membership.hosts if h not in info.hosts)
    return settle(new, membership, "rejoin", f"{came} came back", began, info, trainer, optimizer, scheduler, done,
                  run_dir, job)  # fmt: skip


def settle(
    new: RankInfo,
    membership: regroup.Membership,
    decided_by: str,
    cause: str,
    began: float,
    info: RankInfo,
    trainer: engine.Engine,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    done: int,
    run_dir: Path,
    job: JobConfig,
    watch: regroup.Watcher | None = None,
) -> tuple[RankInfo, dict[str, Any]]:
    """Every member of a new group (after a regroup or a rejoin), in it: agree on the step, take the state of the
    rank that holds it, re-wrap the model and re-plan the shares; record it. ``done``: the steps this rank completed
    (-1: it has just come back); ``info``: its place before."""
    watch = watch or regroup.watcher()
    assert watch is not None
    main_host = info.hosts[info.main_rank]
    beat = regroup.heartbeat()
    if beat is not None:
        beat.follow(new)  # the lost hosts are no peers any more, the hosts taken in are
    watch.joined(membership)
    target, source, behind = regroup.agree_step(done)
    if behind:
        regroup.share_state(optimizer, scheduler, source)
    how = trainer.regroup(new, source)
    if decided_by == "rejoin":
        rejoin.catch_up(run_dir, new, newcomer=done < 0)
    if new.rank != info.rank:
        (run_dir / "hosts" / info.host / RANK_STATUS.format(rank=info.rank)).unlink(missing_ok=True)
    rejoin.publish(run_dir, new, membership.generation, job.cluster_hash())
    seconds = round(time.time() - began, 2)
    record = {"generation": membership.generation, "attempt": new.attempt, "from_step": target, "seconds": seconds,
              "hosts": list(membership.hosts), "main": membership.main, "decided_by": decided_by,
              "time": round(time.time(), 3), "cause": cause}  # fmt: skip
    log.info("%s %d (%s decided): rank %d of %d on %s, from step %d (%d step(s) applied by another rank only), "
             "in %.2f s: %s", "rejoin" if decided_by == "rejoin" else "regroup", membership.generation, decided_by,
             new.rank, new.world_size, ", ".join(membership.hosts), target, target - max(done, 0), seconds,
             how)  # fmt: skip
    watch.history.append(record | {"main_before": main_host})
    if new.is_main:
        regrouped = record | {"last_step_logged": last_logged_step(run_dir), "world_size": new.world_size,
                              "main_before": main_host}  # fmt: skip
        # Every regroup of this launch, also where no controller followed: this rank went through each of them.
        write_status(run_dir, world_size=new.world_size, plan=trainer.balancer.plan.to_dict(), regrouped=regrouped,
                     regroups=watch.history)  # fmt: skip
    # The rank's status file keeps the launch's earlier regroups too: a controller that takes the run up reads the
    # whole history from any host, also where a rejoin followed a regroup before it looked.
    return new, record | {"earlier": [dict(r) for r in watch.history[:-1]]}


AGREE_EVERY_S = 0.5  # between two looks for a controller's word or the survivors' own view


def who_is_left(
    watch: regroup.Watcher, info: RankInfo, run_dir: Path, within_s: float, timeout_s: int
) -> tuple[regroup.Membership, str] | None:
    """The membership to go on in, and who decided it ("controller" or "survivors"), or None after ``within_s``.

    While a controller follows the run (it asked this host within three of its polls), or a batch scheduler runs
    it, the controller's word is awaited; otherwise the survivors probe each other and agree
    (train/recovery/consensus.py). A controller that stops asking in the meantime (its laptop went to sleep) leaves the
    decision to the survivors."""
    deadline = time.monotonic() + within_s
    hosts = tuple(dict.fromkeys(info.hosts))
    main = info.hosts[info.main_rank]
    peers = {h: e for h, e in info.stores if h != info.host and h in hosts}
    while True:
        found = watch.newer(min(AGREE_EVERY_S, max(0.0, deadline - time.monotonic())))
        if found is not None:
            return found, "controller"
        if time.monotonic() >= deadline:
            return None
        if regroup.scheduler() is not None or consensus.controller_follows(run_dir, info.host):
            continue
        proposal = consensus.propose(hosts, main, consensus.probe(peers), watch.generation)
        if proposal is None:
            continue
        try:
            store = distributed.regroup_store(info, proposal.main, timeout_s)
            return consensus.agree(proposal, store, info.attempt, hosts, jobkey.ensure(run_dir)), "survivors"
        except (RuntimeError, regroup.GroupLost) as exc:  # the new main host went too: look again
            log.warning("could not agree on %s through %s's store: %s", ", ".join(proposal.hosts), proposal.main,
                        failure.one_line(exc))  # fmt: skip
