"""Per-rank sharding: every rank runs the same number of steps, whatever the dataset size."""

from __future__ import annotations

import math

import pytest

from train.sampler import GlobalBatchSampler, equal_shares


@pytest.mark.parametrize("num_items", [1, 5, 17, 33, 101])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_its_share_at_every_step(num_items: int, world: int) -> None:
    global_batch, micro = 10, 3
    shares = equal_shares(global_batch, world)
    sampler = GlobalBatchSampler(num_items, global_batch, tuple(shares), seed=3)
    for step in range(40):
        per_rank = [sampler.rank_items(step, r) for r in range(world)]
        assert [len(items) for items in per_rank] == shares
        assert [i for items in per_rank for i in items] == sampler.global_batch_at(step)
        for r in range(world):
            assert len(sampler.micro_batches(step, r, micro)) == math.ceil(shares[r] / micro)


def test_each_epoch_visits_every_item_once() -> None:
    sampler = GlobalBatchSampler(num_items=23, global_batch=5, shares=(3, 2), seed=11)
    stream = [i for step in range(23) for i in sampler.global_batch_at(step)]  # 115 items = 5 epochs
    for epoch in range(5):
        assert sorted(stream[epoch * 23 : (epoch + 1) * 23]) == list(range(23))
    assert stream[:23] != stream[23:46]  # a fresh order every epoch


def test_same_seed_same_order_other_seed_other_order() -> None:
    a = GlobalBatchSampler(50, 8, (4, 4), seed=1)
    b = GlobalBatchSampler(50, 8, (4, 4), seed=1)
    c = GlobalBatchSampler(50, 8, (4, 4), seed=2)
    assert [a.global_batch_at(s) for s in range(10)] == [b.global_batch_at(s) for s in range(10)]
    assert [a.global_batch_at(s) for s in range(10)] != [c.global_batch_at(s) for s in range(10)]


def test_position_is_the_step_number() -> None:
    """Resuming at step k hands out exactly what an uninterrupted run hands out at step k."""
    sampler = GlobalBatchSampler(37, 6, (3, 3), seed=5)
    first = [sampler.rank_items(s, 1) for s in range(20)]
    resumed = GlobalBatchSampler(37, 6, (3, 3), seed=5)
    assert [resumed.rank_items(s, 1) for s in range(12, 20)] == first[12:]


def test_global_batch_smaller_than_world_is_refused() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size \(2\).*3"):
        equal_shares(2, 3)
