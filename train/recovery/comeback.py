"""The host's side of a rejoin (train/launcher.py): after torchrun ended with a failure, whether this host's ranks start
again to rejoin the running group (train/recovery/rejoin.py), and starting them so.

They start again when a rank crashed (killed by a signal: the kernel's OOM killer, a segfault, a driver abort) or
failed with an error of its own (out of memory, an exception), while the other hosts of a multi-host run go on
without it; at most ``distributed.rejoins`` times in one launch, and no more than ``train.max_restarts``. They do
not when the failure would repeat or is not this host's (a bad job, a non-finite loss, a collective that failed
because a peer was lost, a rejoin that found no group) or when someone stopped the job (the launch script's stop
signal ends this process before it gets here).

A rank started again has no rendezvous with the other hosts (their torchrun agents are in the middle of their own
launch): this host's torchrun runs its ranks alone (a c10d rendezvous on this host), and the ranks find the group
through the regroup stores. ``hosts/<host>/rejoin.json`` says meanwhile that they are coming back (the controller's
status poll reads it: ugro/module_utils/ugro_jobstate.py); the ranks remove it once the group took them in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.recovery import lending
from train.recovery.failure import FAILURES

JOIN_ENV = "UGRO_JOIN"  # train/recovery/rejoin.py reads it
MARK = "rejoin.json"
ENDED = "ended.json"  # the ranks' word that the run is over for this host (``ended``)
LENT_WAIT_S = 2.0  # between two looks, while the host is lent, at its request and at the running group
GONE_LOOKS = 3  # looks in a row at no running group before a lent host's launcher ends
NOT_RETRIED = frozenset({"config", "non_finite", "collective", "rejoin"})
OWN_FAILURES = frozenset({"oom", "error"})


@dataclass(frozen=True)
class Place:
    """Where this launcher runs: its host's directory of the run, and how many times its ranks may rejoin."""

    host_dir: Path | None
    rejoins: int
    lends: bool = False  # the host may be taken back and lent again (train/recovery/lending.py)

    @classmethod
    def of(cls, args: argparse.Namespace) -> Place:
        """From torchrun's arguments: the worker's ``--job`` and ``--run-dir``; no rejoin on a single-host run (no
        group goes on without this host) or where the job cannot be read (the ranks report that themselves)."""
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--job", type=Path)
        parser.add_argument("--run-dir", type=Path)
        worker, _ = parser.parse_known_args(list(args.training_script_args))
        host = os.environ.get("UGRO_HOST") or os.uname().nodename
        host_dir = worker.run_dir / "hosts" / host if worker.run_dir is not None else None
        if host_dir is None or worker.job is None or int(str(args.nnodes).split(":")[-1]) <= 1:
            return cls(host_dir, 0)
        from train.recovery.watch import scheduler

        if scheduler() is not None:  # its ranks never regroup by themselves: the scheduler's requeue resumes
            return cls(host_dir, 0)
        from train.config import ConfigError, load_job

        try:
            job = load_job(worker.job)
        except (ConfigError, OSError):
            return cls(host_dir, 0)
        # A rejoin restarts this host's ranks: no more often than the run may restart at all.
        return cls(host_dir, min(job.distributed.rejoins, job.train.max_restarts), lends=True)

    def records(self) -> int:
        """How many failure records this host has (train/recovery/failure.py ``FAILURES``)."""
        return len(self._records())

    def _records(self) -> list[dict[str, Any]]:
        if self.host_dir is None:
            return []
        try:
            lines = (self.host_dir / FAILURES).read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        found = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return found

    def kinds_since(self, seen: int) -> set[str]:
        """The kinds of the failure records written after the first ``seen``."""
        return {str(r.get("kind")) for r in self._records()[seen:]}

    def crashed(self, failure: Any, seen: int) -> str | None:
        """Why this host's ranks start again after torchrun's ``ChildFailedError``, or None when they do not.
        ``seen``: the failure records there were before this launch of torchrun."""
        kinds = self.kinds_since(seen)
        if kinds & NOT_RETRIED:
            return None
        codes = {int(rank): int(f.exitcode) for rank, f in failure.failures.items()}
        signalled = [f"rank {rank} killed by signal {-code}" for rank, code in codes.items() if code < 0]
        own = sorted(kinds & OWN_FAILURES)
        if not signalled and not own:
            return None
        return "; ".join(signalled + [f"a rank failed ({kind})" for kind in own])

    def lent_since(self, began: float) -> lending.Lent | None:
        """This host's ranks left the run because the host was taken back (train/recovery/lending.py), since
        ``began`` (this run of torchrun's start), or None."""
        lent = lending.left(self.host_dir) if self.host_dir is not None else None
        return lent if lent is not None and lent.since >= began else None

    def while_lent(self, lent: lending.Lent, group_runs: Callable[[], bool]) -> str | None:
        """Wait while the host is lent: until its request is withdrawn (`make lend`, or its owner's use is over) ->
        why its ranks start again; None when the run ended meanwhile (``group_runs`` said no, ``GONE_LOOKS`` times in
        a row). Nothing of the job holds the GPU meanwhile: this launcher never touched CUDA."""
        assert self.host_dir is not None
        print(f"ugro: {lent.request.line(self.host_dir.name)}; the ranks left after step {lent.step}: waiting to be "
              "lent again", flush=True)  # fmt: skip
        gone = 0
        while True:
            if lending.request(self.host_dir) is None:
                return f"lent to the run again (it had left after step {lent.step})"
            gone = 0 if group_runs() else gone + 1
            if gone >= GONE_LOOKS:
                return None
            time.sleep(LENT_WAIT_S)

    def come_back(self, args: argparse.Namespace, why: str, count: int, launch: int, lent: bool = False) -> None:
        """Start this host's ranks again, alone, to rejoin: the note, the old ranks' files gone, torchrun's arguments
        for a rendezvous of this host's ranks only. ``count``: the rejoins after a crash so far (a host lent again
        counts none); ``launch``: this launcher's runs of torchrun so far."""
        if self.host_dir is not None:
            for stale in [*self.host_dir.glob("worker-rank*.pid"), *self.host_dir.glob("rank*.json")]:
                stale.unlink(missing_ok=True)
            note = {"time": round(time.time(), 3), "rejoin": count, "of": self.rejoins, "why": why, "lent": lent,
                    "attempt": int(os.environ.get("UGRO_ATTEMPT", "0"))}  # fmt: skip
            partial = self.host_dir / f"{MARK}.tmp{os.getpid()}"
            partial.write_text(json.dumps(note), encoding="utf-8")
            os.replace(partial, self.host_dir / MARK)
        again = "" if lent else f" ({count} of {self.rejoins})"
        print(f"ugro: {why}: starting this host's ranks again to rejoin the run{again}", flush=True)
        os.environ[JOIN_ENV] = "1"
        args.nnodes, args.node_rank = "1", 0
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf = "c10d", "localhost:0", ""
        args.rdzv_id = f"{args.rdzv_id.split('-rejoin')[0]}-rejoin{launch}"


