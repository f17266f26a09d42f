"""Why a rank ended: the cause of every failure, recorded where the controller and `make doctor` read it.

Each rank that fails appends one JSON line to ``<run>/hosts/<host>/failures.jsonl``:
``{"kind", "message", "host", "rank", "step", "attempt", "time"}``. A rank that vanished (SIGKILL,
a crash, a host that went away) writes nothing: the controller tells it apart by its missing line.

Kinds: ``config`` (a bad job file or profile), ``non_finite`` (NaN/Inf loss or gradient), ``oom`` (CUDA or
host memory), ``collective`` (a peer was lost, or a collective timed out), ``stopped`` (SIGTERM/SIGINT:
`make stop`, or torchrun ending the rank because another one failed), ``error`` (anything else).
Only ``config`` and ``non_finite`` are not worth a restart: they would fail again the same way.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from train.config import ConfigError
from train.dist import health

FAILURES = "failures.jsonl"
NOT_RESTARTABLE = frozenset({"config", "non_finite"})


class NonFiniteError(RuntimeError):
    """The loss or the gradient went NaN/Inf; the run stops and keeps its last good checkpoint."""


class RejoinError(RuntimeError):
    """Ranks started again to rejoin the running group found none to rejoin, or were not taken in
    (train/recovery/rejoin.py): the run ended, every other host is gone, or its ranks hold pipeline stages. Not retried
    on this host."""


class Stopped(BaseException):
    """SIGTERM or SIGINT reached the rank (BaseException: no ``except Exception`` swallows it)."""


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str
    host: str
    rank: int
    step: int | None
    attempt: int
    time: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StopSignals:
    """SIGTERM/SIGINT turned into :class:`Stopped`, and the stop this process received (the worker holds it; signal
    dispositions are the process's, so is this): once a stop came, whatever ends the rank ends it because of the stop.
    The handler's ``Stopped`` can come out in another form: raised while Python ran a future's callback (DDP's
    communication hook), torch hands it on as a ``RuntimeError`` with its text; a peer that the same stop ended fails
    this rank's collective."""

    def __init__(self) -> None:
        self.received: Stopped | None = None
        signal.signal(signal.SIGTERM, self._raise_stopped)
        signal.signal(signal.SIGINT, self._raise_stopped)

    def _raise_stopped(self, signum: int, _frame: FrameType | None) -> None:
        # Only the first: a stop reaches a rank more than once (make stop signals the rank and its launch's process
        # group, and torchrun's agent passes its own SIGTERM on), and a second Stopped would cut short the rank's
        # record of why it ended. SIGKILL stays the hard stop.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.received = Stopped(f"{signal.Signals(signum).name} received")
        raise self.received

    def stopped(self) -> bool:
        return self.received is not None


def stop_on_signals() -> StopSignals:
    """Turn SIGTERM/SIGINT into :class:`Stopped`, so that a stopped rank records why it ended."""
    return StopSignals()


def kind_of(exc: BaseException, stopped: bool = False) -> str:
    """The failure's kind; ``stopped``: a stop reached the rank (whatever carried it out is the stop)."""
    if isinstance(exc, ConfigError):
        return "config"
    if isinstance(exc, NonFiniteError):
        return "non_finite"
    if isinstance(exc, Stopped) or stopped:
        return "stopped"
    if isinstance(exc, RejoinError):
        return "rejoin"
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return "oom"
    if health.collective_error(exc):
        return "collective"
    return "error"


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The exception as one readable line: its type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = health.one_line(exc)
    if isinstance(exc, ConfigError):
        text = " ".join(lines) or text  # the whole message: it names the file, key and fix
    if isinstance(exc, NonFiniteError):
        text = "non-finite loss or gradient: " + " ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def record(run_dir: Path, exc: BaseException, host: str, rank: int, step: int | None,
           signals: StopSignals | None = None) -> Failure:  # fmt: skip
    """Append this rank's failure to its host's failures.jsonl; returns it."""
    received = signals.received if signals is not None else None
    cause = exc if isinstance(exc, Stopped) else received or exc  # what carried a stop out is not its cause
    failure = Failure(
        kind=kind_of(exc, received is not None),
        message=one_line(cause),
        host=host,
        rank=rank,
        step=step,
        attempt=int(os.environ.get("UGRO_ATTEMPT", "0")),
        time=round(time.time(), 3),
    )
    host_dir = run_dir / "hosts" / host
    host_dir.mkdir(parents=True, exist_ok=True)
    with (host_dir / FAILURES).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(failure.to_dict()) + "\n")
    return failure
