"""Deterministic per-rank sharding of every global batch.

The data is an endless stream: epoch ``e`` is a permutation of all block indices seeded by
``(seed, e)``, and optimizer step ``s`` takes the stream's items ``[s*G, (s+1)*G)``. Each rank
takes its share of those ``G`` items, as the current plan (train/balance/planner.py) says; the shares
may be unequal and may change between steps, but the global batch of a step never does. Because
the stream never ends, every rank runs exactly the same number of optimizer steps whatever the
dataset size and split — no rank runs dry first and leaves the others waiting in a collective —,
epoch boundaries fall at the same step on every rank, and the sampler position is just the step
number.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@functools.lru_cache(maxsize=4)
def _permutation(num_items: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_items, generator=gen)


@dataclass(frozen=True)
class GlobalBatchSampler:
    num_items: int
    global_batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_items <= 0:
            raise ValueError("the dataset is empty")

    def _epoch(self, epoch: int) -> torch.Tensor:
        return _permutation(self.num_items, self.seed, epoch)

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.num_items

    def global_batch_at(self, step: int) -> list[int]:
        start, stop = step * self.global_batch, (step + 1) * self.global_batch
        items: list[int] = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_items)
            take = min(stop - pos, self.num_items - offset)
            items += self._epoch(epoch)[offset : offset + take].tolist()
            pos += take
        return items

    def rank_items(self, step: int, rank: int, shares: Sequence[int]) -> list[int]:
        if sum(shares) != self.global_batch:
            raise ValueError(f"shares {list(shares)} do not add up to the global batch {self.global_batch}")
        begin = sum(shares[:rank])
        return self.global_batch_at(step)[begin : begin + shares[rank]]

    def micro_batches(self, step: int, rank: int, shares: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
        """The rank's items of this step cut into micro-batches of the given sizes (they sum to its share)."""
        items = self.rank_items(step, rank, shares)
        if sum(sizes) != len(items):
            raise ValueError(f"micro-batch sizes {list(sizes)} do not add up to the share {len(items)}")
        bounds = [0, *itertools.accumulate(sizes)]
        return [items[a:b] for a, b in itertools.pairwise(bounds)]
