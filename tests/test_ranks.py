"""The global batch against the ranks an inventory starts: the message a user gets before a launch."""

from __future__ import annotations

from pathlib import Path

from helpers import small_job

from train.config import JobConfig
from ugro.checks.ranks import batch_problem, describe


def _job(batch: int) -> JobConfig:
    return JobConfig.model_validate(small_job(train={"global_batch_size": batch}))


def test_a_batch_of_at_least_one_sequence_per_rank_passes() -> None:
    ranks = {"master": 1, "node4070": 1, "node3070": 1}
    assert batch_problem(_job(3), Path("jobs/x.yaml"), Path("inventory/cluster.yml"), ranks) is None
    assert batch_problem(_job(2), Path("jobs/x.yaml"), Path("inventory/cluster.yml"), {}) is None  # not known


def test_a_smaller_batch_names_both_numbers_every_host_and_the_fixes() -> None:
    ranks = {"tb1": 2, "tb2": 2, "tb3": 2}
    problem = batch_problem(_job(4), Path("jobs/default.yaml"), Path("inventory/cluster.yml"), ranks)
    assert problem is not None
    assert problem.startswith(
        "jobs/default.yaml: train.global_batch_size is 4, but inventory/cluster.yml will start 6 ranks "
        "(tb1: 2, tb2: 2, tb3: 2)"
    )
    assert "Raise train.global_batch_size to 6 or more" in problem
    assert "ugro_cpu_procs_per_node" in problem and "ugro_nproc_per_node" in problem
    assert describe({"master": 1}) == "1 rank (master: 1)"
