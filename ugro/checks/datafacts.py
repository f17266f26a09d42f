"""What the model will see, before anything starts (`make validate`): the training data tokenized and packed as
every rank will (train/data/blocks.py, with the job's own tokenizer; a preference job's pairs as
train/data/pairblocks.py builds them), counted, and a few rows (pairs) shown with the trained tokens marked
(``SHOW=N``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.text import Text

from train.config import ConfigError, JobConfig
from train.data import pairs, templates
from train.data.blocks import IGNORE, Blocks, build_blocks, pad_id, tokenize
from train.data.pairblocks import PairBlocks, build_pairs, encode_items
from train.data.pairs import Preference, Unpaired
from train.data.records import training_data
from train.model.load import load_tokenizer
from ugro.checks.jobcheck import model_dir

TRAINED_STYLE = "bold green"
# Around trained tokens, for readers without colour (a log, a pipe): the colour alone would vanish there.
OPEN, CLOSE = "\u27e6", "\u27e7"


@dataclass(frozen=True)
class DataFacts:
    records: int
    tokens: int  # every tokenized record, before packing
    trained: int  # label tokens in the rows: what the loss is taken on
    rows: int
    seq_len: int
    padding: int  # padding positions in the rows
    dropped: int  # tokens of the records that no row holds (packing's remainder, records cut at seq_len)
    steps_per_epoch: float
    steps: int  # the run's optimizer steps (train.max_steps, or from train.epochs)
    epochs: float  # passes over the rows the run makes

    def line(self) -> str:
        positions = self.rows * self.seq_len
        return (
            f"data: {self.records} records, {self.tokens:,} tokens -> {self.rows} rows of {self.seq_len} "
            f"({self.padding / positions:.1%} padding, {self.dropped:,} tokens dropped, {self.trained:,} trained); "
            f"{self.steps_per_epoch:.2f} steps an epoch: {self.steps} steps = {self.epochs:.2f} epochs"
        )


@dataclass(frozen=True)
class PairFacts:
    """A preference job's items (pairs; kto: examples, each with its KL row) as `make validate` counts them."""

    method: str
    records: int
    items: int  # what train.global_batch_size counts
    desirable: int  # kto: the desirable examples (the rest are undesirable)
    rows: int  # two per item
    seq_len: int
    tokens: int  # every row's tokens before truncation
    trained: int  # label tokens in the rows
    padding: int
    cut: int  # answers (kto: completions) that data.seq_len cut
    steps_per_epoch: float
    steps: int
    epochs: float

    def line(self) -> str:
        positions = self.rows * self.seq_len
        if self.method == "kto":
            bad = self.items - self.desirable
            what = f"{self.items} examples ({self.desirable} desirable, {bad} undesirable; each with its KL row)"
            cut, unit = f"{self.cut} of {self.items} completions cut at data.seq_len", "examples"
        else:
            what = f"{self.items} pairs (chosen and rejected)"
            cut, unit = f"{self.cut} of {self.rows} answers cut at data.seq_len", "pairs"
        return (
            f"data: {self.records} records -> {what}, {self.tokens:,} tokens -> {self.rows} rows of {self.seq_len} "
            f"({self.padding / positions:.1%} padding, {cut}, {self.trained:,} trained); {self.steps_per_epoch:.2f} "
            f"steps an epoch of {self.items} {unit}: {self.steps} steps = {self.epochs:.2f} epochs"
        )


@dataclass(frozen=True)
class Tokenized:
    facts: DataFacts | PairFacts
    blocks: Blocks | PairBlocks
    tokenizer: Any
    items: tuple[Preference | Unpaired, ...] = ()  # a preference job's, in the order of blocks
    lengths: tuple[tuple[int, int], ...] = ()  # their rows' tokens before data.seq_len cut them


def tokenized(job: JobConfig, repo: Path) -> Tokenized | None:
    """The job's training rows as the ranks build them, or None when its tokenizer is not on this machine (a hub
    model, a base not converted yet: `make train` converts it). ConfigError where the job cannot train on them
    (the warm-up longer than train.epochs' steps)."""
    if model_dir(job, repo) is None:
        return None  # a hub name: validate downloads nothing
    try:
        tokenizer = load_tokenizer(job.model, repo)
        templates.apply(tokenizer, job.data, repo)
    except (OSError, ValueError):
        return None
    records = training_data(job.data, repo, job.train.seed).records
    if job.train.method != "sft":
        return _pairs(job, records, tokenizer)
    examples = tokenize(records, job.data, tokenizer)
    blocks = build_blocks(examples, job.data, pad_id(tokenizer))
    sized = job.for_rows(len(blocks))
    held = int(blocks.attention_mask.sum())
    tokens = sum(len(ids) for ids, _ in examples)
    facts = DataFacts(
        records=len(records),
        tokens=tokens,
        trained=int((blocks.labels != IGNORE).sum()),
        rows=len(blocks),
        seq_len=job.data.seq_len,
        padding=blocks.attention_mask.numel() - held,
        dropped=max(0, tokens - held),
        steps_per_epoch=job.steps_per_epoch(len(blocks)),
        steps=sized.train.max_steps,
        epochs=sized.train.max_steps / job.steps_per_epoch(len(blocks)),
    )
    return Tokenized(facts, blocks, tokenizer)


