"""Data: render records (train/data/records.py) with a template, tokenize, and pack into fixed-length blocks.

Every rank builds the same blocks in the same order from the same files, so the sampler can
hand out indices without any rank sending data to another.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from train.config import ConfigError, DataConfig
from train.data import pairs
from train.data.records import Record, check_record, held_out_records, messages, training_data

IGNORE = -100
Example = tuple[list[int], list[int]]  # one record's token ids and labels


@dataclass(frozen=True)
class Blocks(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length training blocks: ``input_ids``, ``labels`` (IGNORE where not trained) and mask (1 on tokens, 0
    on padding). Packed rows also have ``position_ids``: each example's positions start again at 0, which is how
    the model keeps every example to itself (``model_inputs``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    records: int = 0  # how many records the blocks were built from (run.json ``data``)
    position_ids: torch.Tensor | None = None
    sets: tuple[dict[str, Any], ...] = ()  # per data set: source, weight, records read and used (train/data/records.py)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _fields(self) -> dict[str, torch.Tensor]:
        found = {"input_ids": self.input_ids, "labels": self.labels, "attention_mask": self.attention_mask}
        if self.position_ids is not None:
            found["position_ids"] = self.position_ids
        return found

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self._fields().items()}

    def batch(self, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch: the blocks at ``indices`` stacked, on ``device`` (they are already tokenized)."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return {key: value[index].to(device, non_blocking=True) for key, value in self._fields().items()}


def model_inputs(batch: dict[str, torch.Tensor], by_lengths: bool = False) -> dict[str, Any]:
    """What the model is called with. Packed rows: their per-example positions, no mask and no cache;
    transformers then lets each token attend only within its own example, since positions start again at 0
    where one begins (``find_packed_sequence_indices``: a block-diagonal causal mask for its eager and SDPA
    attention, the variable-length kernels for flash attention). It looks for them only without a mask and
    without a key/value cache, which a model makes for itself unless told ``use_cache=False``. Other rows:
    their padding mask.

    ``by_lengths`` (unsloth, whose attention ignores restarting positions: examples would see each other): the
    packed rows as one row of every example in turn and ``packed_seq_lengths``, the length of each, which its
    attention keeps apart (``packed_lengths``); the loss then reads the labels the same way (``flat_labels``)."""
    if "position_ids" in batch:
        if by_lengths:
            ids, positions = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
            lengths = packed_lengths(batch["position_ids"])
            return {"input_ids": ids, "position_ids": positions, "packed_seq_lengths": lengths, "use_cache": False}
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def packed_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """The length of every sequence in packed rows, row after row (the padding at a row's end is one of its own):
    each begins where its positions start again at 0; int32 on the host."""
    flat = position_ids.reshape(-1).cpu()
    starts = torch.nonzero(flat == 0).flatten()
    ends = torch.cat([starts[1:], torch.tensor([flat.numel()])])
    return (ends - starts).to(torch.int32)


def flat_labels(labels: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """``labels`` shaped as the rows the model was called with (``model_inputs``): one row when they were joined.
    No label crosses from one row into the next: every row begins with an example, whose first token is never a
    label (``build_blocks``)."""
    return labels.reshape(inputs["input_ids"].shape)


def uses_chat_template(cfg: DataConfig, tokenizer: Any) -> bool:
    """data.template: chat uses the tokenizer's own template; auto does so when the tokenizer has one."""
    if cfg.format == "text" or cfg.template == "plain":
        return False
    if cfg.template not in ("auto", "chat"):  # a named one, set on the tokenizer (train/data/templates.py)
        return True
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
    if cfg.format in pairs.PAIR_FORMATS:  # a pair's prompt, as train/data/pairblocks.py renders it
        return pair_prompt(pairs.prompt_of(Record("(a record)", row), cfg.format), cfg, tokenizer)
    turns = messages(row, cfg.format)
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    if uses_chat_template(cfg, tokenizer):
        return str(tokenizer.apply_chat_template(turns[:last], add_generation_prompt=True, tokenize=False))
    if cfg.format == "instruction":
        return _alpaca_prompt(row)
    return _plain_prompt(turns[:last])


def pair_prompt(turns: list[dict[str, str]], cfg: DataConfig, tokenizer: Any) -> str:
    """A preference item's prompt as text: the chat template's, the assistant's turn opened, or the plain turns."""
    if uses_chat_template(cfg, tokenizer):
        return str(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
    return _plain_prompt(turns)


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
    for turn in messages(row, cfg.format):
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
    """Rows of ``seq_len`` tokens. A text document longer than a row is cut into pieces of a row each; an
    instruction or chat record is truncated to one row. With packing, whole examples share rows (best fit, the
    longest first) and each keeps its own positions; without, each is its own padded row. No token of what
    remains is dropped."""
    n, records = cfg.seq_len, len(examples)
    if cfg.format == "text":
        examples = cut(examples, n)
    examples = [(ids[:n], labels[:n]) for ids, labels in examples]
    groups = pack([len(ids) for ids, _ in examples], n) if cfg.packing else [[i] for i in range(len(examples))]
    if not groups:
        raise ConfigError("data.source: no record holds a token to train on")
    ids = torch.full((len(groups), n), pad_id)
    labels = torch.full((len(groups), n), IGNORE)
    mask = torch.zeros((len(groups), n), dtype=torch.long)
    positions = torch.zeros((len(groups), n), dtype=torch.long)
    for row, group in enumerate(groups):
        at = 0
        for index in group:
            e_ids, e_labels = examples[index]
            k = len(e_ids)
            ids[row, at : at + k] = torch.tensor(e_ids)
            labels[row, at : at + k] = torch.tensor(e_labels)
            labels[row, at] = IGNORE  # nothing before an example predicts its first token
            mask[row, at : at + k] = 1
            positions[row, at : at + k] = torch.arange(k)
            at += k
        positions[row, at:] = torch.arange(n - at)  # the padding: a sequence of its own, trained on nothing
    return Blocks(ids, labels, mask, records, positions if cfg.packing else None)


def pack(lengths: list[int], n: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most ``n`` tokens: best fit, the longest first (each goes
    into the row with the least room that holds it; a new row when none does)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens still free, row), sorted
    for index in order:
        size = lengths[index]
        if size == 0:
            continue
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            rows.append([index])
            free, row = n - size, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(index)
            free -= size
        if free > 0:
            bisect.insort(room, (free, row))
    return rows


def pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def prepare(cfg: DataConfig, tokenizer: Any, base_dir: Path, seed: int = 0) -> Blocks:
    """The training blocks every rank builds identically (``seed``: train.seed, which picks the records of a data
    set's fractional weight)."""
    found = training_data(cfg, base_dir, seed)
    blocks = build_blocks(tokenize(found.records, cfg, tokenizer), cfg, pad_id(tokenizer))
    return replace(blocks, sets=tuple(found.sets))


def prepare_eval(source: str, cfg: DataConfig, tokenizer: Any, base_dir: Path) -> tuple[list[Record], Blocks]:
    """The held-out records and their unpacked rows, for evaluation: one per record (truncated to data.seq_len), or
    as many as a text document fills, so that its held-out loss counts every token."""
    records = held_out_records(source, cfg, base_dir)
    unpacked = cfg.model_copy(update={"packing": False})
    if cfg.format in pairs.PAIR_FORMATS:  # preference data: the loss on its chosen (desirable) answers, as chat
        records = pairs.chosen_conversations(records, cfg.format)
        unpacked = unpacked.model_copy(update={"format": "chat", "columns": {}, "roles": {}})
    return records, build_blocks(tokenize(records, unpacked, tokenizer), unpacked, pad_id(tokenizer))
