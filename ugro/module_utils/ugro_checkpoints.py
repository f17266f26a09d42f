"""Which checkpoints of a run are intact, checked against their sha256 manifests (standard library only).

The trainer writes ``<run>/checkpoints/step-NNNNNN/{adapter/, state.pt, manifest.json}``, the manifest last
(train/recovery/checkpoint.py, which checks its own writes with the same rule). Used by the host fact module
(``gather_subset: checkpoint``: the newest intact checkpoint a host holds) and by the controller, which keeps
its own verified copy of every checkpoint while it follows a run (ugro/run/replicas.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "step-"
MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    """The sha256 of a file, as ``sha256sum`` prints it (the same as ``train/digest.py``'s, which the rank code
    uses: this file ships alone to hosts, where ``train/`` is not importable)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def step_of(path: Path) -> int | None:
    digits = path.name[len(PREFIX) :]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


def listed(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, oldest first (whether intact or not)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def problem(path: Path) -> str | None:
    """None when every file the manifest lists is there with its checksum, else what is wrong: the rule of
    ``train/recovery/checkpoint.py`` ``verify``, which the ranks apply before they load one (this file ships alone to
    hosts; tests/test_checkpoint.py holds the two equal)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest (the write never finished)"
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if not isinstance(files, dict):
        return "unreadable manifest"
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if sha256_file(file) != expected:
            return f"{rel} does not match its checksum"
    return None


def newest_intact(run_dir: Path, check: Callable[[Path], str | None] = problem) -> dict[str, Any] | None:
    """{name, step, path} of the newest checkpoint that passes its manifest (``check``: what is wrong with one,
    None when nothing), or None."""
    for path in reversed(listed(run_dir)):
        if check(path) is None:
            return {"name": path.name, "step": step_of(path), "path": str(path)}
    return None
