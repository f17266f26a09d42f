"""Held-out evaluation: the mean loss per answer token, and the answers a model gives, before and after.

Every rank evaluates every W-th held-out record and one all-reduce sums the losses and token counts,
so the figure is the same whatever the number of ranks. The "before" figures come from the same
model with its LoRA adapter switched off: the base model, also on a resumed run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.balance.step import label_tokens, summed_loss
from train.config import JobConfig
from train.data import pairs
from train.data.blocks import Blocks, prepare_eval, prompt_text
from train.data.pairblocks import PairBlocks
from train.data.records import Record, is_chat, messages
from train.dist import comm
from train.dist.distributed import RankInfo
from train.dist.health import GroupHealth


@dataclass
class HeldOut:
    records: list[Record]
    blocks: Blocks | PairBlocks  # PairBlocks: a preference method's held-out pairs (train/preference/evaluate.py)


def load(job: JobConfig, tokenizer: Any, code_dir: Path) -> HeldOut | None:
    if job.eval is None:
        return None
    records, blocks = prepare_eval(job.eval.source, job.data, tokenizer, code_dir)
    return HeldOut(records, blocks)


@contextlib.contextmanager
def base_model(model: Any) -> Iterator[None]:
    """The model with its LoRA adapter switched off (peft), i.e. the base it was fine-tuned from."""
    with model.disable_adapter():
        yield


@torch.no_grad()
def loss(model: torch.nn.Module, held_out: HeldOut, info: RankInfo, batch_size: int,
         health: GroupHealth | None = None) -> tuple[float, int]:  # fmt: skip
    """Mean next-token loss over every held-out answer token (all ranks together), and that token count."""
    was_training = model.training
    model.eval()
    blocks = held_out.blocks
    mine = list(range(info.rank, len(blocks), info.world_size))
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(mine), batch_size):
        batch = blocks.batch(mine[start : start + batch_size], info.device)
        width = int(batch["attention_mask"].sum(dim=1).max())  # drop the columns that are padding in every row
        batch = {key: value[:, :width] for key, value in batch.items()}
        total[0] += float(summed_loss(model, batch))
        total[1] += label_tokens(batch)
    if dist.is_available() and dist.is_initialized() and info.world_size > 1:
        reduced = total.to(comm.carrier())
        # Read once the all-reduce has written it; a lost peer ends the wait at once, as in a step.
        work = comm.all_reduce(reduced, async_op=True)
        total = health.result(work, reduced.cpu) if health is not None else comm.result(work, reduced.cpu)
    model.train(was_training)
    tokens = int(total[1])
    return (float(total[0]) / tokens if tokens else float("nan")), tokens


@torch.no_grad()
def answers(model: Any, tokenizer: Any, job: JobConfig, records: list[Record], device: torch.device) -> list[str]:
    """Greedy answers to the records' questions, one at a time (no padding to get wrong)."""
    assert job.eval is not None
    was_training = model.training
    model.eval()
    out = []
    for record in records:
        prompt = prompt_text(record.fields, job.data, tokenizer)
        encoded = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(device)
        generated = model.generate(
            **encoded,
            max_new_tokens=job.eval.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        new = generated[0, encoded["input_ids"].shape[1] :]
        out.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    model.train(was_training)
    return out


def question(record: Record) -> str:
    """What the sample shows as asked: the last user turn, the instruction, or a note's first line (the model
    goes on from it, train/data/blocks.py prompt_text); a preference pair's or unpaired example's last user turn."""
    row = record.fields
    asked = pairs.question(record)
    if asked is not None:
        return asked
    if is_chat(row):
        return str([t["content"] for t in messages(row, "chat") if t["role"] == "user"][-1])
    if "instruction" not in row:
        return str(row.get("text", "")).split("\n", 1)[0]
    return str(row["instruction"]) + (f"\n\n{row['input']}" if row.get("input") else "")


def reference(record: Record) -> str:
    """The answer the data holds: the last assistant turn, the output, or the rest of the note; a pair's chosen
    answer, an unpaired example's completion where it is desirable (else "")."""
    row = record.fields
    answer = pairs.reference(record)
    if answer is not None:
        return answer
    if is_chat(row):
        return str([t["content"] for t in messages(row, "chat") if t["role"] == "assistant"][-1])
    if "instruction" not in row:
        return (str(row.get("text", "")).split("\n", 1)[1:] or [""])[0]
    return str(row.get("output", ""))
