"""Process group set-up, DDP wrapping, and the start-up guard that every rank runs the same job."""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from train.config import ConfigError, JobConfig


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    host: str
    device: torch.device
    main_rank: int = 0  # writes metrics and checkpoints: local rank 0 of the rendezvous host

    @property
    def is_main(self) -> bool:
        return self.rank == self.main_rank


def init(timeout_s: int) -> RankInfo:
    """Join the process group torchrun prepared: NCCL on CUDA, gloo on CPU."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    host = os.environ.get("UGRO_HOST") or socket.gethostname()
    return RankInfo(rank, local_rank, world, host, device, _main_rank(rank, local_rank, world))


def _main_rank(rank: int, local_rank: int, world: int) -> int:
    """The rank whose disk holds the run: local rank 0 on the host the launcher marked UGRO_MAIN_HOST=1.

    c10d rendezvous numbers nodes by their address, not by inventory order, so global rank 0 may
    live on any host; checkpoints and metrics belong on the rendezvous host all the same.
    """
    candidate = rank if os.environ.get("UGRO_MAIN_HOST") == "1" and local_rank == 0 else world
    if not dist.is_initialized():
        return 0
    everyone: list[int | None] = [None] * world
    dist.all_gather_object(everyone, candidate)
    chosen = min(c for c in everyone if c is not None)
    return chosen if chosen < world else 0


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(problem: str | None, info: RankInfo) -> None:
    """Collective: if any rank could not load its configuration, every rank raises the same error."""
    problems: list[str | None] = [problem]
    if dist.is_initialized():
        problems = [None] * info.world_size
        dist.all_gather_object(problems, problem)
    found = list(dict.fromkeys(p for p in problems if p))
    if found:
        raise ConfigError("\n".join(found))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_job(job: JobConfig, info: RankInfo) -> None:
    """All-gather every rank's cluster-wide config; on any difference fail on every rank, naming it."""
    if not dist.is_initialized():
        return
    mine = (info.host, info.rank, job.cluster_hash(), _flatten(job.cluster_wide()))
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    ref_host, _, ref_hash, ref_flat = everyone[0]
    for host, rank, digest, flat in everyone[1:]:
        if digest == ref_hash:
            continue
        keys = sorted(k for k in set(flat) | set(ref_flat) if flat.get(k) != ref_flat.get(k))
        shown = ", ".join(f"{k} ({ref_flat.get(k)!r} on {ref_host} vs {flat.get(k)!r})" for k in keys)
        raise ConfigError(
            f"host {host} (rank {rank}) runs a different job than {ref_host}: cluster-wide key(s) differ: {shown}. "
            "Sync the same job file and train code to every host."
        )


def wrap(model: torch.nn.Module, info: RankInfo) -> torch.nn.Module:
    """DDP over the trainable (LoRA) parameters only.

    Frozen base weights and buffers are left out of DDP's start-up broadcast: every rank loads
    identical ones from disk, and broadcasting a quantized 7B base would cost ~30 s on 1 GbE.
    """
    if not dist.is_initialized():
        return model
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    with warnings.catch_warnings():
        # torch 2.13 deprecates broadcast_buffers, but its replacement still broadcasts at init.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            find_unused_parameters=False,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
