"""One optimizer step with a token-weighted loss over unequal per-rank batches.

With T_r label tokens on rank r in this step, T = sum_r T_r and W ranks, each rank backpropagates
L_r = (W / T) * sum(token losses on r). DDP averages gradients over the W ranks, so every rank ends
up with the gradient of the mean token loss over the union of all ranks' batches — exactly what a
single process would compute on the whole global batch, however the batch was split.

Every micro-batch but the last runs under ``no_sync()``, so each rank does exactly one
synchronizing backward per optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from train.data import IGNORE


def label_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the batch's label tokens, in fp32."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted = logits[:, :-1, :].float()
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def backward(
    model: torch.nn.Module, micro_batches: Sequence[dict[str, torch.Tensor]], device: torch.device
) -> tuple[float, int]:
    """Accumulate the token-weighted gradient of this rank's micro-batches; return (global mean loss, T)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = sum(label_tokens(mb) for mb in micro_batches)
    total = int(_all_reduce_sum(torch.tensor([local], dtype=torch.float64, device=device)).item())
    scale = world / max(total, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, batch in enumerate(micro_batches):
        sync = i == last or not isinstance(model, DistributedDataParallel)
        with contextlib.nullcontext() if sync else cast(DistributedDataParallel, model).no_sync():
            loss = summed_loss(model, batch)
            (loss * scale).backward()
        loss_sum += loss.detach().double()
    global_loss = _all_reduce_sum(loss_sum) / max(total, 1)
    return float(global_loss.item()), total


def clip(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip gradients in place; return the norm before clipping (inf/nan when the gradient is broken)."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
