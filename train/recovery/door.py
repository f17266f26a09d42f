"""The main rank's door: hosts whose ranks came back ask to rejoin in its regroup store (train/recovery/rejoin.py), and
each step's exchange (train/balance/step.py ``exchange``) carries how many wait, so that every rank of the group learns
it in the same step and they take them in together after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class _Door:
    store: dist.Store | None = None  # the main rank's own regroup store; None on every other rank
    attempt: int = 0
    answered: int = 0  # requests taken in or refused
    announced: int = 0  # the last exchange's count of waiting requests


_DOOR = _Door()


def count_key(attempt: int) -> str:
    """The store key counting launch ``attempt``'s requests; request ``i`` is under ``f"{count_key}-{i}"``."""
    return f"ugro-join-{attempt}"


def answer_key(attempt: int, index: int) -> str:
    return f"ugro-admit-{attempt}-{index}"


def keep(store: dist.Store | None, attempt: int) -> None:
    """After every change of group: the main rank keeps the door (its host's store), every other rank none. A host
    that becomes the main one counts from the requests its store holds now."""
    moved = store is not None and store is not _DOOR.store
    _DOOR.store, _DOOR.attempt = store, attempt
    if moved:
        _DOOR.answered = requests()


def requests() -> int:
    """The requests made at this door so far (0 on a rank that keeps none)."""
    return int(_DOOR.store.add(count_key(_DOOR.attempt), 0)) if _DOOR.store is not None else 0


def waiting() -> int:
    """The requests not answered yet: this rank's term of the step's exchange (0 on every rank but the main one)."""
    return max(0, requests() - _DOOR.answered)


def announced(count: int) -> None:
    """The exchange's sum of ``waiting``: every rank of the group sees the same."""
    _DOOR.announced = count


def due() -> bool:
    """Hosts wait at the door: after this step the group takes them in (train/recovery/rejoin.py ``admit``)."""
    return _DOOR.announced > 0


def unanswered() -> int:
    """The first request the main rank has not answered."""
    return _DOOR.answered


def answered(count: int) -> None:
    """The main rank answered every request before ``count``."""
    _DOOR.answered = max(_DOOR.answered, count)


def spent() -> None:
    """The group went through the door after the announcing step (every rank)."""
    _DOOR.announced = 0


def store() -> dist.Store | None:
    return _DOOR.store