def _pairs(job: JobConfig, records: list[Any], tokenizer: Any) -> Tokenized:
    """A preference job's items as the ranks build them (train/data/pairblocks.py), counted."""
    items = pairs.items(records, job)
    encoded = encode_items(items, job, tokenizer)
    desirable = [e.desirable for e in items if isinstance(e, Unpaired)]
    blocks = build_pairs(encoded, job.data.seq_len, pad_id(tokenizer), desirable if job.train.method == "kto" else None)
    lengths = tuple((len(a[0]) + len(a[1]), len(b[0]) + len(b[1])) for a, b in encoded)
    answers = [n for two in lengths for n in (two if job.train.method != "kto" else two[:1])]
    sized = job.for_rows(len(blocks))
    held = int(blocks.attention_mask.sum())
    facts = PairFacts(
        method=job.train.method,
        records=len(records),
        items=len(blocks),
        desirable=sum(desirable),
        rows=2 * len(blocks),
        seq_len=job.data.seq_len,
        tokens=sum(n for two in lengths for n in two),
        trained=int((blocks.labels != IGNORE).sum()),
        padding=blocks.attention_mask.numel() - held,
        cut=sum(n > job.data.seq_len for n in answers),
        steps_per_epoch=job.steps_per_epoch(len(blocks)),
        steps=sized.train.max_steps,
        epochs=sized.train.max_steps / job.steps_per_epoch(len(blocks)),
    )
    return Tokenized(facts, blocks, tokenizer, tuple(items), lengths)


def _marked(tokenizer: Any, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, text: Text) -> Text:
    """``text`` with the row's tokens appended, the trained ones in colour and between the marks; padding left out."""
    spans: list[tuple[bool, list[int]]] = []
    for token, label, kept in zip(ids.tolist(), labels.tolist(), mask.tolist(), strict=True):
        if not kept:
            continue
        trained = label != IGNORE
        if spans and spans[-1][0] == trained:
            spans[-1][1].append(token)
        else:
            spans.append((trained, [token]))
    for trained, tokens in spans:
        piece = tokenizer.decode(tokens)
        text.append(f"{OPEN}{piece}{CLOSE}" if trained else piece, style=TRAINED_STYLE if trained else "dim")
    return text


def show(found: Tokenized, count: int) -> list[Text]:
    """The first ``count`` training rows (a preference job's: items) as text, trained tokens in colour and between
    the marks; padding left out."""
    if count < 0:
        raise ConfigError(f"SHOW={count}: give how many rows to show (0 or more)")
    blocks, tokenizer = found.blocks, found.tokenizer
    if isinstance(blocks, PairBlocks):
        return [_shown_item(found, blocks, index) for index in range(min(count, len(blocks)))]
    shown = []
    for index in range(min(count, len(blocks))):
        ids, labels, mask = blocks.input_ids[index], blocks.labels[index], blocks.attention_mask[index]
        text = Text(f"row {index} ({int(mask.sum())} tokens, {int((labels != IGNORE).sum())} trained):\n")
        shown.append(_marked(tokenizer, ids, labels, mask, text))
    return shown


def _shown_item(found: Tokenized, blocks: PairBlocks, index: int) -> Text:
    """One item: its prompt once, then each row's answer (the trained tokens marked), with what was cut."""
    item, lengths, seq_len = found.items[index], found.lengths[index], blocks.input_ids.shape[-1]
    if isinstance(item, Unpaired):
        judged = "desirable" if item.desirable else "undesirable"
        before = (index - 1) % len(blocks)
        head = f"example {index} ({item.where}, {judged})"
        names = ("completion", f"KL row: the prompt with example {before}'s completion")
    else:
        head, names = f"pair {index} ({item.where})", ("chosen", "rejected")
    labels = blocks.labels[index]
    first = int((labels[0] != IGNORE).nonzero()[0]) if bool((labels[0] != IGNORE).any()) else 1
    text = Text(f"{head}: prompt ({first} tokens):\n")
    text.append(found.tokenizer.decode(blocks.input_ids[index, 0, :first].tolist()), style="dim")
    for side, name in enumerate(names):
        mask = blocks.attention_mask[index, side]
        start = int((labels[side] != IGNORE).nonzero()[0]) if bool((labels[side] != IGNORE).any()) else int(mask.sum())
        trained = int((labels[side] != IGNORE).sum())
        over = lengths[side] - seq_len
        cut = f", {over} token{'s' * (over > 1)} cut at data.seq_len" if over > 0 else ""
        text.append(f"{'' if text.plain.endswith(chr(10)) else chr(10)}{name} ({trained} tokens trained{cut}):\n")
        _marked(found.tokenizer, blocks.input_ids[index, side, start:], labels[side, start:], mask[start:], text)
    return text
