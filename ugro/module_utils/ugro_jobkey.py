"""The job's key, on the controller's and the host module's side (standard library only): the controller makes one
per run (``new_hex``, kept in ``runs/<job>/job.key`` on the controller, 0600); the launch writes it into every host's
run directory (library/ugro_job.py ``job_key``), where the ranks read it (train/recovery/jobkey.py: its format)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE = "job.key"  # train/recovery/jobkey.py FILE
KEY_BYTES = 32


def new_hex() -> str:
    return secrets.token_hex(KEY_BYTES)


def controller_key(run_dir: Path) -> str:
    """The run's key on the controller, made at its first launch (0600) and the same at every relaunch."""
    file = Path(run_dir) / FILE
    if not file.is_file():
        write(run_dir, new_hex())
    return file.read_text(encoding="ascii").strip()


def write(run_dir: Path, key_hex: str) -> bool:
    """Write ``key_hex`` as the run's key (mode 0600, owned by the caller, never through a link); whether it
    changed anything."""
    if len(bytes.fromhex(key_hex)) != KEY_BYTES:
        raise ValueError(f"a job key is {2 * KEY_BYTES} hex digits")
    file = Path(run_dir) / FILE
    try:
        same = file.read_text(encoding="ascii").strip() == key_hex and (file.lstat().st_mode & 0o177) == 0
    except OSError:
        same = False
    if same and not file.is_symlink():
        return False
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f".{FILE}.{os.getpid()}")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(key_hex + "\n")
    os.replace(partial, file)
    return True
