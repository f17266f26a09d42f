"""`make plan`: the layout the ranks will build (data parallel, or pipeline stages), shown before a launch.

Each host's ranks, memory and rank-local knobs come from the inventory: its memory profile
(``memory_profile_name`` and ``memory_profile_overrides`` over ``memory_profile_profiles``, the role's
defaults unless the inventory sets its own) and the rank count by preflight's rule (ugro/checks/ranks.py).
Online, the fast preflight's host facts fill in what the inventory leaves open: the GPU count and memory
(or a CPU host's available memory) and the profile of ``memory_profile_name: auto``. Offline, a GPU host is
taken to start one rank unless ``ugro_nproc_per_node`` says otherwise, and its profile must give
``memory_gib``. The plan itself is train/layout/stageplan.py's, the same function every rank calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from train.config import ConfigError, JobConfig, RankLocalConfig, apply_profile, check_profile
from train.layout.stageplan import GIB, Member, PlanError, Span, estimate, plan, read_shape
from train.layout.topology import Layout

ROLE_DEFAULTS = ("roles/ugro/defaults/main.yml", "roles/memory_profile/defaults/main.yml")


@dataclass(frozen=True)
class HostMemory:
    """What the planner needs of one host, and where each value came from."""

    host: str
    ranks: int
    memory_gib: float  # per rank
    device: str  # "cuda" or "cpu"
    profile: str
    rank_local: RankLocalConfig
    source: str  # "profile gpu_8gb memory_gib", "GPU memory (nvidia-smi)", ...

    def line(self, seq_len: int) -> str:
        """'node3070: 1 rank (cuda), 7.2 GiB a rank from profile 'gpu_8gb' memory_gib, micro-batch 1 x 512 ...'."""
        local = self.rank_local
        return (
            f"{self.host}: {self.ranks} rank{'s' if self.ranks != 1 else ''} ({self.device}), {self.memory_gib:.1f} "
            f"GiB a rank from {self.source}, micro-batch {local.cap(seq_len)} x {seq_len} tokens, gradient "
            f"checkpointing {'on' if local.gradient_checkpointing else 'off'}"
        )


def defaults(repo: Path) -> dict[str, Any]:
    """The role defaults the plan reads (ugro's ranks per host, memory_profile's profiles)."""
    merged: dict[str, Any] = {}
    for name in ROLE_DEFAULTS:
        merged |= yaml.safe_load((repo / name).read_text()) or {}
    return merged


def _profile_name(host: str, vars_: dict[str, Any], facts: dict[str, Any] | None) -> str:
    name = str(vars_["memory_profile_name"])
    if name != "auto":
        return name
    if facts is None:
        raise PlanError(
            f"{host}: memory_profile_name is auto, which needs the host's GPU memory; without the hosts (--offline) "
            "set memory_profile_name for it in the inventory (gpu_12gb, gpu_8gb, cpu, or one of your own)"
        )
    gpus = facts.get("gpu", {}).get("gpus") or []
    if not gpus:
        return str(vars_["memory_profile_cpu_profile"])
    smallest = min(int(g.get("memory_mib", 0)) for g in gpus)
    classes = [c for c in vars_["memory_profile_vram_classes"] if int(c["min_vram_mib"]) <= smallest]
    if not classes:
        raise PlanError(f"{host}: no memory_profile_vram_classes entry for its {smallest} MiB GPU; set "
                        "memory_profile_name for it")  # fmt: skip
    return str(max(classes, key=lambda c: int(c["min_vram_mib"]))["profile"])


def host_memory(
    job: JobConfig, host: str, vars_: dict[str, Any], facts: dict[str, Any] | None, ranks: int | None
) -> HostMemory:
    """One host's ranks and memory per rank: its profile's memory_gib, else (online) its GPU's memory or its
    available memory shared among its ranks."""
    name = _profile_name(host, vars_, facts)
    profiles = vars_["memory_profile_profiles"]
    if name not in profiles:
        raise PlanError(f"{host}: memory_profile_name '{name}' is not one of memory_profile_profiles "
                        f"({', '.join(profiles)})")  # fmt: skip
    where = f"profile '{name}' of host {host}"
    try:
        raw = check_profile(dict(profiles[name]) | dict(vars_.get("memory_profile_overrides") or {}), where)
        local = apply_profile(job, raw, where).rank_local
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    gpus = (facts or {}).get("gpu", {}).get("gpus") or []
    device = (
        ("cuda" if gpus else "cpu")
        if facts is not None
        else ("cpu" if name == vars_["memory_profile_cpu_profile"] else "cuda")
    )
    nproc = str(vars_["ugro_nproc_per_node"])
    if ranks is None:
        ranks = int(nproc) if nproc != "auto" else (1 if device == "cuda" else int(vars_["ugro_cpu_procs_per_node"]))
    if local.memory_gib is not None:
        return HostMemory(host, ranks, local.memory_gib, device, name, local, f"profile '{name}' memory_gib")
    if facts is None:
        raise PlanError(
            f"{host}: its memory is unknown without the host (--offline): give profile '{name}' a memory_gib "
            "(memory_profile_overrides: {memory_gib: ...} in its host_vars), or plan with the hosts reachable"
        )
    if gpus:
        memory = min(int(g.get("memory_mib", 0)) for g in gpus) / 1024
        return HostMemory(host, ranks, round(memory, 2), device, name, local, "its GPU's memory (nvidia-smi)")
    available = int(facts.get("memory", {}).get("available_bytes", 0))
    per_rank = round(available / max(1, ranks) / GIB, 2)
    return HostMemory(host, ranks, per_rank, device, name, local, f"available memory / {ranks} ranks")


def hosts_memory(
    job: JobConfig,
    repo: Path,
    hosts: list[str],
    hostvars: dict[str, dict[str, Any]],
    facts: dict[str, dict[str, Any]] | None = None,
    ranks: dict[str, int] | None = None,
) -> list[HostMemory]:
    """Every host's memory, in inventory order; offline when ``facts`` is None."""
    base = defaults(repo)
    found = []
    for host in hosts:
        vars_ = base | hostvars.get(host, {})
        host_facts = None if facts is None else facts.get(host, {})
        found.append(host_memory(job, host, vars_, host_facts, None if ranks is None else ranks.get(host)))
    return found


