"""Local data files read into Records, each with the line it starts on ("notes.txt:41"), so that every error a
person gets names a line they can open.

.jsonl: a JSON object per line. .json: an array of objects, or an object per line. .csv: a header line, then a
record per row. .txt and .md (data.format: text): documents separated by blank lines; a folder of them: one
document per file. Parquet files and hub datasets have no lines: train/data/blocks.py reads them through ``datasets``.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from train.config import ConfigError

TEXT_SUFFIXES = (".txt", ".md")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's own whitespace (RFC 8259), as the json module skips it


class Record(NamedTuple):
    """One data record and where it came from ("data/x.jsonl:12"), for errors that name the line."""

    where: str
    fields: dict[str, Any]


def _line_of(data: bytes | str, offset: int) -> int:
    """The 1-based line that holds ``offset`` (a byte offset in bytes, a character offset in text)."""
    if isinstance(data, bytes):
        return data.count(b"\n", 0, offset) + 1
    return data.count("\n", 0, offset) + 1


def read_text(path: Path) -> str:
    """The file as text; a binary file or one that is not UTF-8 is refused naming the line of the first bad byte."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the file ({exc.strerror})") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(
            f"{path}:{_line_of(data, nul)}: a NUL byte (byte offset {nul}): this is a binary file, not text; "
            "data files must be UTF-8 text"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}:{_line_of(data, exc.start)}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset "
            f"{exc.start}); save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")  # a byte order mark some editors write


def _lines(text: str) -> list[str]:
    """The file's lines as an editor numbers them: split at LF only, a CR before it dropped (CRLF files)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _documents(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(first line, text) of each run of non-blank lines; each line's trailing whitespace trimmed."""
    start, block = 0, []
    for number, line in enumerate([*lines, ""], 1):
        if line.strip():
            start = start or number
            block.append(line.rstrip())
        elif block:
            yield start, "\n".join(block)
            start, block = 0, []


def read_notes(path: Path) -> list[Record]:
    """A plain-text file: one record {"text": ...} per document, documents separated by blank lines."""
    records = [Record(f"{path}:{n}", {"text": text}) for n, text in _documents(_lines(read_text(path)))]
    if not records:
        raise ConfigError(f"{path}: no text: the file is empty or holds only blank lines")
    return records


def read_notes_folder(folder: Path, key: str) -> list[Record]:
    """Every .txt and .md file under ``folder`` (sorted by path) as one document, named by its first line."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    records = []
    for path in files:
        lines = _lines(read_text(path))
        first = next((n for n, line in enumerate(lines, 1) if line.strip()), None)
        if first is not None:
            records.append(Record(f"{path}:{first}", {"text": "\n".join(line.rstrip() for line in lines).strip()}))
    if not records:
        found = f"its {len(files)} .txt/.md files are empty" if files else "it holds no .txt or .md file"
        raise ConfigError(f"{key}: {folder}: no text: {found} (data.format: text reads one document per file)")
    return records


def _json_object(value: Any, where: str) -> Record:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: a record must be a JSON object, not {type(value).__name__}")
    return Record(where, value)


def _json_lines(text: str, path: Path) -> list[Record]:
    """A JSON object per line; blank lines are skipped."""
    records = []
    for number, line in enumerate(_lines(text), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        records.append(_json_object(value, f"{path}:{number}"))
    return records


def read_jsonl(path: Path) -> list[Record]:
    """Every line a JSON object; an error names the file and the line."""
    return _json_lines(read_text(path), path)


def _skip_space(text: str, offset: int) -> int:
    match = _JSON_SPACE.match(text, offset)
    return match.end() if match else offset


def _array_items(text: str) -> Iterator[tuple[int, Any]]:
    """(offset, value) of each element of the JSON array ``text`` (already known to parse)."""
    decoder = json.JSONDecoder()
    offset = _skip_space(text, text.index("[") + 1)
    while text[offset] != "]":
        value, end = decoder.raw_decode(text, offset)
        yield offset, value
        offset = _skip_space(text, end)
        if text[offset] == ",":
            offset = _skip_space(text, offset + 1)


def read_json(path: Path) -> list[Record]:
    """A JSON array of objects (each named by the line it starts on), one object, or an object per line."""
    text = read_text(path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("["):
            raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        return _json_lines(text, path)  # an object per line, or a broken one: named by its line
    if isinstance(whole, list):
        return [_json_object(value, f"{path}:{_line_of(text, at)}") for at, value in _array_items(text)]
    return [_json_object(whole, f"{path}:{_line_of(text, len(text) - len(text.lstrip()))}")]


def read_csv(path: Path) -> list[Record]:
    """A header line, then one record per row (a quoted field may span lines: the row's first line names it)."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    header: list[str] | None = None
    records = []
    start = 1
    try:
        for row in reader:
            where, start = f"{path}:{start}", reader.line_num + 1
            if not row:
                continue  # a blank line
            if header is None:
                header = [name.strip() for name in row]
            elif len(row) != len(header):
                fix = (
                    "quote a field that holds a comma" if len(row) > len(header) else "write every field, empty or not"
                )
                raise ConfigError(
                    f"{where}: {len(row)} fields where the header has {len(header)} ({', '.join(header)}); {fix}"
                )
            else:
                records.append(Record(where, dict(zip(header, row, strict=True))))
    except csv.Error as exc:
        raise ConfigError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    return records


READERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".csv": read_csv,
    ".txt": read_notes,
    ".md": read_notes,
}
