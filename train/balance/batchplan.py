"""The batch plan of a running job: where it starts, and when measured step times change it.

``balance: equal`` and ``balance: {host: weight}`` fix the plan for the whole run. ``balance: auto``
starts from equal shares (or from the plan in the checkpoint it resumes), times a few steps, then
splits each global batch by measured speed and re-plans whenever the step times drift enough
that a new plan would pay off (train/balance/planner.py). A checkpoint written by a different number of
ranks starts over from equal shares.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from train.balance.planner import Plan, Telemetry, initial_plan, make_plan, split
from train.balance.step import StepClock
from train.config import ConfigError, JobConfig
from train.dist import comm
from train.dist.distributed import RankInfo
from train.layout.topology import Layout

log = logging.getLogger(__name__)


def _emulated_s_per_token(job: JobConfig, info: RankInfo) -> float:
    """`make bench` only: the seconds per token of the slower device this rank emulates (0: none)."""
    if job.benchmark is None:
        return 0.0
    factors = job.benchmark.emulate_speed
    if len(factors) != info.world_size:
        raise ConfigError(
            f"key 'benchmark.emulate_speed' has {len(factors)} factors for {info.world_size} ranks; give one per rank"
        )
    return job.benchmark.seconds_per_token / factors[info.rank]


def _gather_caps(info: RankInfo, cap: int) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (cap,)
    return tuple(int(c) for c in comm.gather_objects(cap))


class Balancer:
    """Shares of each global batch per planning unit: per rank in data parallel, per replica with pipelines.

    A replica's stages all take the replica's share; its step time is its slowest stage's (they wait on each
    other), so measured speeds re-plan replicas exactly as they re-plan ranks.
    """

    def __init__(
        self, job: JobConfig, info: RankInfo, saved: dict[str, Any] | None, layout: Layout | None = None
    ) -> None:
        rank_caps = _gather_caps(info, job.micro_batch_cap)
        emulated = _emulated_s_per_token(job, info)
        if layout is None or not layout.pipelined:
            self.groups: tuple[tuple[int, ...], ...] = tuple((r,) for r in range(info.world_size))
            self.rank, caps, speeds = info.rank, rank_caps, None
        else:
            self.groups = tuple(r.ranks for r in layout.replicas)
            self.rank = layout.where(info.rank).replica
            stage = layout.stage(info.rank)
            # An emulated stage computes its own layers (and the last one the head), as the planner counts work.
            head = layout.head_work if layout.where(info.rank).last else 0.0
            emulated *= (stage.end - stage.start + head) / (layout.layers + layout.head_work)
            speeds = [r.speed for r in layout.replicas]
            shares = split(job.train.global_batch_size, speeds)
            # A pipeline wants at least as many micro-batches as stages, or its stages wait for each other.
            caps = tuple(
                min(min(rank_caps[r] for r in group), max(1, share // len(group)))
                for group, share in zip(self.groups, shares, strict=True)
            )
        self.clock = StepClock.for_device(info.device, device_s_per_token=emulated)
        self.plan = self._start(job, info, caps, saved, speeds)
        self._ran_with = self.plan  # the plan of the step whose times arrive next
        auto = job.balance == "auto" and len(self.groups) > 1
        self.telemetry = (
            Telemetry(len(self.groups), job.distributed.calibration_steps, job.distributed.replan_threshold)
            if auto
            else None
        )
        log.info("batch plan (global batch %d) %s", job.train.global_batch_size, self.plan.describe())

    def _start(
        self,
        job: JobConfig,
        info: RankInfo,
        caps: tuple[int, ...],
        saved: dict[str, Any] | None,
        speeds: list[float] | None,
    ) -> Plan:
        global_batch = job.train.global_batch_size
        if saved is not None and job.balance == "auto":
            old = Plan.from_dict(saved)
            if old.world_size == len(caps):
                return make_plan(global_batch, old.speeds, caps, old.source)
            log.info(
                "the checkpoint's plan is for %d %s, this run has %d: planning anew",
                old.world_size,
                "ranks" if speeds is None else "replicas",
                len(caps),
            )
        if speeds is not None:  # replicas: equal, or the planner's replica speeds (host weights included)
            equal = job.balance == "equal"
            return make_plan(global_batch, [1.0] * len(caps) if equal else speeds, caps, "equal" if equal else "layout")
        try:
            return initial_plan(job.balance, global_batch, info.hosts, caps)
        except ValueError as exc:
            raise ConfigError(f"job key 'balance': {exc}") from None

    def micro_sizes(self) -> list[int]:
        return self.plan.micro_sizes(self.rank)

    def rank_shares(self) -> tuple[int, ...]:
        """Every rank's share this step (a stage's is its replica's)."""
        by_rank: dict[int, int] = {}
        for group, share in zip(self.groups, self.plan.shares, strict=True):
            by_rank |= dict.fromkeys(group, share)
        return tuple(by_rank[r] for r in sorted(by_rank))

    def after_step(self, warming_up: bool) -> Plan | None:
        """Take in the step times that arrived with this step; a new plan for the next step, or None.

        Times that arrive while ``warming_up`` (a run's first step: allocations, caches) are not used.
        """
        ran_with, self._ran_with = self._ran_with, self.plan
        if self.telemetry is None or warming_up or not any(self.clock.gathered):
            return None
        times = [max(self.clock.gathered[r] for r in group) for group in self.groups]
        self.telemetry.record(times, ran_with)
        proposal = self.telemetry.proposal(self.plan)
        if proposal is None:
            return None
        self.telemetry.adopted(self.plan)
        self.plan = proposal
        return proposal
