"""Preference items as tensors (train.method dpo, orpo, kto): two rows of data.seq_len tokens per item.

dpo and orpo: row 0 is prompt + chosen, row 1 prompt + rejected. kto: row 0 is an example's prompt + completion,
row 1 its KL row, the same prompt with the previous example's completion (TRL's rotation over the whole data set in
data order: (x_1, y_n), (x_2, y_1), ...), which estimates the KL term from mismatched pairs.

As TRL tokenizes them, a row is its prompt's tokens followed by its answer's, each tokenized alone
(``add_special_tokens=False``), truncated to data.seq_len from the end (keep_start); the labels are the answer's
tokens, IGNORE elsewhere (never on a row's first token). With a chat template the prompt is the template's text
with the assistant's turn opened, the answer what the whole conversation adds to it; without one the prompt is BOS
and the plain ``<|role|>`` turns of train/data/blocks.py, the answer each turn's text and a newline, then EOS,
trained on. Pairs are never packed. Every rank builds the same tensors from the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from train.config import ConfigError, JobConfig
from train.data import pairs
from train.data.blocks import IGNORE, _plain_prompt, pad_id, uses_chat_template
from train.data.pairs import Preference, Turn, Unpaired
from train.data.records import Record, held_out_records, training_data

__all__ = [
    "Encoded", "PairBlocks", "build_pairs", "encode_items", "pair_blocks", "prepare_eval_pairs", "prepare_pairs",
]  # fmt: skip

# One row before truncation: its prompt's token ids and its answer's.
Encoded = tuple[list[int], list[int]]


@dataclass(frozen=True)
class PairBlocks(Dataset[dict[str, torch.Tensor]]):
    """Items of two rows each: ``input_ids`` [N, 2, L] (the pad id where no token), ``labels`` [N, 2, L] (the
    answer's token ids, IGNORE elsewhere), ``attention_mask`` [N, 2, L] (1 on tokens); kto: ``desirable`` [N],
    whether row 0's completion is desirable."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    desirable: torch.Tensor | None = None
    records: int = 0  # records read (run.json "data")
    sets: tuple[dict[str, Any], ...] = ()  # per data set: source, weight, records read and used (as Blocks.sets)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        found = {"input_ids": self.input_ids[index], "labels": self.labels[index],
                 "attention_mask": self.attention_mask[index]}  # fmt: skip
        if self.desirable is not None:
            found["desirable"] = self.desirable[index]
        return found

    def batch(self, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch of the items at ``indices``: their row 0 in the order given, then their row 1 ([2B, W],
        W the longest of those rows: the columns that are padding in every row dropped), ``items`` (the indices)
        and, for kto, ``desirable`` [B]; on ``device``."""
        index = torch.as_tensor(list(indices), dtype=torch.long)

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            picked = tensor[index]
            return torch.cat([picked[:, 0], picked[:, 1]])

        mask = rows(self.attention_mask)
        width = int(mask.sum(dim=1).max()) if len(index) else 0  # rows are right-padded
        found = {
            "input_ids": rows(self.input_ids)[:, :width],
            "attention_mask": mask[:, :width],
            "labels": rows(self.labels)[:, :width],
            "items": index,
        }
        if self.desirable is not None:
            found["desirable"] = self.desirable[index]
        return {key: value.to(device, non_blocking=True) for key, value in found.items()}


class _Encoder:
    """Prompts and answers to token ids as the job's template renders them (a prompt tokenized once)."""

    def __init__(self, job: JobConfig, tokenizer: Any) -> None:
        self.job, self.tokenizer = job, tokenizer
        self.chat = uses_chat_template(job.data, tokenizer)
        self.prompts: dict[str, tuple[str, list[int]]] = {}

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def prompt(self, turns: list[Turn], where: str) -> tuple[str, list[int]]:
        key = repr(turns)
        if key not in self.prompts:
            if self.chat:
                text = str(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
                ids = self.ids(text)
            else:
                text = _plain_prompt(turns)
                bos = self.tokenizer.bos_token_id
                ids = ([] if bos is None else [int(bos)]) + self.ids(text)
            seq_len = self.job.data.seq_len
            if len(ids) >= seq_len:
                raise ConfigError(
                    f"{where}: its prompt takes {len(ids)} tokens, so no token of an answer fits in data.seq_len "
                    f"({seq_len}): raise data.seq_len or shorten the prompt"
                )
            self.prompts[key] = (text, ids)
        return self.prompts[key]

    def row(self, prompt: list[Turn], answer: list[Turn], where: str) -> Encoded:
        text, prompt_ids = self.prompt(prompt, where)
        if self.chat:
            full = str(self.tokenizer.apply_chat_template(prompt + answer, tokenize=False))
            if not full.startswith(text):  # as train/data/blocks.py _chat_segments refuses it
                raise ConfigError(
                    f"{where}: data.template: the tokenizer's chat template does not render a conversation as a "
                    "prefix of its continuation, so answers cannot be told from prompts; use data.template: plain"
                )
            answer_ids = self.ids(full[len(text) :])
        else:
            answer_ids = [*self.ids("".join(f"{t['content']}\n" for t in answer)), int(self.tokenizer.eos_token_id)]
        if not answer_ids:
            raise ConfigError(f"{where}: the chat template renders an answer as no text; use data.template: plain")
        return prompt_ids, answer_ids


def encode_items(
    items: Sequence[Preference] | Sequence[Unpaired], job: JobConfig, tokenizer: Any
) -> list[tuple[Encoded, Encoded]]:
    """Each item's two rows, untruncated: a pair's chosen and rejected rows, or a kto example's row and its KL row
    (its prompt with the completion of the example before it, the first with the last's)."""
    encoder = _Encoder(job, tokenizer)
    if job.train.method != "kto":
        return [(encoder.row(p.prompt, p.chosen, p.where), encoder.row(p.prompt, p.rejected, p.where))
                for p in items if isinstance(p, Preference)]  # fmt: skip
    rows = [encoder.row(e.prompt, e.completion, e.where) for e in items if isinstance(e, Unpaired)]
    return [(row, (row[0], rows[i - 1][1])) for i, row in enumerate(rows)]


def build_pairs(
    encoded: Sequence[tuple[Encoded, Encoded]],
    seq_len: int,
    pad: int,
    desirable: Sequence[bool] | None = None,
    records: int = 0,
    sets: tuple[dict[str, Any], ...] = (),
) -> PairBlocks:
    """The items' rows, each (prompt + answer)[:seq_len], right-padded with ``pad``; labels on the answer tokens."""
    if not encoded:
        raise ConfigError("data.source: no record holds a pair to train on")
    ids = torch.full((len(encoded), 2, seq_len), pad, dtype=torch.long)
    labels = torch.full((len(encoded), 2, seq_len), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), 2, seq_len), dtype=torch.long)
    for item, two in enumerate(encoded):
        for side, (prompt, answer) in enumerate(two):
            row = (prompt + answer)[:seq_len]
            k = len(row)
            ids[item, side, :k] = torch.tensor(row)
            labels[item, side, len(prompt) : k] = torch.tensor(answer[: k - len(prompt)])
            labels[item, side, 0] = IGNORE  # nothing before a row predicts its first token
            mask[item, side, :k] = 1
    flags = None if desirable is None else torch.tensor(list(desirable), dtype=torch.bool)
    return PairBlocks(ids, labels, mask, flags, records, sets)


