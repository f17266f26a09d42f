"""Each label token's log-probability from the final hidden states and the head's weight, never the whole logits.

A preference loss is a function of every answer's summed log-probability, not a sum of token losses, so the
gradient of each token's log-probability is scaled by its own answer's factor, which is known only in the backward
pass. The chunked function here keeps nothing vocabulary-sized between passes: the forward computes each chunk's
logits for the log-probabilities and drops them, the backward computes them again (one more head product per chunk
than the SFT loss, train/model/headloss.py, which can fold its gradient into the forward) and turns them into the
gradients with every token's own factor. Only positions that have a label are computed. Heads the SFT loss cannot
read the weight of (soft-capped logits, a bias, another module) take the logits path, as there.
"""

from __future__ import annotations

from typing import Any

import torch

from train.data.blocks import IGNORE
from train.model import headloss
from train.model.headchunks import chunk_bytes, chunk_rows


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Pair rows are never packed: their padding mask, and no key/value cache."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


def token_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[r, t + 1] | the row's tokens up to t) at every position where ``targets[:, 1:]`` is not IGNORE,
    in row-major order: an fp32 vector, with gradients when the model has them. The model is called whole (DDP sees
    its forward), its head computing nothing."""
    inputs = model_inputs(batch)
    head = headloss.head(model)
    if head is None:
        return _from_logits(model(**inputs).logits, targets)
    with headloss.head_inputs(head) as seen:
        out = model(**inputs)
    if not seen:  # the model used the head's weight itself: its logits are whole
        return _from_logits(out.logits, targets)
    return hidden_logps(head, seen[-1], targets)


def _from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    shifted, wanted = logits[:, :-1].float(), targets[:, 1:]
    keep = wanted != IGNORE
    rows = shifted[keep]
    return rows.gather(1, wanted[keep][:, None]).squeeze(1) - rows.logsumexp(dim=1)


def hidden_logps(head_module: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``token_logps`` from the hidden states the head reads (batch x seq x hidden)."""
    wanted = targets[:, 1:]
    keep = wanted != IGNORE
    rows, labels = hidden[:, :-1][keep], wanted[keep]
    parts = headloss.linear_parts(head_module)
    if parts is None:  # a head state the chunks do not model: its own forward, on the label positions only
        logits = head_module(rows).float()
        return logits.gather(1, labels[:, None]).squeeze(1) - logits.logsumexp(dim=1)
    base, lora = parts
    low, up = headloss.lora_factors(rows, lora)
    logps: torch.Tensor = _ChunkedLogps.apply(rows, base.weight, labels, low, up)
    return logps


def _logits(h: torch.Tensor, weight: torch.Tensor, low: torch.Tensor | None, up: torch.Tensor | None) -> torch.Tensor:
    """A chunk's fp32 logits, as the head computes them (its weight in the model's dtype, upcast; LoRA added)."""
    logits = (h @ weight.T).float()
    if low is not None and up is not None:
        logits.addmm_(low.float(), up.float().T)
    return logits


class _ChunkedLogps(torch.autograd.Function):
    """logp_i = log_softmax(rows_i @ weight.T + low_i @ up.T)[wanted_i], chunk by chunk in both passes."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: torch.Tensor,
        weight: torch.Tensor,
        wanted: torch.Tensor,
        low: torch.Tensor | None,
        up: torch.Tensor | None,
    ) -> torch.Tensor:
        out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        step = chunk_rows(weight.shape[0], chunk_bytes(rows.device.type))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            logits = _logits(rows[part], weight, None if low is None else low[part], up)
            out[part] = logits.gather(1, wanted[part][:, None]).squeeze(1) - logits.logsumexp(dim=1)
        ctx.save_for_backward(rows, weight, wanted, low, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        rows, weight, wanted, low, up = ctx.saved_tensors
        need_rows, need_weight, _, need_low, need_up = ctx.needs_input_grad
        grad_rows = torch.zeros_like(rows) if need_rows else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_low = torch.zeros_like(low) if low is not None and need_low else None
        grad_up = torch.zeros_like(up) if up is not None and need_up else None
        step = chunk_rows(weight.shape[0], chunk_bytes(rows.device.type))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            h, t, scale = rows[part], wanted[part], grad_out[part].float()
            low_part = None if low is None else low[part]
            logits = _logits(h, weight, low_part, up)
            g = logits.sub_(logits.logsumexp(dim=1, keepdim=True)).exp_()  # the softmax, in place: one chunk
            g.mul_(-scale[:, None])  # d logp / d logits = onehot - softmax, times the token's factor
            g[torch.arange(t.shape[0], device=t.device), t] += scale
            g_head = g.to(weight.dtype)
            if grad_rows is not None:
                grad_rows[part] = g_head @ weight
            if grad_weight is not None:
                grad_weight.addmm_(g_head.T, h)
            if low_part is not None and up is not None:
                g_lora = g.to(up.dtype)
                if grad_low is not None:
                    grad_low[part] = (g_lora @ up).to(low.dtype)
                if grad_up is not None:
                    grad_up.addmm_(g_lora.T, low_part.to(up.dtype))
        return grad_rows, grad_weight, None, grad_low, grad_up
