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
from train.sources import READERS, TEXT_SUFFIXES, Record, read_notes_folder

IGNORE = -100
Example = tuple[list[int], list[int]]  # one record's token ids and labels


_LINELESS = (".parquet",)  # local files read through ``datasets``: their records are named "row N"


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


def _resolve(source: str, base_dir: Path) -> Path:
    return Path(source) if Path(source).is_absolute() else base_dir / source


def load_records(
    source: str, base_dir: Path, split: str = "train", key: str = "data.source", fmt: str | None = None
) -> list[Record]:
    """Records with where each came from: local files read by train/sources.py with their lines, a folder of notes
    (``fmt`` text), parquet and hub datasets through ``datasets``. ``fmt``: data.format, checked against the file."""
    local = _resolve(source, base_dir)
    if local.is_file() and local.suffix in READERS:
        if local.suffix in TEXT_SUFFIXES and fmt not in (None, "text"):
            raise ConfigError(
                f"{key}: {local}: a {local.suffix} file is plain text, read as data.format: text (documents "
                f"separated by blank lines); data.format '{fmt}' needs .jsonl, .json, .csv or parquet records"
            )
        records = READERS[local.suffix](local)
    elif local.is_dir() and fmt == "text":
        records = read_notes_folder(local, key)
    elif local.is_file() or local.is_dir() or local.suffix not in (*READERS, *_LINELESS):
        records = _load_with_datasets(source, local, split, key)
    else:
        raise ConfigError(f"{key}: {local}: file not found")
    if not records:
        raise ConfigError(f"{key}: {local if local.exists() else source} holds no records (an empty file?)")
    return records


def _load_with_datasets(source: str, local: Path, split: str, key: str) -> list[Record]:
    """Parquet files, dataset folders and hub datasets: no lines to name, so a record is "<source> row N"."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if local.is_file():
            if local.suffix not in _LINELESS:
                known = ", ".join(sorted((*READERS, *_LINELESS)))
                raise ConfigError(f"{key}: {local}: unsupported file type '{local.suffix}' (use one of {known})")
            ds = datasets.load_dataset(local.suffix[1:], data_files=str(local), split="train")
            where = str(local)
        elif local.is_dir():
            ds = datasets.load_dataset(str(local), split=split)
            where = str(local)
        else:
            ds = datasets.load_dataset(source, split=split)
            where = source
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many unrelated types for "cannot load"
        raise ConfigError(f"{key}: cannot load '{source}': {exc}") from None
    return [Record(f"{where} row {i + 1}", dict(row)) for i, row in enumerate(ds)]


_NEEDS = {
    "instruction": "'instruction' and 'output' strings (and optionally 'input')",
    "chat": "'messages': a list of {role, content} with at least one 'assistant' turn",
    "text": "a 'text' string",
}


def check_record(record: Record, fmt: str) -> None:
    """Raise a ConfigError naming the record's file and line when it does not fit ``fmt``."""
    row = record.fields

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{record.where}: {what}; data.format '{fmt}' needs {_NEEDS[fmt]}")

    if fmt == "text":
        if not isinstance(row.get("text"), str) or not row["text"].strip():
            raise bad("missing or empty 'text'")
        return
    if fmt == "instruction":
        for field in ("instruction", "output"):
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise bad(f"missing or empty '{field}'")
        if row.get("input") is not None and not isinstance(row["input"], str):
            raise bad("'input' must be a string")
        return
    turns = row.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad("missing 'messages'")
    for n, turn in enumerate(turns, 1):
        if (
            not isinstance(turn, dict)
            or not isinstance(turn.get("role"), str)
            or not isinstance(turn.get("content"), str)
        ):
            raise bad(f"message {n} is not an object with string 'role' and 'content'")
    if not any(turn["role"] == "assistant" for turn in turns):
        raise bad("no 'assistant' message to train on")


def read_checked(source: str, cfg: DataConfig, base_dir: Path, key: str = "data.source") -> list[Record]:
    """Read a data file and check every record against data.format (the controller does it before a launch)."""
    records = load_records(source, base_dir, cfg.split, key, cfg.format)
    for record in records:
        check_record(record, cfg.format)
    return records


