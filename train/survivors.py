"""What a surviving rank does when its group lost a member: wait for the controller's word on who is left, form the
new group, agree on the step, and go on in the same process (train/regroup.py has the group's mechanics)."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from train import distributed, engine, failure, regroup
from train.config import JobConfig
from train.distributed import RankInfo
from train.metrics import RANK_STATUS, last_logged_step, write_status

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
    """A peer is gone: wait for the controller's membership, form the new group, agree on the step, go on.
    Where the main host is the one lost, the membership names another; its local rank 0 takes up the run's
    records (the caller starts them: train/loop.py). Raises ``lost`` when no membership comes within
    ``distributed.regroup_timeout_s`` (the controller then relaunches from a checkpoint), or when this rank
    cannot go on in the new group. ``done``: the steps this rank
    completed; returns its new place and the regroup's record for its status file (``from_step``: where it goes on)."""
    began = time.time()
    log.warning("step %d: the group lost a member (%s); waiting up to %d s for the controller to name who is left",
                done + 1, failure.one_line(lost), job.distributed.regroup_timeout_s)  # fmt: skip
    membership = watch.newer(job.distributed.regroup_timeout_s)
    main_host = info.hosts[info.main_rank]
    if membership is None:
        raise lost
    if membership.main != main_host and main_host in membership.hosts:  # the main host moves only when it is lost
        raise regroup.GroupLost(f"the controller moved the main host from {main_host}, which is left, to "
                                f"{membership.main}")  # fmt: skip
    new = distributed.rejoin(info, membership, job.distributed.timeout_s)
    watch.joined(membership)
    beat = regroup.heartbeat()
    if beat is not None:
        beat.keep(membership.hosts)
    target, source, behind = regroup.agree_step(done)
    if behind:
        regroup.share_state(optimizer, scheduler, source)
    how = trainer.regroup(new, source)
    if new.rank != info.rank:
        (run_dir / "hosts" / info.host / RANK_STATUS.format(rank=info.rank)).unlink(missing_ok=True)
    seconds = round(time.time() - began, 2)
    record = {"generation": membership.generation, "attempt": new.attempt, "from_step": target, "seconds": seconds}
    log.info("regroup %d: rank %d of %d on %s, from step %d (%d step(s) applied by a survivor only), in %.2f s: %s",
             membership.generation, new.rank, new.world_size, ", ".join(membership.hosts), target, target - done,
             seconds, how)  # fmt: skip
    if new.is_main:
        regrouped = record | {"last_step_logged": last_logged_step(run_dir), "hosts": list(membership.hosts),
                              "world_size": new.world_size, "time": round(time.time(), 3),
                              "main_before": main_host}  # fmt: skip
        write_status(run_dir, world_size=new.world_size, plan=trainer.balancer.plan.to_dict(), regrouped=regrouped)
    return new, record
