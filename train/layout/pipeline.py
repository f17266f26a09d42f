"""One optimizer step when the model is cut into pipeline stages (train/layout/topology.py): 1F1B and exact.

Every stage of a replica draws the same micro-batches (the sampler gives them by replica), so token ids,
masks and labels never travel: only hidden states go forward, and their gradients back, between
neighbouring stages, with point-to-point sends over the job's process group (gloo or NCCL).

Schedule: one-forward-one-backward. Stage s of S first runs S - s - 1 forwards, then alternates a forward
and a backward, then drains the backwards; so a stage holds the activations of at most S - s micro-batches
instead of all of them (GPipe), and the cut adds only the bubble of (S - 1) micro-batch times per step.

Messages: in the steady part a stage sends a forward's output to the next stage and receives the gradient of an
earlier one from it, while the next stage does the opposite. On NCCL a send larger than its buffers completes only
when the peer has posted the receive, and operations to one peer run in order: two neighbours that each queued
their send first would wait on each other until the watchdog ends the run. So each exchange with a neighbour is one
batch of its send and its receive (``comm.exchange``, as Megatron's ``send_forward_recv_backward``), waited on as a
whole before the next.

Exact: the last stage backpropagates (1 / T) x the summed token losses, T being the label tokens of the
whole global batch (all replicas). The LoRA gradients of a layer are then *summed* over the ranks that
hold it, one per replica (``GradSync``), which gives every holder the gradient of the mean token loss over
the union batch: what one process computes on the whole batch. Clipping uses the norm of that whole
gradient, each parameter counted once, so every rank scales alike.

Why not ``torch.distributed.pipelining``: its schedules need one fixed micro-batch shape for every stage
and step and scale each micro-batch's loss by the micro-batch count, while here replicas take unequal
shares cut into unequal micro-batches and the loss is weighted by label tokens across all replicas; and
its stage splitting does not know peft's wrapped layers. The messages below are a few batched sends and receives.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from train.balance.step import StepClock, exchange, label_tokens, logits_loss
from train.dist import comm
from train.dist.health import GroupHealth
from train.layout import stagemodel
from train.layout.topology import Where
from train.model import headloss


@dataclass
class StageRunner:
    """This rank's stage: its model part, where it sits, and the dtype of the hidden states it exchanges."""

    model: Any
    where: Where
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    health: GroupHealth = field(default_factory=GroupHealth)  # its waits end when the group broke
    sent_bytes: int = 0  # hidden states and their gradients this stage has sent
    step_bytes: int = 0  # of that, what the training steps sent
    steps: int = 0  # training steps done in this process
    head: torch.nn.Module | None = field(init=False, default=None)  # the last stage's, when the loss skips logits

    def __post_init__(self) -> None:
        if self.where.last:
            self.head = headloss.head(self.model)

    def _pass(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
              recv_next: tuple[int, ...] | None = None, recv_prev: dict[str, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """One exchange with the neighbours, as one batch waited on as a whole: send hidden states (or their
        gradients), receive the previous stage's hidden states for the micro-batch ``recv_prev`` (a leaf that takes
        a gradient) and the next stage's gradient of the shape ``recv_next``. Returns (from the previous stage,
        from the next)."""
        where = self.where
        sends: list[tuple[torch.Tensor, int]] = []
        for tensor, peer in ((send_next, where.next), (send_prev, where.prev)):
            if tensor is not None and peer is not None:
                payload = tensor.detach().to(self.dtype).contiguous()
                sends.append((payload, peer))
                self.sent_bytes += payload.numel() * payload.element_size()
        buffers: list[torch.Tensor | None] = []
        receives: list[tuple[torch.Tensor, int]] = []
        hidden = None if recv_prev is None else (*recv_prev["input_ids"].shape, self.hidden_size)
        for shape, peer in ((hidden, where.prev), (recv_next, where.next)):
            buffer = None
            if shape is not None and peer is not None:
                buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
                receives.append((buffer, peer))
            buffers.append(buffer)
        if sends or receives:
            self.health.wait(comm.exchange(sends, receives))  # the payloads live until every send is done
        inputs, grad = buffers
        return (None if inputs is None else inputs.requires_grad_(True)), grad

    def _receive_forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The previous stage's hidden states for ``batch`` (None on the first stage)."""
        return self._pass(recv_prev=batch)[0]

    def _compute(self, batch: dict[str, torch.Tensor], inputs: torch.Tensor | None, clock: StepClock | None,
                 logits: bool = False) -> torch.Tensor:  # fmt: skip
        """Run the stage on one micro-batch (its received ``inputs``, or the token ids on the first stage).

        The last stage's output is its final hidden states, which ``summed_loss`` takes the loss from, or the
        logits where ``logits`` asks for them or the loss needs them (``head`` None: train/model/headloss.py).

        ``clock`` (training) times the compute; under ``make bench`` it also makes the stage last as long as its
        emulated device would (a third of the micro-batch's device time forward, two thirds backward), before
        the result leaves for the next stage.
        """
        if clock is not None:
            clock.waited()  # the emulated device starts once the input is here
            clock.work(batch["input_ids"].numel() / 3)
        feed = batch["input_ids"] if inputs is None else inputs
        out = stagemodel.forward(
            self.model, feed, batch, self.where.first, self.where.last, logits or self.head is None
        )
        if clock is not None:
            clock.lap()
        return out

    def forward(self, batch: dict[str, torch.Tensor], logits: bool = False) -> torch.Tensor:
        """Forward only (held-out loss, samples): receive, run the stage, pass the output on; the output."""
        out = self._compute(batch, self._receive_forward(batch), None, logits)
        if not self.where.last:
            self._pass(send_next=out)
        return out

    def summed_loss(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's summed token loss from its ``forward`` output (hidden states, or logits)."""
        if self.head is None:
            return logits_loss(out, labels)
        return headloss.summed_loss(self.head, out, labels)

    def step(self, micro_batches: Sequence[dict[str, torch.Tensor]], clock: StepClock) -> tuple[float, int]:
        """Accumulate this stage's token-weighted gradients of the step; return (global mean loss, T)."""
        before = self.sent_bytes
        where = self.where
        own = sum(label_tokens(mb) for mb in micro_batches)
        total = exchange(own if where.last else 0, clock, self.health)
        scale = 1.0 / max(total, 1)
        clock.begin()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        pending: deque[tuple[torch.Tensor | None, torch.Tensor, int]] = deque()  # (inputs, output, tokens)
        count = len(micro_batches)
        warmup = min(where.stages - where.stage - 1, count)

        def forward(batch: dict[str, torch.Tensor], inputs: torch.Tensor | None) -> torch.Tensor | None:
            """Run one micro-batch forward; the output to send on (None on the last stage)."""
            nonlocal loss_sum
            out = self._compute(batch, inputs, clock)
            if where.last:
                loss = self.summed_loss(out, batch["labels"])
                loss_sum += loss.detach().double()
                out = loss * scale
            pending.append((inputs, out, batch["input_ids"].numel()))
            return None if where.last else out

        def backward(grad: torch.Tensor | None) -> torch.Tensor | None:
            """Backpropagate the oldest micro-batch; the gradient of its inputs to send back (None on the first)."""
            inputs, out, tokens = pending.popleft()
            clock.waited()
            clock.work(2 * tokens / 3)
            out.backward(grad)
            clock.lap()
            return None if inputs is None else inputs.grad

        def oldest_shape() -> tuple[int, ...] | None:
            return None if where.last else tuple(pending[0][1].shape)

        for batch in micro_batches[:warmup]:
            self._pass(send_next=forward(batch, self._receive_forward(batch)))
        inputs = self._receive_forward(micro_batches[warmup]) if warmup < count else None
        for index in range(warmup, count):
            out = forward(micro_batches[index], inputs)
            _, grad = self._pass(send_next=out, recv_next=oldest_shape())  # send_forward_recv_backward
            following = micro_batches[index + 1] if index + 1 < count else None
            inputs, _ = self._pass(send_prev=backward(grad), recv_prev=following)  # send_backward_recv_forward
        for _ in range(warmup):
            _, grad = self._pass(recv_next=oldest_shape())
            self._pass(send_prev=backward(grad))
        self.step_bytes += self.sent_bytes - before
        self.steps += 1
        clock.end()
        clock.last_tokens = own
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.health.wait(comm.all_reduce(loss_sum, async_op=True))
        return float(loss_sum.item()) / max(total, 1), total

    @torch.no_grad()
    def loss(self, batches: Sequence[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """Forward only (held-out loss): summed token loss and label tokens of ``batches`` on the last stage."""
        summed, tokens = 0.0, 0
        for batch in batches:
            out = self.forward(batch)
            if self.where.last:
                summed += float(self.summed_loss(out, batch["labels"]))
                tokens += label_tokens(batch)
        return summed, tokens

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set[int], group: Sequence[int]
    ) -> list[int]:
        """Greedy continuation of ``prompt`` (1 x n token ids, known to every stage) through the stages.

        Each new token is a forward of the whole sequence through every stage (no KV cache: samples are few and
        short); the last stage picks the token and sends it, with a stop flag, to every other stage of ``group``.
        """
        ids = prompt
        new: list[int] = []
        for _ in range(max_new_tokens):
            out = self.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, logits=True)
            message = comm.zeros(2, torch.long)
            if self.where.last:
                token = int(out[0, -1].argmax())
                message[0], message[1] = token, int(token in stop_ids)
                self.health.wait(comm.exchange(sends=[(message, rank) for rank in group[:-1]]))
            else:
                self.health.wait(comm.exchange(receives=[(message, group[-1])]))
            token, stop = int(message[0]), bool(message[1])
            if stop:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
        return new


class GradSync:
    """Sums each LoRA gradient over the ranks that hold its parameter (one per replica), and measures the norm.

    Holders are found by name: every rank reports the base's names of its trainable parameters (train/
    stagemodel.py ``global_name``); parameters with the same holders are flattened into one all-reduce
    over a process group of exactly those ranks. A layer only one rank holds (a single pipeline) needs no
    message at all.
    """

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], rank: int, world: int) -> None:
        self.rank = rank
        mine = [name for name, _ in named]
        everyone: list[list[str] | None] = [mine]
        if dist.is_initialized() and world > 1:
            everyone = comm.gather_objects(mine)
        holders: dict[str, list[int]] = {}
        for other, names in enumerate(everyone):
            for name in names or []:
                holders.setdefault(name, []).append(other)
        self.params = dict(named)
        self.lead = [p for name, p in named if holders[name][0] == rank]  # counts each parameter once in the norm
        sets = sorted({tuple(h) for h in holders.values() if len(h) > 1})
        self.buckets: list[tuple[Any, list[torch.nn.Parameter]]] = []
        for ranks in sets:  # every rank creates every group, in the same order (torch requires it)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                self.buckets.append((group, [self.params[n] for n in mine if tuple(holders[n]) == ranks]))
        self.bytes_per_step = sum(sum(p.numel() * 4 for p in params) for _, params in self.buckets)

    def all_reduce(self) -> None:
        for group, params in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            comm.all_reduce(flat, group=group)
            for param, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
                param.grad = value.view_as(param).to(param.dtype)

    def clip(self, max_norm: float) -> float:
        """Clip every gradient by the norm of the whole gradient (as clip_grad_norm_); return that norm."""
        squares = comm.zeros((), torch.float64)
        for param in self.lead:
            if param.grad is not None:
                squares += param.grad.detach().double().pow(2).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(squares)
        norm = math.sqrt(float(squares))
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and math.isfinite(norm):
            for param in self.params.values():
                if param.grad is not None:
                    param.grad.mul_(coef)
        return norm if math.isfinite(norm) else float("nan")


def named_trainable(model: torch.nn.Module, start: int) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's trainable parameters under the base's names (``layers.N`` counted from the whole model)."""
    return [(stagemodel.global_name(n, start), p) for n, p in model.named_parameters() if p.requires_grad]
