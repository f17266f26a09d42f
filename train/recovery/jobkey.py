"""The job's key, on the rank's side: a secret every member of a run holds and an outsider does not, so that what a
member writes to a store can be told from what anyone who reaches the store's port could write.

The controller makes it once per run and the launch writes it into every host's run directory, 0600
(ugro/module_utils/ugro_jobkey.py, library/ugro_job.py); a run started without a controller (a launcher on one
machine, the tests) makes it where it is missing, in the run directory its hosts share. A value is proven by
``proof(key, fields)``: HMAC-SHA256 over the fields' canonical JSON.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

FILE = "job.key"  # ugro/module_utils/ugro_jobkey.py FILE
KEY_BYTES = 32


def path(run_dir: Path) -> Path:
    return Path(run_dir) / FILE


def read(run_dir: Path) -> bytes | None:
    """The run's key, or None where this host has none."""
    try:
        key = bytes.fromhex(path(run_dir).read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return key if len(key) == KEY_BYTES else None


def ensure(run_dir: Path) -> bytes:
    """The run's key, made where there is none: the first process to get here makes it (an exclusive link), the
    others read that one."""
    found = read(run_dir)
    if found is not None:
        return found
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    partial = path(run_dir).with_name(f".{FILE}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(secrets.token_hex(KEY_BYTES) + "\n")
    try:
        os.link(partial, path(run_dir))
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    found = read(run_dir)
    if found is None:
        raise OSError(f"{path(run_dir)} holds no job key")
    return found


def proof(key: bytes, fields: dict[str, Any]) -> str:
    """The HMAC of ``fields`` (canonical JSON) under the run's key."""
    return hmac.new(key, json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def proves(key: bytes, fields: dict[str, Any], claimed: object) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(proof(key, fields), claimed)
