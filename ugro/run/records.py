"""What a run records about its failures: the cause of a fault, each restart, and the run's final record.

The controller writes them into the run's ``run.json`` (beside what the ranks write there) and reads them back
for ``make doctor``; the ``make train`` summary prints them. One typed shape from the fault to the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from train.metrics import write_status


@dataclass(frozen=True)
class Cause:
    """The root cause of a fault: a rank's own record kind (oom, collective, error, ...), or lost / unreachable /
    vanished / launch for what the controller saw itself."""

    kind: str
    message: str
    host: str
    rank: int | None = None

    def line(self) -> str:
        where = f"{self.host}" + (f" rank {self.rank}" if self.rank is not None else "")
        return f"{self.kind} on {where}: {self.message}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cause:
        rank = data.get("rank")
        return cls(str(data.get("kind") or "error"), str(data.get("message") or ""), str(data.get("host") or "?"),
                   int(rank) if rank is not None else None)  # fmt: skip


@dataclass
class Restart:
    """One relaunch after a fault: why, from where to where, and what it cost. The figures after ``last_step_seen``
    are known only once the relaunch ran its first step (``settled``)."""

    attempt: int
    time: float  # when the fault was detected (epoch seconds)
    cause: Cause
    hosts_before: list[str]
    hosts_after: list[str]
    left_out: list[str]
    main_host: str
    checkpoint_step: int | None  # the checkpoint the relaunch was given (None: from step 0)
    last_step_seen: int
    stop_s: float = 0.0
    place_checkpoint_s: float = 0.0
    launch_s: float | None = None
    resumed_from_step: int | None = None
    steps_redone: int | None = None
    steps_redone_estimated: bool = False  # no poll saw the first step: from the checkpoint, not the ranks' record
    recovered_after_s: float | None = None
    how: str = "relaunch"  # relaunch (from a checkpoint) or regroup (the survivors went on in their processes)
    membership_s: float | None = None  # regroup: the controller telling the survivors who is left
    regroup_s: float | None = None  # regroup: the ranks' own, from the collective that failed to the new group
    # regroup: who named the members ("survivors": no controller followed; "rejoin": the group took back in a host
    # whose crashed ranks were started again, train/recovery/rejoin.py)
    decided_by: str = "controller"

    @property
    def settled(self) -> bool:
        return self.steps_redone is not None

    def settle(self, from_step: int, last_step: int, estimated: bool = False) -> None:
        self.resumed_from_step = from_step
        self.steps_redone = max(0, max(last_step, self.last_step_seen) - from_step)
        self.steps_redone_estimated = estimated

    def line(self) -> str:
        """One line for a person: ``restart 1: lost on tb3: ... -> relaunched on tb1, tb2 from step 8 (2 steps
        redone)``."""
        redone = "?" if self.steps_redone is None else str(self.steps_redone)
        start = "?" if self.resumed_from_step is None else str(self.resumed_from_step)
        done = "relaunched"
        if self.how == "regroup":
            done = "regrouped" + (" by the survivors themselves" if self.decided_by == "survivors" else "")
            if self.decided_by == "rejoin":
                done = "taken back in"
            if self.decided_by == "released":
                done = "went on"
        return (f"restart {self.attempt}: {self.cause.line()} -> {done} on {', '.join(self.hosts_after)} "
                f"from step {start} ({redone} steps redone)")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Restart:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("main_host", str(data.get("rendezvous") or ""))  # a record of before the key was renamed
        values["cause"] = Cause.from_dict(data.get("cause") or {})
        return cls(**values)


@dataclass
class RunRecord:
    """The controller's part of run.json: how the run ended, on which hosts, and every restart."""

    hosts: list[str]
    main_host: str
    state: str = "finished"
    cause: Cause | None = None
    restarts: list[Restart] = field(default_factory=list)
    copy_failures: list[str] = field(default_factory=list)  # checkpoint copies to the controller that failed

    def write(self, run_dir: Path) -> None:
        values: dict[str, Any] = {
            "restarts": [r.to_dict() for r in self.restarts],
            "hosts": self.hosts,
            "main_host": self.main_host,
        }
        if self.copy_failures:
            values["copy_failures"] = self.copy_failures
        if self.state != "finished":  # a finished run's state is the ranks' own ("finished")
            values["state"] = self.state
        if self.cause is not None:
            values |= {"cause": asdict(self.cause), "error": self.cause.line()}
        run_dir.mkdir(parents=True, exist_ok=True)
        write_status(run_dir, **values)

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord | None:
        """The record in ``run_dir/run.json``, or None where there is none (a run that never started, or a
        file that is not a record)."""
        try:
            data = json.loads((run_dir / "run.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        cause = data.get("cause")
        return cls(
            hosts=[str(h) for h in data.get("hosts") or []],
            main_host=str(data.get("main_host") or data.get("rendezvous") or ""),  # its former key
            state=str(data.get("state") or "finished"),
            cause=Cause.from_dict(cause) if isinstance(cause, dict) else None,
            restarts=[Restart.from_dict(r) for r in data.get("restarts") or [] if isinstance(r, dict)],
            copy_failures=[str(line) for line in data.get("copy_failures") or []],
        )
