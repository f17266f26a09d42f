"""sha256 of files and folders, without torch: checkpoints check their manifest with it, and a run records the
digest of its data with it (what the model card names the data by)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The sha256 of a file, as ``sha256sum`` prints it."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_tree(folder: Path) -> str:
    """The sha256 of a folder: of the ``sha256sum`` listing of its files, paths relative to the folder in byte
    order; in a shell: ``cd FOLDER && find . -type f -printf '%P\\0' | LC_ALL=C sort -z | xargs -0 sha256sum |
    sha256sum``."""
    files = sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file())
    listing = "".join(f"{sha256_file(p)}  {name}\n" for name, p in files)
    return hashlib.sha256(listing.encode()).hexdigest()
