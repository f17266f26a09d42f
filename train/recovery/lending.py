"""A host lends its GPU to the run and takes it back: the files that say so, on the host's own disk.

The hosts are people's own machines. A host is taken back by hand (``make release HOST=...``: the controller writes
the request through Ansible) or by its owner's use of the GPU (the host's launcher watches it: train/recovery/owner.py)
by one file in the host's directory of the run:

- ``hosts/<host>/release.json`` (``REQUEST``): the host is wanted back, since when, by whom and why. Each rank of the
  host reads it at the start of every step and says so in that step's exchange (train/balance/step.py), so every rank
  of the group learns it in the same step; after the step, the host's ranks leave and the others go on without them
  (train/recovery/membership.py ``after_step``), nothing redone. Removing it (``make lend``, or the owner's GPU free
  again) lends the host back: its launcher starts its ranks in join mode and the group takes them in after a step,
  with the step, weights and optimizer state (train/recovery/rejoin.py).
- ``hosts/<host>/lent.json`` (``LENT``): written by the host's ranks as they leave: the step they took part in last,
  the group they left, why. Its launcher reads it to tell a host that was taken back from one whose ranks crashed,
  `make status` and the exporter show it; the ranks remove it once the group took them in again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REQUEST = "release.json"
LENT = "lent.json"
BY_HAND = "hand"
BY_OWNER = "owner"
CODES = {BY_HAND: 1, BY_OWNER: 2}  # who wants a host back, as a rank's term of the step's exchange


@dataclass(frozen=True)
class Request:
    """The host is wanted back: ``by`` "hand" (make release) or "owner" (its owner's use: train/recovery/owner.py)."""

    since: float
    by: str
    why: str

    def line(self, host: str) -> str:
        return f"{taken_back(host, CODES.get(self.by, 1))}: {self.why}"

    @property
    def code(self) -> int:
        return CODES.get(self.by, 1)


def taken_back(host: str, code: int) -> str:
    """What a rank of another host tells of one wanted back, from its code in the step's exchange."""
    return f"{host} taken back by {'its owner' if code == CODES[BY_OWNER] else 'hand'}"


@dataclass(frozen=True)
class Lent:
    """This host's ranks left the run: after ``step``, out of the group's ``generation``, for ``request``."""

    since: float
    step: int
    attempt: int
    generation: int
    main: str  # the main host of the group they left to
    request: Request


def _write(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.tmp{os.getpid()}")
    partial.write_text(json.dumps(data), encoding="utf-8")
    os.replace(partial, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ask(host_dir: Path, by: str, why: str) -> Request:
    """Take the host back (the request stays until ``withdraw``); an earlier request keeps its time and reason."""
    found = request(host_dir)
    if found is not None:
        return found
    made = Request(round(time.time(), 3), by, why)
    host_dir.mkdir(parents=True, exist_ok=True)
    _write(host_dir / REQUEST, asdict(made))
    return made


def request(host_dir: Path) -> Request | None:
    """The request to take the host back, or None (also for a file that does not parse: nobody wrote it whole)."""
    data = _read(host_dir / REQUEST)
    if data is None:
        return None
    try:
        return Request(float(data["since"]), str(data["by"]), str(data["why"]))
    except (KeyError, TypeError, ValueError):
        return None


def withdraw(host_dir: Path, by: str | None = None) -> bool:
    """Lend the host back: remove the request (only one made ``by`` that decider, where given). Whether one went."""
    found = request(host_dir)
    if found is None or (by is not None and found.by != by):
        return False
    (host_dir / REQUEST).unlink(missing_ok=True)
    return True


def record_left(host_dir: Path, lent: Lent) -> None:
    """The host's ranks left the run (every rank of the host writes the same record before it ends)."""
    _write(host_dir / LENT, asdict(lent))


def left(host_dir: Path) -> Lent | None:
    data = _read(host_dir / LENT)
    if data is None:
        return None
    try:
        req = data["request"]
        return Lent(float(data["since"]), int(data["step"]), int(data["attempt"]), int(data["generation"]),
                    str(data["main"]), Request(float(req["since"]), str(req["by"]), str(req["why"])))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None


def back(host_dir: Path) -> None:
    """The host's ranks are in the group again."""
    (host_dir / LENT).unlink(missing_ok=True)