def backend(job: JobConfig, device: str) -> str:
    """What trains the whole model on a host with this device, as its ranks will resolve it: unsloth on a GPU host
    unless the job says ``model.backend: hf`` (a GPU host's lock carries unsloth: requirements/gpu.in)."""
    return "unsloth" if device == "cuda" and job.model.backend != "hf" else "hf"


def members(job: JobConfig, hosts: list[HostMemory]) -> list[Member]:
    """The ranks in launch order (a host's ranks together), as the planner takes them."""
    return [Member(h.host, h.memory_gib, 1.0, h.device, h.rank_local, backend(job, h.device))
            for h in hosts for _ in range(h.ranks)]  # fmt: skip


def plan_cluster(job: JobConfig, repo: Path, hosts: list[HostMemory]) -> Layout:
    """The layout for these hosts (PlanError with the arithmetic when nothing fits)."""
    return plan(job, read_shape(job, repo), members(job, hosts))


def whole_estimates(job: JobConfig, repo: Path, host: HostMemory) -> str:
    """'the whole model at micro-batch 2: ~7.3 GiB with unsloth (weights 3.3 + ...), ~9.5 GiB with transformers +
    peft (...)': what each backend would need on this host at its profile's micro-batch."""
    shape = read_shape(job, repo)
    micro = host.rank_local.cap(job.data.seq_len)
    local = job.model_copy(update={"rank_local": host.rank_local})
    names = {"unsloth": "unsloth", "hf": "transformers + peft"}
    backends = ["unsloth", "hf"] if host.device == "cuda" else ["hf"]
    parts = []
    for name in backends:
        found = estimate(shape, local, Span(shape.layers), host.device, micro=micro, backend=name)
        used = ", this job's backend" if name == backend(job, host.device) else ""
        parts.append(f"~{found.total:.1f} GiB with {names[name]}{used} ({found.parts()})")
    return f"{host.host}: the whole model at micro-batch {micro}: " + "; ".join(parts)


def rows(layout: Layout) -> list[tuple[str, str, str, str, str, str, str]]:
    """Per rank, sorted by host: host, replica, stage, layers, micro-batch, peak vs memory, share of the step
    time."""
    found = []
    for index, replica in enumerate(layout.replicas):
        for position, stage in enumerate(replica.stages):
            what = "whole model" if len(replica.stages) == 1 else f"{position + 1} of {len(replica.stages)}"
            found.append((
                stage.host,
                str(index),
                what,
                f"{stage.start}-{stage.end - 1} ({stage.end - stage.start})",
                str(stage.micro) if stage.micro else "",
                f"{stage.peak_gib:.1f} / {stage.memory_gib:.1f} GiB",
                f"{stage.time_share:.0%}",
            ))  # fmt: skip
    return found
