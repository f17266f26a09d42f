"""Preference batches for the tests of train/preference/: random items, as ugro's step and as TRL's trainers read them.

An item is a pair (dpo, orpo: a prompt, a chosen and a rejected answer) or an example (kto: a prompt, one answer and
whether it is desirable). ``pair_batch`` and ``example_batch`` lay items out as the step reads a micro-batch
(train/preference/step.py): rows 0..B-1 each item's row 0 (prompt + chosen; kto: prompt + its answer), rows B..2B-1
each item's row 1 (prompt + rejected; kto: the KL row, prompt_i + answer_{i-1 mod N}, TRL's rotation), right padding,
labels on the answer tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from helpers import small_job

from train.data.blocks import IGNORE

PAD = 3  # models/tiny-llama's pad token


@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True)
class Example:
    prompt: list[int]
    completion: list[int]
    desirable: bool


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return [int(t) for t in torch.randint(4, 2000, (n,), generator=gen)]


def random_pairs(seed: int, lengths: Sequence[tuple[int, int, int]]) -> list[Pair]:
    """One pair per (prompt, chosen, rejected) length, of random token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [Pair(_tokens(gen, p), _tokens(gen, c), _tokens(gen, r)) for p, c, r in lengths]


def random_examples(seed: int, lengths: Sequence[tuple[int, int]], desirable: Sequence[bool]) -> list[Example]:
    """One example per (prompt, completion) length, of random token ids, desirable or not."""
    gen = torch.Generator().manual_seed(seed)
    return [Example(_tokens(gen, p), _tokens(gen, c), d) for (p, c), d in zip(lengths, desirable, strict=True)]


def kl_completion(examples: Sequence[Example], index: int) -> list[int]:
    """The answer of example ``index``'s KL row: the previous example's (TRL's rotation by one over the batch)."""
    return examples[(index - 1) % len(examples)].completion


def _rows(rows: list[tuple[list[int], list[int]]], width: int | None) -> dict[str, torch.Tensor]:
    """Prompt + answer rows, right-padded to ``width`` (default: the longest), labels on the answers."""
    width = width or max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        assert len(prompt) >= 1 and n <= width
        ids[r, :n] = torch.tensor(prompt + answer)
        mask[r, :n] = 1
        labels[r, len(prompt) : n] = torch.tensor(answer)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pair_batch(pairs: Sequence[Pair], items: Sequence[int], width: int | None = None) -> dict[str, torch.Tensor]:
    """ugro's micro-batch of the pairs ``items`` (indices into ``pairs``): chosen rows, then rejected rows."""
    chosen = [(pairs[i].prompt, pairs[i].chosen) for i in items]
    rejected = [(pairs[i].prompt, pairs[i].rejected) for i in items]
    return _rows(chosen + rejected, width) | {"items": torch.tensor(list(items), dtype=torch.long)}


def example_batch(
    examples: Sequence[Example], items: Sequence[int], width: int | None = None
) -> dict[str, torch.Tensor]:
    """ugro's micro-batch of the examples ``items`` (indices into ``examples``, the whole global batch): their rows,
    then their KL rows."""
    own = [(examples[i].prompt, examples[i].completion) for i in items]
    kl = [(examples[i].prompt, kl_completion(examples, i)) for i in items]
    return _rows(own + kl, width) | {
        "items": torch.tensor(list(items), dtype=torch.long),
        "desirable": torch.tensor([examples[i].desirable for i in items], dtype=torch.bool),
    }


def preference_job(method: str, lora: dict[str, Any] | None = None, data: dict[str, Any] | None = None,
                   **preference: Any) -> dict[str, Any]:  # fmt: skip
    """small_job for train.method ``method`` with the preference section ``preference``, LoRA dropout off."""
    return small_job(
        lora={"dropout": 0.0, **(lora or {})},
        data={"format": "preference", "seq_len": 32, "packing": False, **(data or {})},
        train={"method": method},
        preference=preference,
    )


def randomize_lora_b(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Every LoRA B weight seeded random (peft starts them at zero: the tuned model would equal the reference)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) parameters' gradients, by name without DDP's ``module.`` (zeros where none)."""
    return {
        name.removeprefix("module."): (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
