"""Deterministic per-rank sharding of every global batch.

The data is an endless stream: epoch ``e`` is a permutation of all block indices seeded by
``(seed, e)``, and optimizer step ``s`` takes the stream's items ``[s*G, (s+1)*G)``. Each rank
takes its share of those ``G`` items. Because the stream never ends, every rank runs exactly
the same number of optimizer steps whatever the dataset size — no rank runs dry first and
leaves the others waiting in a collective — and the sampler position is just the step number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def equal_shares(global_batch: int, world_size: int) -> list[int]:
    """Split a global batch as evenly as possible; every rank gets at least one item."""
    if global_batch < world_size:
        raise ValueError(
            f"train.global_batch_size ({global_batch}) is smaller than the number of ranks ({world_size}); "
            "every rank needs at least one sequence per step"
        )
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


@dataclass(frozen=True)
class GlobalBatchSampler:
    num_items: int
    global_batch: int
    shares: tuple[int, ...]
    seed: int

    def __post_init__(self) -> None:
        if sum(self.shares) != self.global_batch:
            raise ValueError(f"shares {self.shares} do not add up to the global batch {self.global_batch}")
        if self.num_items <= 0:
            raise ValueError("the dataset is empty")

    def _epoch(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_items, generator=gen)

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

    def rank_items(self, step: int, rank: int) -> list[int]:
        begin = sum(self.shares[:rank])
        return self.global_batch_at(step)[begin : begin + self.shares[rank]]

    def micro_batches(self, step: int, rank: int, micro_batch_size: int) -> list[list[int]]:
        items = self.rank_items(step, rank)
        return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
