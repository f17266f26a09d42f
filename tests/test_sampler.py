"""Per-rank sharding: every rank runs the same number of steps, whatever the dataset size and split."""

from __future__ import annotations

import pytest

from train.balance.planner import make_plan
from train.balance.sampler import GlobalBatchSampler


@pytest.mark.parametrize("num_items", [1, 5, 17, 33, 101])
@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 0.6, 0.5), (0.2, 1.0, 0.7)])
def test_every_rank_gets_its_share_at_every_step(num_items: int, speeds: tuple[float, ...]) -> None:
    plan = make_plan(10, speeds, caps=[3] * len(speeds), source="test")
    sampler = GlobalBatchSampler(num_items, 10, seed=3)
    for step in range(40):
        per_rank = [sampler.rank_items(step, r, plan.shares) for r in range(len(speeds))]
        assert [len(items) for items in per_rank] == list(plan.shares)
        assert [i for items in per_rank for i in items] == sampler.global_batch_at(step)
        for r in range(len(speeds)):
            micro = sampler.micro_batches(step, r, plan.shares, plan.micro_sizes(r))
            assert [i for mb in micro for i in mb] == per_rank[r]
            assert max(len(mb) for mb in micro) <= 3


def test_a_new_split_never_changes_what_a_step_trains_on() -> None:
    """Re-planning mid-epoch moves sequences between ranks, never into another step or epoch."""
    sampler = GlobalBatchSampler(23, 6, seed=4)
    for step in range(30):
        union = {
            tuple(sorted(i for r in range(3) for i in sampler.rank_items(step, r, shares)))
            for shares in [(2, 2, 2), (4, 1, 1), (1, 3, 2)]
        }
        assert len(union) == 1
        assert sampler.epoch_of(step) == step * 6 / 23


def test_each_epoch_visits_every_item_once() -> None:
    sampler = GlobalBatchSampler(num_items=23, global_batch=5, seed=11)
    stream = [i for step in range(23) for i in sampler.global_batch_at(step)]  # 115 items = 5 epochs
    for epoch in range(5):
        assert sorted(stream[epoch * 23 : (epoch + 1) * 23]) == list(range(23))
    assert stream[:23] != stream[23:46]  # a fresh order every epoch


def test_same_seed_same_order_other_seed_other_order() -> None:
    a = GlobalBatchSampler(50, 8, seed=1)
    b = GlobalBatchSampler(50, 8, seed=1)
    c = GlobalBatchSampler(50, 8, seed=2)
    assert [a.global_batch_at(s) for s in range(10)] == [b.global_batch_at(s) for s in range(10)]
    assert [a.global_batch_at(s) for s in range(10)] != [c.global_batch_at(s) for s in range(10)]


def test_position_is_the_step_number() -> None:
    """Resuming at step k hands out exactly what an uninterrupted run hands out at step k."""
    sampler = GlobalBatchSampler(37, 6, seed=5)
    first = [sampler.rank_items(s, 1, (3, 3)) for s in range(20)]
    resumed = GlobalBatchSampler(37, 6, seed=5)
    assert [resumed.rank_items(s, 1, (3, 3)) for s in range(12, 20)] == first[12:]


def test_shares_that_do_not_add_up_are_refused() -> None:
    with pytest.raises(ValueError, match="do not add up"):
        GlobalBatchSampler(37, 6, seed=5).rank_items(0, 0, (3, 2))
