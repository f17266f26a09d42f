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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from train.data.blocks import IGNORE, flat_labels, model_inputs
from train.dist import comm
from train.dist.health import GroupHealth
from train.model import headloss
from train.model.load import packs_by_lengths


def label_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the batch's label tokens, in fp32.

    From the final hidden states and the head's weight, never the whole logits (train/model/headloss.py), unless the
    model's logits are more than its head's output; the model is still called whole, so DDP sees its forward."""
    inputs = model_inputs(batch, by_lengths=packs_by_lengths(model))
    labels = flat_labels(batch["labels"], inputs)
    head = headloss.head(model)
    if head is None:
        return logits_loss(model(**inputs).logits, labels)
    with headloss.head_inputs(head) as seen:
        out = model(**inputs)
    if not seen:  # the model did not call its head module (it used the weight itself): its logits are whole
        return logits_loss(out.logits, labels)
    return headloss.summed_loss(head, seen[-1], labels)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy of ``logits`` against ``labels`` (IGNORE where there is no label), in fp32."""
    shifted = logits[:, :-1, :].float()
    targets = labels[:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def _summed(value: torch.Tensor, health: GroupHealth | None) -> list[float]:
    """``value`` summed over every rank, read on the host once the all-reduce has written it (train/dist/comm.py);
    a lost peer ends the wait at once (train/dist/health.py), not at the collective timeout."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        work, read = comm.all_reduce(value, async_op=True), lambda: value.reshape(-1).tolist()
        return health.result(work, read) if health is not None else comm.result(work, read)
    return value.reshape(-1).tolist()


class Event(Protocol):
    """A mark on a device's timeline: the part of ``torch.cuda.Event(enable_timing=True)`` the clock uses."""

    def record(self) -> None: ...  # on the current stream
    def query(self) -> bool: ...  # complete: the stream has reached it
    def synchronize(self) -> None: ...  # wait (the host) until it is complete
    def elapsed_time(self, end_event: Self, /) -> float: ...  # milliseconds from this event to ``end_event``


def cuda_event() -> Event:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class StepClock:
    """This rank's own compute time in a step: from the step's start until its gradients are ready.

    Time spent waiting for slower ranks in the gradient all-reduce is not counted, so the numbers
    say how fast each rank is, not how long the slowest one made it wait. ``lap()`` ends a stretch
    of compute: after each ``no_sync`` micro-batch, and from DDP's communication hook when a
    gradient bucket is ready (train/dist/distributed.py). The step's time runs from ``begin()`` to the
    last ``lap()`` or ``waited()`` before ``end()``.

    Where to read the time: on CPU (``events`` None) host timestamps. On CUDA (``StepClock.for_device``)
    kernels run asynchronously and a host timestamp only says when the work was queued, so each mark
    also records an event on the current stream (``events``: a factory of ``torch.cuda.Event``s) and the
    time is the GPU's, from the step's first event to its last. Nothing waits for the GPU during the
    step: ``last_compute_s`` resolves the ended step's events when read, at the next step's ``exchange()``,
    when the step's closing host sync (``loss.item()``) has long passed them; an event not complete yet
    (which that sync rules out) is waited for alone (``Event.synchronize``), never the whole device.

    ``device_s_per_token`` is for the benchmark only: the rank then emulates a device that needs
    that many seconds per token. It computes each micro-batch for real, then sleeps until the
    micro-batch has taken ``tokens x device_s_per_token`` (or longer, if the real compute did), so
    its speed follows the work it did and not how busy the CPU happens to be.
    """

    device_s_per_token: float = 0.0
    events: Callable[[], Event] | None = None  # None: host timestamps; else device events (see above)
    last_host_s: float = 0.0  # the previous step's compute time by host timestamps (on CPU: the time)
    last_tokens: int = 0  # this rank's label tokens in the previous step, shared alongside its time
    last_peak_gib: float = 0.0  # this rank's peak memory through the previous step (train/layout/engine.py peak_gib)
    gathered: list[float] = field(default_factory=list)  # every rank's previous-step compute time
    gathered_tokens: list[float] = field(default_factory=list)  # every rank's previous-step label tokens
    gathered_peak_gib: list[float] = field(default_factory=list)  # every rank's peak memory through the previous step
    # Plain data the step's exchange carries for the group (train/recovery/membership.py): this rank's term (the main
    # rank's count of hosts waiting to join), and after the exchange their sum, the same on every rank; and whether
    # this rank's host is wanted back (train/recovery/lending.py: 0 no, else the code of who wants it), and after the
    # exchange the ranks whose host is, with that code, the same on every rank.
    proposing: int = 0
    proposed: int = 0
    leaving: int = 0
    leavers: dict[int, int] = field(default_factory=dict)
    _start: float = 0.0
    _mark: float = 0.0
    _pending_tokens: float = 0.0
    _first: Event | None = None  # the running step's first and last device events
    _last: Event | None = None
    _ended: tuple[Event, Event] | None = None  # the ended step's, until ``last_compute_s`` resolves them
    _device_s: float = 0.0
    _gaps: list[tuple[Event, Event]] = field(default_factory=list)  # waits inside the running step (``excluded``)
    _ended_gaps: list[tuple[Event, Event]] = field(default_factory=list)

    @classmethod
    def for_device(cls, device: torch.device, device_s_per_token: float = 0.0) -> StepClock:
        """The clock of a rank that trains on ``device``: the GPU's time on CUDA, host time elsewhere."""
        return cls(device_s_per_token, events=cuda_event if device.type == "cuda" else None)

    @property
    def last_compute_s(self) -> float:
        """The previous step's compute time, which the next step's all-reduce shares with everyone."""
        if self.events is None:
            return self.last_host_s
        if self._ended is not None:
            first, last = self._ended
            for event in (first, last):  # complete by now (the step ended with a host sync); if not, wait for it
                if not event.query():
                    event.synchronize()
            gaps = sum(a.elapsed_time(b) for a, b in self._ended_gaps)  # complete: they lie before ``last``
            self._device_s, self._ended = (first.elapsed_time(last) - gaps) / 1000, None
        return self._device_s

    def _device_mark(self) -> Event | None:
        if self.events is None:
            return None
        event = self.events()
        event.record()
        return event

    def begin(self) -> None:
        self._start = self._mark = time.perf_counter()
        self._first = self._last = self._device_mark()
        self._pending_tokens = 0
        self._gaps = []

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Inside, the rank waits for its peers (an all-reduce inside the step): that time is not its compute."""
        before, mark = time.perf_counter(), self._device_mark()
        try:
            yield
        finally:
            self._start += time.perf_counter() - before
            after = self._device_mark()
            if mark is not None and after is not None:
                self._gaps.append((mark, after))

    def work(self, tokens: float) -> None:
        """The next lap computes these tokens (only the benchmark's emulated device uses it)."""
        self._pending_tokens += tokens

    def waited(self) -> None:
        """The time since the last lap went to waiting for a peer (a pipeline stage's input), not to compute."""
        self._mark = time.perf_counter()
        self._last = self._device_mark()

    def lap(self) -> None:
        if self.device_s_per_token > 0 and self._pending_tokens:
            device_s = self._pending_tokens * self.device_s_per_token
            time.sleep(max(0.0, self._mark + device_s - time.perf_counter()))
            self._pending_tokens = 0
        self._mark = time.perf_counter()
        self._last = self._device_mark()

    def end(self) -> None:
        self.last_host_s = self._mark - self._start
        if self._first is not None and self._last is not None:
            self._ended, self._ended_gaps = (self._first, self._last), self._gaps


def exchange(counted_tokens: int, clock: StepClock, health: GroupHealth | None = None) -> int:
    """Collective, once per step: the step's label tokens summed over the ranks (each counts ``counted_tokens``),
    every rank's compute time, tokens and peak memory of the previous step into ``clock.gathered*``, ``clock.proposing``
    summed into ``clock.proposed`` (a newer group is proposed: every rank learns it in the same step), and the ranks
    whose ``clock.leaving`` was set into ``clock.leavers`` (rank -> its code)."""
    return exchange_sums(counted_tokens, clock, health)[0]


def exchange_sums(
    counted_tokens: int, clock: StepClock, health: GroupHealth | None = None, extra: Sequence[float] = ()
) -> tuple[int, list[float]]:
    """``exchange``, carrying ``extra`` figures too (a preference step's item and token counts): each summed over
    the ranks, in the same all-reduce."""
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    rank = dist.get_rank() if initialized else 0
    base = 2 + 4 * world
    stats = comm.zeros(base + len(extra), torch.float64)
    stats[0] = counted_tokens
    stats[1 + rank] = clock.last_compute_s
    stats[1 + world + rank] = clock.last_tokens
    stats[1 + 2 * world + rank] = clock.leaving
    stats[1 + 3 * world + rank] = clock.last_peak_gib
    stats[base - 1] = clock.proposing
    for i, value in enumerate(extra):
        stats[base + i] = value
    values = _summed(stats, health)
    clock.gathered, clock.gathered_tokens = values[1 : 1 + world], values[1 + world : 1 + 2 * world]
    clock.leavers = {r: int(code) for r, code in enumerate(values[1 + 2 * world : 1 + 3 * world]) if code > 0}
    clock.gathered_peak_gib = values[1 + 3 * world : 1 + 4 * world]
    clock.proposed = int(values[base - 1])
    return int(values[0]), values[base:]


def backward(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
    clock: StepClock | None = None,
    health: GroupHealth | None = None,
) -> tuple[float, int]:
    """Accumulate the token-weighted gradient of this rank's micro-batches; return (global mean loss, T)."""
    clock = clock or StepClock()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    own_tokens = sum(label_tokens(mb) for mb in micro_batches)
    total = exchange(own_tokens, clock, health)

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
    return _summed(loss_sum, health)[0] / max(total, 1), total


def clip(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip gradients in place; return the norm before clipping (inf/nan when the gradient is broken)."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False))
