"""How each global batch is split across unequal ranks, and when to split it differently.

A plan gives rank r a share s_r of every global batch (sum of shares = the global batch size),
cut into micro-batches no larger than the rank's memory cap. With a measured speed v_r
(sequences per second of the rank's own compute), rank r reaches its synchronizing backward
after about s_r / v_r seconds; the planner picks the integer shares that minimize the slowest
of those times, so fast ranks take more and nobody waits long. The token-weighted loss
(train/balance/step.py) makes the update the same whatever the split.

Planning is deterministic: every rank computes the plan from the same all-reduced numbers, so
all ranks agree on it without another message.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Plan:
    shares: tuple[int, ...]  # sequences of each global batch, per rank
    caps: tuple[int, ...]  # largest micro-batch per rank (its memory profile)
    speeds: tuple[float, ...]  # the relative speeds the shares were made from
    source: str  # "equal", "weights" or "measured"

    def __post_init__(self) -> None:
        if len(self.shares) != len(self.caps) or min(self.shares) < 1:
            raise ValueError(f"invalid plan: shares {self.shares}, caps {self.caps}")

    @property
    def world_size(self) -> int:
        return len(self.shares)

    def micro_sizes(self, rank: int) -> list[int]:
        """The rank's share cut into as few micro-batches as its cap allows, sizes as even as possible."""
        share, cap = self.shares[rank], self.caps[rank]
        count = math.ceil(share / cap)
        base, extra = divmod(share, count)
        return [base + (1 if i < extra else 0) for i in range(count)]

    def step_time(self, seconds_per_sequence: Sequence[float]) -> float:
        """Predicted time until the slowest rank is ready to synchronize."""
        return max(s * t for s, t in zip(self.shares, seconds_per_sequence, strict=True))

    def describe(self) -> str:
        """E.g. ``measured: rank0 11=4+4+3, rank1 7=4+3, rank2 6=3+3``."""
        ranks = (f"rank{r} {s}=" + "+".join(map(str, self.micro_sizes(r))) for r, s in enumerate(self.shares))
        return f"{self.source}: " + ", ".join(ranks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        return cls(
            shares=tuple(int(x) for x in data["shares"]),
            caps=tuple(int(x) for x in data["caps"]),
            speeds=tuple(float(x) for x in data["speeds"]),
            source=str(data["source"]),
        )


def split(global_batch: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """Integer shares minimizing max_r share_r / speed_r; every rank gets at least one sequence.

    Greedy: hand out the sequences one at a time, each to the rank that would finish it soonest
    (ties go to the lower rank). For this objective the greedy choice is optimal.
    """
    world = len(speeds)
    if global_batch < world:
        raise ValueError(
            f"train.global_batch_size ({global_batch}) is smaller than the number of ranks ({world}); "
            "every rank needs at least one sequence per step"
        )
    if min(speeds) <= 0:
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    shares = [1] * world
    heap = [((1 + 1) / v, r) for r, v in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(global_batch - world):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, ((shares[r] + 1) / speeds[r], r))
    return tuple(shares)


def make_plan(global_batch: int, speeds: Sequence[float], caps: Sequence[int], source: str) -> Plan:
    return Plan(split(global_batch, speeds), tuple(caps), tuple(float(v) for v in speeds), source)


def initial_plan(
    balance: str | Mapping[str, float], global_batch: int, hosts: Sequence[str], caps: Sequence[int]
) -> Plan:
    """The plan before anything is measured: equal shares, or the job's fixed per-host weights."""
    if isinstance(balance, Mapping):
        missing = sorted(set(hosts) - set(balance))
        if missing:
            raise ValueError(
                f"balance has no weight for host(s) {', '.join(missing)}; give every host in the inventory a "
                f"weight (hosts: {', '.join(sorted(set(hosts)))}), or use balance: auto"
            )
        return make_plan(global_batch, [balance[h] for h in hosts], caps, "weights")
    return make_plan(global_batch, [1.0] * len(hosts), caps, "equal")


class Telemetry:
    """Per-rank seconds per sequence over the last few steps, and the decision to re-plan.

    Each step every rank reports how long its own compute took (until its gradients were ready
    for the all-reduce, not counting time spent waiting for others). Everyone receives the same
    numbers, so everyone reaches the same decision. A rank's speed is the median of its last
    ``2 * patience - 1`` steps, so one noisy step (another process on the host, a page fault)
    never moves work; and after a plan change, ``patience`` steps are measured before the next.
    """

    def __init__(self, world_size: int, patience: int, threshold: float) -> None:
        self.world_size = world_size
        self.patience = patience
        self.threshold = threshold
        self.samples: deque[list[float]] = deque(maxlen=2 * patience - 1)
        self.seen_since_plan = 0
        self.step_times: list[float] = []  # slowest rank's ready time, each step of the current plan
        self.tried: dict[tuple[int, ...], float] = {}  # shares -> median step time measured while in use

    @property
    def per_sequence(self) -> list[float] | None:
        if not self.samples:
            return None
        return [statistics.median(step[r] for step in self.samples) for r in range(self.world_size)]

    def record(self, compute_s: Sequence[float], plan: Plan) -> None:
        self.samples.append([t / s for t, s in zip(compute_s, plan.shares, strict=True)])
        self.step_times.append(max(compute_s))
        self.seen_since_plan += 1

    def proposal(self, plan: Plan) -> Plan | None:
        """A measured plan when it would shorten the predicted step by more than the threshold, else None."""
        per_sequence = self.per_sequence
        if per_sequence is None or self.seen_since_plan < self.patience:
            return None
        speeds = [1.0 / max(t, 1e-9) for t in per_sequence]
        top = max(speeds)
        candidate = make_plan(sum(plan.shares), [v / top for v in speeds], plan.caps, "measured")
        now, then = plan.step_time(per_sequence), candidate.step_time(per_sequence)
        if candidate.shares == plan.shares or then > now * (1 - self.threshold):
            return None
        # The model is linear in the share; what a plan really did beats what the model says it would do:
        # a plan already tried and measured no better than this one is not tried again (no flip-flopping
        # between two splits whose micro-batch counts differ).
        measured_before = self.tried.get(candidate.shares)
        if measured_before is not None and measured_before > statistics.median(self.step_times) * (1 - self.threshold):
            return None
        return candidate

    def adopted(self, previous: Plan) -> None:
        """A new plan replaces ``previous``; remember how long ``previous`` really took per step."""
        if self.step_times:
            self.tried[previous.shares] = statistics.median(self.step_times)
        self.step_times = []
        self.seen_since_plan = 0
