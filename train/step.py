"""One optimizer step with a token-weighted loss over unequal per-rank batches.

With T_r label tokens on rank r in this step, T = sum_r T_r and W ranks, each rank backpropagates
L_r = (W / T) * sum(token losses on r). DDP averages gradients over the W ranks, so every rank ends
up with the gradient of the mean token loss over the union of all ranks' batches — exactly what a
single process would compute on the whole global batch, however the batch was split.

Every micro-batch but the last runs under ``no_sync()``, so each rank does exactly one
synchronizing backward per optimizer step.

The same all-reduce that sums T also carries every rank's compute time and label tokens of the
previous step (``StepClock``), which the balancer and the per-rank figures (tokens/s, ready time)
need: timing costs no extra message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from train import regroup
from train.data import IGNORE


def label_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the batch's label tokens, in fp32."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits_loss(logits, batch["labels"])


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy of ``logits`` against ``labels`` (IGNORE where there is no label), in fp32."""
    shifted = logits[:, :-1, :].float()
    targets = labels[:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        work = dist.all_reduce(value, op=dist.ReduceOp.SUM, async_op=True)
        if work is not None:
            regroup.wait(work)  # a lost peer fails it at once (train/regroup.py), not at the collective timeout
    return value


@dataclass
class StepClock:
    """This rank's own compute time in a step: from the step's start until its gradients are ready.

    Time spent waiting for slower ranks in the gradient all-reduce is not counted, so the numbers
    say how fast each rank is, not how long the slowest one made it wait. ``lap()`` ends a stretch
    of compute: after each ``no_sync`` micro-batch, and from DDP's communication hook when a
    gradient bucket is ready (train/distributed.py).

    ``device_s_per_token`` is for the benchmark only: the rank then emulates a device that needs
    that many seconds per token. It computes each micro-batch for real, then sleeps until the
    micro-batch has taken ``tokens x device_s_per_token`` (or longer, if the real compute did), so
    its speed follows the work it did and not how busy the CPU happens to be.
    """

    device_s_per_token: float = 0.0
    last_compute_s: float = 0.0  # the previous step's, shared with everyone in the next step's all-reduce
    last_tokens: int = 0  # this rank's label tokens in the previous step, shared alongside its time
    gathered: list[float] = field(default_factory=list)  # every rank's previous-step compute time
    gathered_tokens: list[float] = field(default_factory=list)  # every rank's previous-step label tokens
    _start: float = 0.0
    _mark: float = 0.0
    _pending_tokens: float = 0.0

    def begin(self) -> None:
        self._start = self._mark = time.perf_counter()
        self._pending_tokens = 0

    def work(self, tokens: float) -> None:
        """The next lap computes these tokens (only the benchmark's emulated device uses it)."""
        self._pending_tokens += tokens

    def waited(self) -> None:
        """The time since the last lap went to waiting for a peer (a pipeline stage's input), not to compute."""
        self._mark = time.perf_counter()

    def lap(self) -> None:
        if self.device_s_per_token > 0 and self._pending_tokens:
            device_s = self._pending_tokens * self.device_s_per_token
            time.sleep(max(0.0, self._mark + device_s - time.perf_counter()))
            self._pending_tokens = 0
        self._mark = time.perf_counter()

    def end(self) -> None:
        self.last_compute_s = self._mark - self._start


def exchange(counted_tokens: int, clock: StepClock, device: torch.device) -> int:
    """Collective, once per step: the step's label tokens summed over the ranks (each counts ``counted_tokens``),
    and every rank's compute time and tokens of the previous step into ``clock.gathered*``."""
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    stats = torch.zeros(1 + 2 * world, dtype=torch.float64, device=device)
    stats[0] = counted_tokens
    stats[1 + rank] = clock.last_compute_s
    stats[1 + world + rank] = clock.last_tokens
    values = _all_reduce_sum(stats).tolist()
    clock.gathered, clock.gathered_tokens = values[1 : 1 + world], values[1 + world :]
    return int(values[0])


def backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
    clock: StepClock | None = None,
) -> tuple[float, int]:
    """Accumulate the token-weighted gradient of this rank's micro-batches; return (global mean loss, T)."""
    clock = clock or StepClock()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    own_tokens = sum(label_tokens(mb) for mb in micro_batches)
    total = exchange(own_tokens, clock, device)

    clock.begin()
    scale = world / max(total, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    ddp = isinstance(model, DistributedDataParallel)
    for i, batch in enumerate(micro_batches):
        sync = i == last or not ddp
        clock.work(batch["input_ids"].numel())
        with contextlib.nullcontext() if sync else cast(DistributedDataParallel, model).no_sync():
            loss = summed_loss(model, batch)
            (loss * scale).backward()
        if not (ddp and sync):  # under DDP the communication hook ends the synchronizing backward's lap
            clock.lap()
        loss_sum += loss.detach().double()
    clock.end()
    clock.last_tokens = own_tokens
    global_loss = _all_reduce_sum(loss_sum) / max(total, 1)
    return float(global_loss.item()), total


def clip(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip gradients in place; return the norm before clipping (inf/nan when the gradient is broken)."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