def messages(row: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """The record as chat messages (instruction: one user turn, one assistant turn)."""
    if fmt == "chat":
        return [{"role": str(t["role"]), "content": str(t["content"])} for t in row["messages"]]
    user = str(row["instruction"]) + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": str(row["output"])}]


def uses_chat_template(cfg: DataConfig, tokenizer: Any) -> bool:
    """data.template: chat uses the tokenizer's own template; auto does so when the tokenizer has one."""
    if cfg.format == "text" or cfg.template == "plain":
        return False
    has = bool(getattr(tokenizer, "chat_template", None))
    if cfg.template == "chat" and not has:
        raise ConfigError("data.template: 'chat' was asked for but the tokenizer has no chat template; use 'plain'")
    return has


def _plain_prompt(turns: list[dict[str, str]]) -> str:
    return "".join(f"<|{t['role']}|>\n{t['content']}\n" for t in turns) + "<|assistant|>\n"


def prompt_text(row: dict[str, Any], cfg: DataConfig, tokenizer: Any) -> str:
    """What the model is shown to answer a record's (last) question: everything before the answer."""
    if cfg.format == "text":  # a note has no question: the model goes on from its first line
        return str(row["text"]).split("\n", 1)[0] + "\n"
    turns = messages(row, cfg.format)
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    if uses_chat_template(cfg, tokenizer):
        return str(tokenizer.apply_chat_template(turns[:last], add_generation_prompt=True, tokenize=False))
    if cfg.format == "instruction":
        return _alpaca_prompt(row)
    return _plain_prompt(turns[:last])


def _alpaca_prompt(row: dict[str, Any]) -> str:
    prompt = f"### Instruction:\n{row['instruction']}\n\n"
    if row.get("input"):
        prompt += f"### Input:\n{row['input']}\n\n"
    return prompt + "### Response:\n"


def _chat_segments(turns: list[dict[str, str]], tokenizer: Any, train_all: bool) -> list[tuple[str, bool]]:
    """The templated conversation cut at every assistant turn: the turn itself is trained on."""
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        prompt = str(tokenizer.apply_chat_template(turns[:i], add_generation_prompt=True, tokenize=False))
        full = str(tokenizer.apply_chat_template(turns[: i + 1], tokenize=False))
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ConfigError(
                "data.template: the tokenizer's chat template does not render a conversation as a prefix of its "
                "continuation, so answers cannot be told from prompts; use data.template: plain"
            )
        segments += [(prompt[len(done) :], train_all), (full[len(prompt) :], True)]
        done = full
    return segments


def render(row: dict[str, Any], cfg: DataConfig, tokenizer: Any) -> list[tuple[str, bool]]:
    """One record as text segments, each flagged whether it is trained on."""
    train_all = cfg.train_on == "all"
    if cfg.format == "text":
        return [(str(row["text"]), True)]
    if uses_chat_template(cfg, tokenizer):
        return _chat_segments(messages(row, cfg.format), tokenizer, train_all)
    if cfg.format == "instruction":
        return [(_alpaca_prompt(row), train_all), (str(row["output"]), True)]
    segments = []
    for turn in row["messages"]:
        segments.append((f"<|{turn['role']}|>\n", train_all))
        segments.append((f"{turn['content']}\n", train_all or turn["role"] == "assistant"))
    return segments


def tokenize(records: list[Record], cfg: DataConfig, tokenizer: Any) -> list[Example]:
    """Token ids and labels per record. A chat template brings its own special tokens; plain text gets BOS/EOS."""
    chat = uses_chat_template(cfg, tokenizer)
    eos = tokenizer.eos_token_id
    out = []
    for record in records:
        check_record(record, cfg.format)
        bos = [] if chat or tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        ids: list[int] = list(bos)
        labels: list[int] = [IGNORE] * len(ids)
        for text, trained in render(record.fields, cfg, tokenizer):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if trained else [IGNORE] * len(piece)
        if not chat:
            ids.append(eos)
            labels.append(eos)
        out.append((ids, labels))
    return out


def cut(examples: list[Example], n: int) -> list[Example]:
    """Each example cut into consecutive pieces of at most ``n`` tokens (a 1-token tail trains nothing: dropped)."""
    return [
        (ids[at : at + n], labels[at : at + n])
        for ids, labels in examples
        for at in range(0, len(ids), n)
        if at == 0 or len(ids) - at > 1
    ]


def build_blocks(examples: list[Example], cfg: DataConfig, pad_id: int) -> Blocks:
    """Pack examples into seq_len blocks; with packing off, one padded row each: a text document is cut into as
    many rows as it fills, an instruction or chat record is truncated to seq_len."""
    n = cfg.seq_len
    if cfg.format == "text" and not cfg.packing:
        examples = cut(examples, n)
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


def _pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def prepare(cfg: DataConfig, tokenizer: Any, base_dir: Path) -> Blocks:
    """The training blocks every rank builds identically."""
    records = load_records(cfg.source, base_dir, cfg.split, fmt=cfg.format)
    return build_blocks(tokenize(records, cfg, tokenizer), cfg, _pad_id(tokenizer))


def prepare_eval(source: str, cfg: DataConfig, tokenizer: Any, base_dir: Path) -> tuple[list[Record], Blocks]:
    """The held-out records and their unpacked rows, for evaluation: one per record (truncated to data.seq_len), or
    as many as a text document fills, so that its held-out loss counts every token."""
    records = load_records(source, base_dir, cfg.split, key="eval.source", fmt=cfg.format)
    unpacked = cfg.model_copy(update={"packing": False})
    return records, build_blocks(tokenize(records, cfg, tokenizer), unpacked, _pad_id(tokenizer))
