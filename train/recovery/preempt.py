"""Checkpoint and stop on request: a batch scheduler's warning before its time limit.

SLURM (``#SBATCH --signal=B:USR1@<seconds>``) warns the batch script some time before it kills a job;
the script creates a file (``UGRO_STOP_FILE``, on the shared filesystem) and passes the signal to every
rank (``UGRO_STOP_SIGNAL=USR1``), which then only sets a flag. After each optimizer step all ranks
agree (one one-element all-reduce, so no rank stops a step before another), write a checkpoint of that
step, and end with :class:`Preempted`: run.json says ``stopped`` with the cause, and a restart with
``--resume auto`` continues from that very step. The file keeps a warning that came while the ranks
were still starting (before the handler was installed) from being lost.

Without either variable (a LAN launch) nothing is installed and ``Preemption.requested`` costs nothing: no
collective, no handler.
"""

from __future__ import annotations

import atexit
import os
import signal
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from train.dist import comm
from train.dist.health import GroupHealth
from train.metrics import write_status
from train.recovery.failure import Stopped

ENV = "UGRO_STOP_SIGNAL"
FILE_ENV = "UGRO_STOP_FILE"


class Preempted(Stopped):
    """Every rank stopped after the same step, with a checkpoint of it: ``--resume auto`` continues there."""


class Preemption:
    """The scheduler's warning as this rank sees it (the module says how): installed from the environment."""

    def __init__(self, health: GroupHealth) -> None:
        self.health = health  # the guard of its collectives (train/dist/health.py)
        name = os.environ.get(ENV, "").strip().upper()
        self.stop_file = os.environ.get(FILE_ENV) or None
        self.signal: signal.Signals | None = None
        self.asked = False
        self.enabled = bool(name or self.stop_file)
        if name:
            self.signal = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            signal.signal(self.signal, self._on_signal)
            # Python's shutdown resets a signal it handles to its default action (which ends the process) but
            # leaves an ignored one alone: a warning during a rank's last seconds must not turn its exit into a kill.
            atexit.register(signal.signal, self.signal, signal.SIG_IGN)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.asked = True

    def requested(self) -> bool:
        """Collective when enabled (every rank must call it after the same step): whether any rank was asked."""
        if not self.enabled:
            return False
        asked = self.asked or (self.stop_file is not None and os.path.exists(self.stop_file))
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return asked
        flag = comm.tensor([1 if asked else 0], torch.int32)
        return self.health.result(comm.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), lambda: bool(flag.item()))

    def stop(self, run_dir: Path, is_main: bool, step: int) -> Preempted:
        """Collective, once the checkpoint of ``step`` is written: the ending to raise on every rank.

        The main rank marks run.json ``stopped`` before the others may leave: once one rank's process has
        ended, torchrun stops the rest of its host.
        """
        name = self.signal.name if self.signal is not None else "the stop file"
        exc = Preempted(
            f"{name} (the scheduler's warning before its time limit): checkpoint of step {step} written; "
            "a restart with --resume auto continues from it"
        )
        if is_main:
            write_status(run_dir, state="stopped", step=step, error=str(exc))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.health.wait(comm.all_reduce(comm.zeros(1, torch.int32), async_op=True))  # a barrier, guarded
        return exc