def ended(host_dir: Path, attempt: int, generation: int) -> None:
    """The ranks of this host are done with the run and every rank of the group has its results (train/loop.py): its
    launcher need not wait at torchrun's exit barrier for the agents of hosts that left the group (``EndWatch``)."""
    partial = host_dir / f".{ENDED}.tmp{os.getpid()}"
    partial.write_text(json.dumps({"time": round(time.time(), 3), "attempt": attempt, "generation": generation}),
                       encoding="utf-8")  # fmt: skip
    os.replace(partial, host_dir / ENDED)


class EndWatch:
    """The launcher's thread that ends it once this host's ranks finished a run whose group changed.

    torchrun's agent waits at its exit barrier, after its ranks succeeded, until every agent of the launch is there,
    for 300 s (torch's ``exit_barrier_timeout``, which torchrun does not let one set). After a change of group an agent
    never comes: the one of a host that was lost, taken back, or whose ranks came back under an agent of their own.
    Once the ranks said the run is over (``ended``) and none runs any more, the barrier has nothing left to wait for
    that will come: after ``GRACE_S`` the launcher ends with status 0, and the host says ``finished`` at once."""

    GRACE_S = 1.0

    def __init__(self, host_dir: Path, began: float) -> None:
        self.host_dir, self.began = host_dir, began
        threading.Thread(target=self._run, name="ugro-end-watch", daemon=True).start()

    def over(self) -> bool:
        import psutil

        try:
            mark = json.loads((self.host_dir / ENDED).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(mark, dict) or float(mark.get("time") or 0) < self.began:
            return False
        for path in self.host_dir.glob("worker-rank*.pid"):  # pid and start time (train/worker.py)
            try:
                pid, start = path.read_text(encoding="utf-8").split()[:2]
                if abs(psutil.Process(int(pid)).create_time() - float(start)) < 1:
                    return False  # a rank of this host still runs
            except (OSError, ValueError, psutil.Error):
                continue
        return True

    def _run(self) -> None:
        while not self.over():
            time.sleep(0.5)
        time.sleep(self.GRACE_S)
        print("ugro: this host's ranks are done and the group changed during the run: not waiting at torchrun's "
              "exit barrier for the agents of hosts that left it", flush=True)  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
