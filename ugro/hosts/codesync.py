"""The code archive the controller sends to every host (role code_sync unpacks it).

Which files and their hash: ``ugro.module_utils.ugro_codetree``, the same code that the host module
``ugro_code_tree`` verifies the unpacked copy with -- the job starts only where the hashes match.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

from ugro.module_utils.ugro_codetree import MANIFEST, code_files, contents_hash


def pack(root: Path, archive: Path) -> str:
    """Write the code archive (with its manifest) and return the tree hash.

    Each file is read once, and the archive, the manifest and the hash all come from that read: a job file
    written or removed while the archive is made (another command, another job) leaves a consistent archive
    of the tree as it was, never a hash the hosts cannot match.
    """
    contents: list[tuple[str, bytes]] = []
    newest = 0
    archive.parent.mkdir(parents=True, exist_ok=True)
    manifest = archive.parent / MANIFEST
    with tarfile.open(archive, "w:gz") as tar:
        for rel in code_files(root):
            try:
                with (root / rel).open("rb") as handle:
                    info = tar.gettarinfo(arcname=rel, fileobj=handle)
                    data = handle.read()
            except FileNotFoundError:
                continue  # removed since the walk
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            contents.append((rel, data))
            newest = max(newest, int(info.mtime))
        manifest.write_text("".join(f"{rel}\n" for rel, _ in contents))
        info = tar.gettarinfo(manifest, arcname=MANIFEST)
        info.mtime = newest  # the newest code file's time, not now: unchanged code packs to the same archive
        with manifest.open("rb") as handle:
            tar.addfile(info, handle)
    return contents_hash(contents)


def main(argv: list[str]) -> int:
    """``pack ROOT ARCHIVE``: write the archive and print its tree hash (what the Molecule scenario uses)."""
    if len(argv) != 3 or argv[0] != "pack":
        print("usage: python -m ugro.hosts.codesync pack ROOT ARCHIVE", file=sys.stderr)
        return 2
    print(pack(Path(argv[1]), Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
