"""The layout a run starts with: every rank reports its host, memory and speed; all plan the same layout.

The planner (train/layout/stageplan.py) is a pure function of the job, the model's config and the members, sorted
by host, so every rank reaches the same layout without another message, and the controller's ``make plan``
shows the same one before launch. A relaunch after a lost host plans again with the ranks that are left.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from train.config import ConfigError, JobConfig
from train.dist import comm
from train.dist.distributed import RankInfo
from train.layout import stageplan, topology
from train.model.load import resolve_backend

GIB = float(1 << 30)


def _available_gib() -> float:
    """MemAvailable of this host (Linux), shared by its ranks."""
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    return 0.0


def memory_gib(job: JobConfig, device: torch.device) -> float:
    """The memory this rank may use: its profile's ``memory_gib``, else its GPU's, else its share of the host's."""
    if job.rank_local.memory_gib is not None:
        return job.rank_local.memory_gib
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return _available_gib() / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def member(job: JobConfig, info: RankInfo) -> stageplan.Member:
    speed = float(job.balance.get(info.host, 1.0)) if isinstance(job.balance, dict) else 1.0
    return stageplan.Member(
        host=info.host,
        memory_gib=round(memory_gib(job, info.device), 3),
        speed=speed,
        device=info.device.type,
        rank_local=job.rank_local,
        backend=resolve_backend(job.model, info.device.type == "cuda"),
    )


def sized(job: JobConfig, layout: topology.Layout, rank: int) -> JobConfig:
    """The job as this rank runs it in ``layout``: with the smaller micro-batch the planner chose for it, if it did
    (the whole model fits the rank only so); the global batch stays, each rank accumulating more micro-batches."""
    micro = layout.stage(rank).micro
    if not 0 < micro < job.micro_batch_cap:
        return job
    rows = micro * job.rows_per_item  # the planner counts items; rank_local.micro_batch_size counts rows
    return job.model_copy(update={"rank_local": job.rank_local.model_copy(update={"micro_batch_size": rows})})


def decide(job: JobConfig, info: RankInfo, code_dir: Path) -> topology.Layout:
    """Collective: the run's layout, the same on every rank."""
    hosts = info.hosts or (info.host,)
    if job.parallel == "data":
        return topology.data_parallel(1, hosts, "parallel: data")
    mine = member(job, info)
    members = [mine]
    if dist.is_initialized() and info.world_size > 1:
        members = comm.gather_objects(mine)
    try:
        shape = stageplan.read_shape(job, code_dir)
    except stageplan.PlanError as exc:
        if job.parallel == "auto":
            return topology.data_parallel(1, hosts, "the model's config.json is not local: data parallel")
        raise ConfigError(f"key 'parallel': {exc}") from None
    try:
        layout = stageplan.plan(job, shape, members)
    except stageplan.PlanError as exc:
        raise ConfigError(str(exc)) from None
    if layout.pipelined and job.train.method != "sft":
        raise ConfigError(
            f"train.method '{job.train.method}': the model does not fit every rank whole ({layout.reason}), and "
            "pipeline stages do not run a preference method (its loss needs both answers' log-probabilities of a "
            "pair, with the adapter on and off, on one rank). Lower rank_local.micro_batch_size, use "
            "model.quantization: 4bit, or leave out the hosts too small for the whole model"
        )
    return layout
