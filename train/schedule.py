"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate for the update made at ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total, min_ratio))
