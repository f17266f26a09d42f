"""The code archive the controller sends to every host (role code_sync unpacks it).

Which files and their hash: ``ugro.module_utils.ugro_codetree``, the same code that the host module
``ugro_code_tree`` verifies the unpacked copy with -- the job starts only where the hashes match.
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

from ugro.module_utils.ugro_codetree import MANIFEST, code_files, tree_hash


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
        # The newest code file's time, not now: unchanged code packs to the same archive.
        info.mtime = max((int((root / rel).stat().st_mtime) for rel in files), default=0)
        with manifest.open("rb") as handle:
            tar.addfile(info, handle)
    return tree_hash(root, files)


def main(argv: list[str]) -> int:
    """``pack ROOT ARCHIVE``: write the archive and print its tree hash (what the Molecule scenario uses)."""
    if len(argv) != 3 or argv[0] != "pack":
        print("usage: python -m ugro.hosts.codesync pack ROOT ARCHIVE", file=sys.stderr)
        return 2
    print(pack(Path(argv[1]), Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
