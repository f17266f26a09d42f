"""The batch planner: shares follow speed, micro-batches respect memory, re-plans only when they pay off."""

from __future__ import annotations

import itertools

import pytest

from train.balance.planner import Plan, Telemetry, initial_plan, make_plan, split


@pytest.mark.parametrize("global_batch", [4, 9, 24])
@pytest.mark.parametrize("speeds", [(1.0, 0.6, 0.5), (1.0, 1.0), (0.3, 1.0, 0.9, 0.1)])
def test_split_is_the_best_integer_split(global_batch: int, speeds: tuple[float, ...]) -> None:
    """Greedy against brute force over every split."""
    shares = split(global_batch, speeds)
    assert sum(shares) == global_batch and min(shares) >= 1
    slowest = max(s / v for s, v in zip(shares, speeds, strict=True))
    best = min(
        max(s / v for s, v in zip(c, speeds, strict=True))
        for c in itertools.product(range(1, global_batch + 1), repeat=len(speeds))
        if sum(c) == global_batch
    )
    assert slowest == pytest.approx(best)


def test_shares_follow_speed_and_micro_batches_respect_the_memory_cap() -> None:
    plan = make_plan(24, [1.0, 0.6, 0.5], caps=[4, 2, 8], source="measured")
    assert plan.shares[0] > plan.shares[1] > plan.shares[2]
    assert [sum(plan.micro_sizes(r)) for r in range(3)] == list(plan.shares)
    assert max(plan.micro_sizes(1)) <= 2 and len(plan.micro_sizes(2)) == 1  # the 8-cap rank needs no accumulation
    assert Plan.from_dict(plan.to_dict()) == plan


def test_host_weights_and_missing_host() -> None:
    plan = initial_plan({"master": 3, "node": 1}, 16, ["master", "node", "node"], [4, 4, 4])
    assert plan.shares == (10, 3, 3)
    with pytest.raises(ValueError, match=r"no weight for host.*node3070"):
        initial_plan({"master": 3}, 16, ["master", "node3070"], [4, 4])
    with pytest.raises(ValueError, match=r"global_batch_size \(2\).*3"):
        initial_plan("equal", 2, ["a", "b", "c"], [1, 1, 1])


def _times(plan: Plan, per_sequence: list[float]) -> list[float]:
    return [s * t for s, t in zip(plan.shares, per_sequence, strict=True)]


def test_telemetry_replans_once_measured_speeds_differ_then_stays() -> None:
    equal = initial_plan("equal", 24, ["a", "b", "c"], [4, 4, 4])
    telemetry = Telemetry(3, patience=2, threshold=0.1)
    per_sequence = [0.10, 0.10 / 0.6, 0.10 / 0.5]  # speeds 1.0 / 0.6 / 0.5

    telemetry.record(_times(equal, per_sequence), equal)
    assert telemetry.proposal(equal) is None  # not enough measurements yet
    telemetry.record(_times(equal, per_sequence), equal)
    balanced = telemetry.proposal(equal)
    assert balanced is not None and balanced.source == "measured"
    assert balanced.step_time(per_sequence) < 0.8 * equal.step_time(per_sequence)
    telemetry.adopted(equal)
    for _ in range(6):
        telemetry.record(_times(balanced, per_sequence), balanced)
        assert telemetry.proposal(balanced) is None  # the balanced plan is kept: no thrashing


def test_one_noisy_step_does_not_move_work() -> None:
    plan = initial_plan("equal", 16, ["a", "b"], [4, 4])
    telemetry = Telemetry(2, patience=3, threshold=0.1)
    steady = [0.1, 0.1]
    for step in range(12):
        noisy = [0.1, 0.3] if step == 6 else steady  # rank 1 stalls once (another process, a page fault)
        telemetry.record(_times(plan, noisy), plan)
        assert telemetry.proposal(plan) is None


def test_telemetry_ignores_noise_below_the_threshold() -> None:
    plan = initial_plan("equal", 12, ["a", "b"], [4, 4])
    telemetry = Telemetry(2, patience=1, threshold=0.1)
    telemetry.record([0.60, 0.64], plan)  # 6 % apart: not worth a new plan
    assert telemetry.proposal(plan) is None


def test_a_split_that_measured_worse_is_not_tried_again() -> None:
    """9 = 3+3+3 looks faster per sequence on paper but needs a third micro-batch; once measured, it stays out."""
    even = initial_plan("equal", 16, ["a", "b"], [4, 4])
    telemetry = Telemetry(2, patience=1, threshold=0.1)
    telemetry.record([0.80, 1.04], even)  # rank 1 slowed for a while: 9/7 looks 10+ % better
    uneven = telemetry.proposal(even)
    assert uneven is not None and uneven.shares == (9, 7)
    telemetry.adopted(even)
    telemetry.record([1.20, 0.86], uneven)  # really slower: three small micro-batches on rank 0
    back = telemetry.proposal(uneven)
    assert back is not None and back.shares == (8, 8)
    telemetry.adopted(uneven)
    telemetry.record([0.80, 1.04], even)  # the same slow spell again
    assert telemetry.proposal(even) is None  # 9/7 was tried and measured 1.20 s: no flip-flop
