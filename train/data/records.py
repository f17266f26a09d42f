"""Records: read a job's data (train/data/sources.py for local files, ``datasets`` for the rest) and check each
against data.format.

No torch here: the controller reads and checks the data before a launch, and its commands start without
importing torch. train/data/blocks.py turns the records into tensors on the ranks.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from train.config import ConfigError, DataConfig, DataSet
from train.data.sources import READERS, TEXT_SUFFIXES, Record, read_notes_folder
from train.digest import sha256_file, sha256_tree

__all__ = [
    "Record", "TrainingData", "check_record", "describe_source", "held_out_records", "is_chat", "load_records",
    "map_record", "messages", "read_checked", "training_data", "weighted",
]  # fmt: skip

_LINELESS = (".parquet",)  # local files read through ``datasets``: their records are named "row N"


def _resolve(source: str, base_dir: Path) -> Path:
    return Path(source) if Path(source).is_absolute() else base_dir / source


def load_records(
    source: str, base_dir: Path, split: str = "train", key: str = "data.source", fmt: str | None = None
) -> list[Record]:
    """Records with where each came from: local files read by train/data/sources.py with their lines, a folder of notes
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


# What each format needs, for its errors (the preference formats': train/data/pairs.py NEEDS).
_NEEDS = {
    "instruction": "'instruction' and 'output' strings (and optionally 'input')",
    "chat": "'messages': a list of {role, content} (or ShareGPT's 'conversations': a list of {from, value}) with at "
    "least one assistant turn",
    "text": "a 'text' string",
}


def check_record(record: Record, fmt: str) -> None:
    """Raise a ConfigError naming the record's file and line when it does not fit ``fmt``."""
    if fmt in ("preference", "unpaired"):
        from train.data import pairs  # it reads this module's ROLES: imported here, not at the top

        pairs.check(record, fmt)
        return
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
    shape = _chat_shape(row)
    if shape is None:
        raise bad("missing 'messages' (or ShareGPT's 'conversations')")
    key, role, content = shape
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise bad(f"'{key}' is not a list of messages")
    for n, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get(role), str) or not isinstance(turn.get(content), str):
            raise bad(f"message {n} is not an object with string '{role}' and '{content}'")
        if turn[role].strip().lower() not in ROLES:
            raise bad(f"message {n} has the {role} '{turn[role]}', which names no chat role ({_KNOWN_ROLES})")
    if not any(ROLES[turn[role].strip().lower()] == "assistant" for turn in turns):
        raise bad("no 'assistant' message to train on")


def map_record(record: Record, fmt: str, columns: Mapping[str, str], roles: Mapping[str, str]) -> Record:
    """The record with the fields ``fmt`` reads under their own names (data.columns maps them from the record's) and
    every chat speaker named by its role (data.roles, beside the usual names)."""
    fields = dict(record.fields)
    outer = {name: theirs for name, theirs in columns.items() if name not in ("role", "content")}
    for name, theirs in outer.items():
        if theirs in fields:
            fields[name] = fields.pop(theirs)
        elif name not in _OPTIONAL:
            raise ConfigError(f"{record.where}: no '{theirs}' (data.columns maps it to '{name}'); the record has "
                              f"{', '.join(repr(k) for k in record.fields) or 'no field'}")  # fmt: skip
    if fmt == "chat" and ("role" in columns or "content" in columns or roles):
        shape = _chat_shape(fields)
        if shape is not None and isinstance(fields[shape[0]], list):
            key, role, content = shape
            role, content = columns.get("role", role), columns.get("content", content)
            speakers = {name.strip().lower(): value for name, value in roles.items()}
            fields[key] = [
                {"role": speakers.get(str(t.get(role, "")).strip().lower(), t.get(role)), "content": t.get(content)}
                if isinstance(t, dict) else t
                for t in fields[key]
            ]  # fmt: skip
            if key == "conversations":  # now in OpenAI's keys
                fields["messages"] = fields.pop("conversations")
    elif fmt in _TURN_FIELDS and ("role" in columns or "content" in columns or roles):
        speakers = {name.strip().lower(): value for name, value in roles.items()}
        for key in _TURN_FIELDS[fmt]:
            value = fields.get(key)
            if isinstance(value, dict):  # ShareGPT's one {from, value} answer
                fields[key] = _mapped_turn(value, columns, speakers)
            elif isinstance(value, list):
                fields[key] = [_mapped_turn(t, columns, speakers) if isinstance(t, dict) else t for t in value]
    return Record(record.where, fields)


# The fields of a record that data.columns may name and the record may lack.
_OPTIONAL = ("input", "system")
# Where the preference formats keep messages (train/data/pairs.py), whose speakers data.roles names.
_TURN_FIELDS = {
    "preference": ("prompt", "chosen", "rejected", "conversations"),
    "unpaired": ("prompt", "completion", "messages", "conversations"),
}


