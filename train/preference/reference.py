"""The reference's log-probabilities: each answer's under the base model, i.e. the same model with its adapter off.

preference.reference live computes them at every step; cached keeps each item's the first time this rank computes
them (the base is frozen: they never change), so that after the first epoch a step needs no reference pass. The
cache is this rank's own: an item trained on another rank after a re-plan or a change of group is computed there once
more, so nothing has to travel, be checkpointed or agree between ranks.
"""

from __future__ import annotations

import contextlib

import torch


class ReferenceCache:
    """Item index -> the reference log-probabilities of its two rows."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def lookup(self, items: list[int], device: torch.device) -> torch.Tensor | None:
        """The [2B] row figures of ``items`` (every row 0, then every row 1), or None unless all are kept."""
        if not all(i in self._kept for i in items):
            return None
        rows = [self._kept[i][0] for i in items] + [self._kept[i][1] for i in items]
        return torch.tensor(rows, dtype=torch.float32, device=device)

    def keep(self, items: list[int], figures: torch.Tensor) -> None:
        values = figures.tolist()
        n = len(items)
        for k, item in enumerate(items):
            self._kept[item] = (values[k], values[n + k])


def adapter_off(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """peft's LoRA model with every adapter switched off: the base it is tuned from."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise TypeError(f"{type(model).__name__} has no adapter to switch off: the reference needs peft's LoRA model")
    context: contextlib.AbstractContextManager[None] = disable()
    return context
