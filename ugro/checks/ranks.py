"""The ranks an inventory will start, known before a launch, against what the job asks of them.

Preflight's fast phase reports, per host, the worker processes a launch would start there (role preflight,
``ranks``: ugro_nproc_per_node, or one per NVIDIA GPU, or ugro_cpu_procs_per_node), by the same rule the
launch uses. Every rank takes at least one sequence of each global batch, so a batch smaller than the world
would fail inside every rank after the launch; here it is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

from train.config import JobConfig


def describe(ranks: dict[str, int]) -> str:
    """'6 ranks (tb1: 2, tb2: 2, tb3: 2)'."""
    if not ranks:
        return "no ranks reported"
    total = sum(ranks.values())
    per_host = ", ".join(f"{host}: {n}" for host, n in ranks.items())
    return f"{total} rank{'s' if total != 1 else ''} ({per_host})"


def too_few_sequences(job: JobConfig, job_file: Path, world: int, starts: str, fewer: str) -> str | None:
    """Why ``world`` ranks cannot share the job's global batch (``starts``: what starts them; ``fewer``: how to
    start fewer), or None."""
    batch = job.train.global_batch_size
    if batch >= world:
        return None
    return (
        f"{job_file}: train.global_batch_size is {batch}, but {starts}, and every rank needs at least one sequence "
        f"of each step. Raise train.global_batch_size to {world} or more, or start fewer ranks: {fewer}"
    )


def batch_problem(job: JobConfig, job_file: Path, inventory: Path, ranks: dict[str, int]) -> str | None:
    """Why the job's global batch cannot be split over the inventory's ranks, with the ways to fix it; or None."""
    if not ranks:
        return None
    fewer = "ugro_cpu_procs_per_node (hosts without a GPU, default 2) or ugro_nproc_per_node in the inventory"
    return too_few_sequences(job, job_file, sum(ranks.values()), f"{inventory} will start {describe(ranks)}", fewer)