def _mapped_turn(turn: dict[str, Any], columns: Mapping[str, str], speakers: Mapping[str, str]) -> dict[str, Any]:
    """A message in OpenAI's keys, its speaker named by its role: its role and content read from the keys
    data.columns names (else role and content, or ShareGPT's from and value)."""
    sharegpt = "role" not in turn and "content" not in turn
    role = turn.get(columns.get("role", "from" if sharegpt else "role"))
    content = turn.get(columns.get("content", "value" if sharegpt else "content"))
    return {"role": speakers.get(role.strip().lower(), role) if isinstance(role, str) else role, "content": content}


def load_set(data_set: DataSet, cfg: DataConfig, base_dir: Path, key: str) -> list[Record]:
    """One data set's records, mapped to data.format's fields."""
    records = load_records(data_set.source, base_dir, cfg.split, key, cfg.format)
    return [map_record(r, cfg.format, data_set.columns or {}, data_set.roles or {}) for r in records]


def weighted(records: list[Record], weight: float, seed: int) -> list[Record]:
    """``records`` as often as ``weight`` says: every record int(weight) times, then a seeded share of them (in
    their order) for the fraction."""
    whole, fraction = int(weight), weight - int(weight)
    extra = sorted(random.Random(seed).sample(range(len(records)), round(fraction * len(records))))
    return records * whole + [records[i] for i in extra]


class TrainingData(NamedTuple):
    """The training records of every data set, weighted, and what each set gave (run.json ``data``)."""

    records: list[Record]
    sets: list[dict[str, Any]]  # per set: source, weight, records read, records after the weight


def training_data(cfg: DataConfig, base_dir: Path, seed: int, check: bool = False) -> TrainingData:
    """Every training data set (data.source, or data.sources each with its weight), mapped and weighted;
    ``check``: every record checked against data.format (the controller does it before a launch; a rank checks
    each as it tokenizes)."""
    several = cfg.sources is not None
    records: list[Record] = []
    sets: list[dict[str, Any]] = []
    for number, data_set in enumerate(cfg.sets()):
        key = f"data.sources[{number}].source" if several else "data.source"
        read = load_set(data_set, cfg, base_dir, key)
        if check:
            for record in read:
                check_record(record, cfg.format)
        chosen = weighted(read, data_set.weight, seed + number)
        records += chosen
        sets.append({"source": data_set.source, "weight": data_set.weight, "read": len(read), "used": len(chosen)})
    return TrainingData(records, sets)


def held_out_records(source: str, cfg: DataConfig, base_dir: Path, check: bool = False) -> list[Record]:
    """eval.source's records, mapped as data.columns and data.roles say."""
    records = load_set(DataSet(source=source, columns=cfg.columns, roles=cfg.roles), cfg, base_dir, "eval.source")
    if check:
        for record in records:
            check_record(record, cfg.format)
    return records


def read_checked(source: str, cfg: DataConfig, base_dir: Path, key: str = "data.source") -> list[Record]:
    """Read a data file and check every record against data.format (the controller does it before a launch)."""
    records = load_records(source, base_dir, cfg.split, key, cfg.format)
    for record in records:
        check_record(record, cfg.format)
    return records


# The speakers' names of the chat shapes people bring -> the chat roles: OpenAI's (and its 'developer'), ShareGPT's
# (human, gpt) and those of other exports (chatgpt, bard, model, bot).
ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
    "bot": "assistant",
}  # fmt: skip
_KNOWN_ROLES = "user, assistant, system; ShareGPT's human and gpt; or name the role in data.roles"


def _chat_shape(row: dict[str, Any]) -> tuple[str, str, str] | None:
    """Where a chat record keeps its messages, and their role and content keys: OpenAI's ``messages`` of
    {role, content} (a ``name`` is ignored), or ShareGPT's ``conversations`` of {from, value}."""
    if "messages" in row:
        return "messages", "role", "content"
    if "conversations" in row:
        turns = row["conversations"]
        first = turns[0] if isinstance(turns, list) and turns else None
        if isinstance(first, dict) and "from" not in first and "role" in first:
            return "conversations", "role", "content"  # ShareGPT files written with OpenAI's keys
        return "conversations", "from", "value"
    return None


def is_chat(row: dict[str, Any]) -> bool:
    """Whether ``row`` holds a conversation (OpenAI's or ShareGPT's shape)."""
    return _chat_shape(row) is not None


def messages(row: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """The record as chat messages of the roles system, user and assistant (instruction: one user turn, one
    assistant turn); ``check_record`` has checked it."""
    if fmt == "chat":
        shape = _chat_shape(row)
        assert shape is not None, "check_record first"
        key, role, content = shape
        return [{"role": ROLES[str(t[role]).strip().lower()], "content": str(t[content])} for t in row[key]]
    user = str(row["instruction"]) + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": str(row["output"])}]


def describe_source(source: str, base_dir: Path, records: int) -> dict[str, Any]:
    """What a run records of a data source (run.json ``data``, the model card's data section): the source as the
    job names it, its sha256 (a file's; a folder's, over its files: train/digest.py ``sha256_tree``; None for a
    hub dataset, which has no local bytes to hash) and how many records were read from it."""
    local = _resolve(source, base_dir)
    digest = sha256_file(local) if local.is_file() else sha256_tree(local) if local.is_dir() else None
    return {"source": source, "sha256": digest, "records": records}
