"""The summed next-token loss from the final hidden states and the head's weight, never the whole logits.

``model(...).logits`` is batch x seq x vocab: at Qwen2.5's 151,936 tokens, seq 1,024 and micro-batch 4 that is 2.3
GiB in fp32, and the loss on it (upcast, log-softmax, its gradient) holds a few of those at once. Here the loss is
computed from the hidden states the head reads, in chunks of label tokens (train/model/headchunks.py ``chunk_bytes`` of
fp32 logits each, so memory no longer grows with batch x seq x vocab), and only at positions that have a label
(prompt and padding positions cost nothing). Each chunk's logits are those the head computes (its weight in the
model's dtype, upcast to fp32, plus ``scaling * lora_B(lora_A(dropout(h)))`` when peft's LoRA is on the head),
turned into the loss and, when gradients are wanted, into the gradients at once, as torch's chunked
``F.linear_cross_entropy`` does. Not that op itself: a LoRA'd head would have to pass it [W, B] as one weight, whose
whole gradient (vocab x hidden) it would compute and hold although W is frozen, and with a bf16 model it returns the
sum in bf16; here a frozen weight gets no gradient and the sum is taken in fp64. The result equals today's
``cross_entropy(logits.float(), labels, reduction="sum")`` (train/balance/step.py ``logits_loss``) to fp32 rounding:
tests/test_headloss.py, bench/headloss.py.

Models whose logits are not a plain linear of the hidden states (soft-capped or scaled logits, a head with a
bias, a head that is neither ``nn.Linear`` nor peft's LoRA ``Linear`` around one) keep the logits path:
``head`` answers None for them, decided once per model with a one-line log saying why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from train.data.blocks import IGNORE
from train.model.headchunks import TRANSFORMED_LOGITS, chunk_bytes, chunk_rows, transformed

log = logging.getLogger(__name__)

DECIDED = "_ugro_loss_head"  # the model's attribute that keeps the decision: (head,) or (None,)


def causal_lm(model: torch.nn.Module) -> Any:
    """The transformers model under DDP and peft wrappers (the one with the config and the head)."""
    inner: Any = getattr(model, "module", model)  # DistributedDataParallel
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _unfit(lm: Any) -> str | None:
    """Why the loss cannot be computed from ``lm``'s hidden states and head weight, or None when it can."""
    config = getattr(lm, "config", None)
    key = transformed({k: getattr(config, k, None) for k in TRANSFORMED_LOGITS})
    if key is not None:
        value = getattr(config, key)
        return f"its config sets {key}={value}: the logits are not a plain linear of the hidden states"
    if not hasattr(lm, "get_output_embeddings") or lm.get_output_embeddings() is None:
        return "it names no head (get_output_embeddings)"
    head = lm.get_output_embeddings()
    base = getattr(head, "base_layer", head)  # peft's LoRA Linear wraps the head
    if type(base) is not torch.nn.Linear or (base is not head and not hasattr(head, "lora_A")):
        return f"its head is a {type(head).__name__}, not an nn.Linear or peft's LoRA Linear around one"
    if base.bias is not None:
        return "its head has a bias"
    return None


def head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The head the loss reads the weight of, or None where the loss must come from the logits; decided once per
    model (the first call logs the choice)."""
    lm = causal_lm(model)
    if not hasattr(lm, DECIDED):
        why = _unfit(lm)
        if why is None:
            log.info("loss: computed from the hidden states and the head's weight, in chunks (no full logits)")
        else:
            log.info("loss: from the full logits, because %s", why)
        # Kept on the model (a tuple: a module set as an attribute would become one of its submodules).
        setattr(lm, DECIDED, (None if why is not None else lm.get_output_embeddings(),))
    head: torch.nn.Module | None = getattr(lm, DECIDED)[0]
    return head


@contextlib.contextmanager
def head_inputs(head_module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside, every call of ``head_module`` records its input in the yielded list and computes nothing: the
    head sees no positions. So a whole model's forward (through DDP, peft or unsloth, which all call the
    head on the final hidden states) yields those hidden states, and no logits."""
    seen: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head_module.register_forward_pre_hook(keep)
    try:
        yield seen
    finally:
        handle.remove()


@dataclass(frozen=True)
class LoraTerm:
    """The one active LoRA adapter on the head: its output is ``up(low)``, ``low = scaling * A(dropout(h))``."""

    down: torch.nn.Linear
    up: torch.nn.Linear
    dropout: torch.nn.Module
    scaling: float


