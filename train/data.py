"""Data: load records, render them with a template, tokenize, and pack into fixed-length blocks.

Every rank builds the same blocks in the same order from the same files, so the sampler can
hand out indices without any rank sending data to another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from train.config import ConfigError, DataConfig

IGNORE = -100

_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class Blocks(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length training blocks: ``input_ids``, ``labels`` (IGNORE where not trained) and mask."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "attention_mask": self.attention_mask[index],
        }

    def batch(self, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch: the blocks at ``indices`` stacked, on ``device`` (they are already tokenized)."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return {
            "input_ids": self.input_ids[index].to(device, non_blocking=True),
            "labels": self.labels[index].to(device, non_blocking=True),
            "attention_mask": self.attention_mask[index].to(device, non_blocking=True),
        }


def load_records(cfg: DataConfig, base_dir: Path) -> list[dict[str, Any]]:
    """Read records with ``datasets``: a local file or directory, or a hub dataset name."""
    import datasets

    datasets.disable_progress_bars()
    local = (base_dir / cfg.source) if not Path(cfg.source).is_absolute() else Path(cfg.source)
    try:
        if local.is_file():
            builder = _LOCAL_BUILDERS.get(local.suffix)
            if builder is None:
                raise ConfigError(
                    f"data.source: {local}: unsupported file type '{local.suffix}' "
                    f"(use one of {', '.join(sorted(_LOCAL_BUILDERS))})"
                )
            ds = datasets.load_dataset(builder, data_files=str(local), split="train")
        elif local.is_dir():
            ds = datasets.load_dataset(str(local), split=cfg.split)
        elif local.suffix in _LOCAL_BUILDERS:
            raise ConfigError(f"data.source: {local}: file not found")
        else:
            ds = datasets.load_dataset(cfg.source, split=cfg.split)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many unrelated types for "cannot load"
        raise ConfigError(f"data.source: cannot load '{cfg.source}': {exc}") from None
    records = [dict(row) for row in ds]
    if not records:
        raise ConfigError(f"data.source: '{cfg.source}' holds no records")
    return records


def render(record: dict[str, Any], cfg: DataConfig, index: int) -> list[tuple[str, bool]]:
    """Split one record into text segments, each flagged whether it is trained on."""
    train_all = cfg.train_on == "all"
    try:
        if cfg.format == "text":
            return [(str(record["text"]), True)]
        if cfg.format == "instruction":
            prompt = f"### Instruction:\n{record['instruction']}\n\n"
            if record.get("input"):
                prompt += f"### Input:\n{record['input']}\n\n"
            prompt += "### Response:\n"
            return [(prompt, train_all), (str(record["output"]), True)]
        segments = []
        for turn in record["messages"]:
            segments.append((f"<|{turn['role']}|>\n", train_all))
            segments.append((f"{turn['content']}\n", train_all or turn["role"] == "assistant"))
        return segments
    except (KeyError, TypeError) as exc:
        raise ConfigError(
            f"data.source: record {index} does not fit data.format '{cfg.format}' (missing {exc}); "
            "instruction needs 'instruction' and 'output', chat needs 'messages', text needs 'text'"
        ) from None


def tokenize(records: list[dict[str, Any]], cfg: DataConfig, tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels per record, ending with EOS."""
    eos = tokenizer.eos_token_id
    out = []
    for i, record in enumerate(records):
        ids: list[int] = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        labels: list[int] = [IGNORE] * len(ids)
        for text, trained in render(record, cfg, i):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if trained else [IGNORE] * len(piece)
        ids.append(eos)
        labels.append(eos)
        out.append((ids, labels))
    return out


def build_blocks(examples: list[tuple[list[int], list[int]]], cfg: DataConfig, pad_id: int) -> Blocks:
    """Pack examples into seq_len blocks, or truncate and pad each one when packing is off."""
    n = cfg.seq_len
    if cfg.packing:
        flat_ids = [t for ids, _ in examples for t in ids]
        flat_labels = [t for _, labels in examples for t in labels]
        count = len(flat_ids) // n
        if count == 0:
            raise ConfigError(f"data.seq_len: the data holds {len(flat_ids)} tokens, fewer than one block of {n}")
        ids = torch.tensor(flat_ids[: count * n]).view(count, n)
        labels = torch.tensor(flat_labels[: count * n]).view(count, n)
        return Blocks(ids, labels, torch.ones_like(ids))
    ids = torch.full((len(examples), n), pad_id)
    labels = torch.full((len(examples), n), IGNORE)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for row, (e_ids, e_labels) in enumerate(examples):
        k = min(n, len(e_ids))
        ids[row, :k] = torch.tensor(e_ids[:k])
        labels[row, :k] = torch.tensor(e_labels[:k])
        mask[row, :k] = 1
    return Blocks(ids, labels, mask)


def prepare(cfg: DataConfig, tokenizer: Any, base_dir: Path) -> Blocks:
    records = load_records(cfg, base_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return build_blocks(tokenize(records, cfg, tokenizer), cfg, pad)