def pair_blocks(
    records: list[Record], job: JobConfig, tokenizer: Any, sets: tuple[dict[str, Any], ...] = ()
) -> PairBlocks:
    """``records``' items (train/data/pairs.py ``items``) as PairBlocks."""
    found = pairs.items(records, job)
    desirable = [e.desirable for e in found if isinstance(e, Unpaired)] if job.train.method == "kto" else None
    encoded = encode_items(found, job, tokenizer)
    return build_pairs(encoded, job.data.seq_len, pad_id(tokenizer), desirable, len(records), sets)


def prepare_pairs(job: JobConfig, tokenizer: Any, base_dir: Path) -> PairBlocks:
    """The training items every rank builds identically: data.source, or data.sources with their weights
    (train.seed picks the records of a fractional weight), in data order."""
    found = training_data(job.data, base_dir, job.train.seed)
    return pair_blocks(found.records, job, tokenizer, tuple(found.sets))


def prepare_eval_pairs(source: str, job: JobConfig, tokenizer: Any, base_dir: Path) -> tuple[list[Record], PairBlocks]:
    """The held-out records and their items: item i is record i (dpo, orpo); kto: the examples as in training (on
    data.format preference, every record's desirable one, then every record's undesirable one), each KL row from the
    held-out examples."""
    records = held_out_records(source, job.data, base_dir)
    return records, pair_blocks(records, job, tokenizer)