def linear_parts(head_module: torch.nn.Module) -> tuple[torch.nn.Linear, LoraTerm | None] | None:
    """The head as a base Linear plus at most one plain LoRA term, as peft's forward would compute it now; None
    where its state is another one (merged, several adapters, a LoRA variant such as DoRA, a LoRA bias)."""
    if type(head_module) is torch.nn.Linear:
        return head_module, None
    lora: Any = head_module
    base = lora.base_layer
    if lora.merged:
        return None
    if lora.disable_adapters:
        return base, None
    active = [name for name in lora.active_adapters if name in lora.lora_A]
    if not active:
        return base, None
    name = active[0]
    if len(active) > 1 or name in getattr(lora, "lora_variant", {}) or lora.lora_B[name].bias is not None:
        return None
    return base, LoraTerm(lora.lora_A[name], lora.lora_B[name], lora.lora_dropout[name], float(lora.scaling[name]))


def lora_factors(rows: torch.Tensor, lora: LoraTerm | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The head's LoRA term on ``rows`` as two factors, ``low`` (rows x r, with gradients) and ``up`` (vocab x r):
    its output is ``low @ up.T``, which the chunked loss adds to each chunk's logits; (None, None) without LoRA."""
    if lora is None:
        return None, None
    return lora.down(lora.dropout(rows.to(lora.down.weight.dtype))) * lora.scaling, lora.up.weight


def summed_loss(head_module: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy: the hidden state at position t (batch x seq x hidden, what the head reads)
    predicts ``labels[:, t + 1]`` (IGNORE where there is no label); an fp32 scalar, summed in fp64."""
    targets = labels[:, 1:]
    keep = targets != IGNORE
    rows, wanted = hidden[:, :-1][keep], targets[keep]  # only the positions that have a label
    parts = linear_parts(head_module)
    if parts is None:  # a head state this module does not model: its own forward, on the label positions only
        return F.cross_entropy(head_module(rows).float(), wanted, reduction="sum")
    base, lora = parts
    low, up = lora_factors(rows, lora)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (rows, base.weight, low, up))
    loss: torch.Tensor = _ChunkedLoss.apply(rows, base.weight, wanted, low, up, grads)
    return loss


class _ChunkedLoss(torch.autograd.Function):
    """sum_i CE(rows_i @ weight.T + low_i @ up.T, wanted_i), chunk by chunk; the gradients are computed in the
    forward pass (each chunk's logits live only there) and scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        wanted: torch.Tensor,
        low: torch.Tensor | None,
        up: torch.Tensor | None,
        grads: bool,
    ) -> torch.Tensor:
        need = [grads and t is not None and t.requires_grad for t in (rows, weight, low, up)]
        grad_rows = torch.zeros_like(rows) if need[0] else None
        grad_weight = torch.zeros_like(weight) if need[1] else None
        grad_low = torch.zeros_like(low) if low is not None and need[2] else None
        grad_up = torch.zeros_like(up) if up is not None and need[3] else None
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        step = chunk_rows(weight.shape[0], chunk_bytes(rows.device.type))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            h, t = rows[part], wanted[part]
            logits = (h @ weight.T).float()  # as the head's output, upcast (the old path's .float())
            if low is not None and up is not None:
                logits.addmm_(low[part].float(), up.float().T)  # in place: no second chunk of logits
            top = logits.amax(dim=1, keepdim=True)
            picked = logits.gather(1, t[:, None])
            probs = logits.sub_(top).exp_()  # in place: a chunk's logits exist once
            sums = probs.sum(dim=1, keepdim=True)
            total += (sums.log() + top - picked).sum(dtype=torch.float64)  # log-sum-exp minus the label's logit
            if not any(need):
                continue
            probs.div_(sums)  # the softmax
            probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0  # d loss / d logits
            g = probs.to(weight.dtype)
            if grad_rows is not None:
                grad_rows[part] = g @ weight
            if grad_weight is not None:
                grad_weight.addmm_(g.T, h)
            if low is not None and up is not None and (grad_low is not None or grad_up is not None):
                g_lora = probs.to(up.dtype)
                if grad_low is not None:
                    grad_low[part] = (g_lora @ up).to(low.dtype)
                if grad_up is not None:
                    grad_up.addmm_(g_lora.T, low[part].to(up.dtype))
        ctx.grads = (grad_rows, grad_weight, grad_low, grad_up)
        return total.float()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        rows, weight, low, up = (None if g is None else g.mul_(grad_out.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None  # one backward (no retain_graph), as with torch's chunked linear_cross_entropy
        return rows, weight, None, low, up, None
