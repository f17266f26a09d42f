"""What the model will see, before anything starts (`make validate`): the training data tokenized and packed as
every rank will (train/data/blocks.py, with the job's own tokenizer), counted, and a few rows shown with the trained
tokens marked (``SHOW=N``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from train.config import ConfigError, JobConfig
from train.data import templates
from train.data.blocks import IGNORE, Blocks, build_blocks, pad_id, tokenize
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
class Tokenized:
    facts: DataFacts
    blocks: Blocks
    tokenizer: Any


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


def show(found: Tokenized, count: int) -> list[Text]:
    """The first ``count`` training rows as text, trained tokens in colour and between the marks; padding left out."""
    if count < 0:
        raise ConfigError(f"SHOW={count}: give how many rows to show (0 or more)")
    shown = []
    blocks, tokenizer = found.blocks, found.tokenizer
    for index in range(min(count, len(blocks))):
        ids, labels, mask = blocks.input_ids[index], blocks.labels[index], blocks.attention_mask[index]
        text = Text(f"row {index} ({int(mask.sum())} tokens, {int((labels != IGNORE).sum())} trained):\n")
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
        shown.append(text)
    return shown
