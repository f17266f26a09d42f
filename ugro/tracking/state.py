"""runs/<job-id>/tracking.json: per tracker, the ids of its run (one tracker run per job, continued by a resumed run
and by `make follow`) and how far the run's records were forwarded to it (each row once)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FILE = "tracking.json"


@dataclass
class TrackerState:
    """One tracker's run and cursor: ``step``, the newest metrics.jsonl row logged whole; ``eval_step``, the newest
    eval.jsonl row logged; ``live``, steps after ``step`` of which only a poll's figures were logged (a remote
    cluster's newest row: the rest of those rows is logged once the run's records are fetched)."""

    ids: dict[str, str] = field(default_factory=dict)  # the tracker's own: run id, experiment, URI ...
    step: int = 0
    eval_step: int = -1
    live: list[int] = field(default_factory=list)
    params: bool = False  # the job's settings were logged (a continued run does not log them again)
    ended: str | None = None  # the state the tracker run was ended with, None while it is open

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrackerState:
        return cls(
            ids={str(k): str(v) for k, v in dict(data.get("ids") or {}).items()},
            step=int(data.get("step") or 0),
            eval_step=int(data.get("eval_step", -1)),
            live=[int(s) for s in data.get("live") or []],
            params=bool(data.get("params")),
            ended=data.get("ended"),
        )


@dataclass
class TrackingFile:
    """tracking.json of one run directory; only the feed's worker thread writes it."""

    path: Path
    trackers: dict[str, TrackerState] = field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: Path) -> TrackingFile:
        path = run_dir / FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        trackers = data.get("trackers") if isinstance(data, dict) else None
        found = {str(k): TrackerState.from_dict(v) for k, v in (trackers or {}).items() if isinstance(v, dict)}
        return cls(path, found)

    def tracker(self, name: str) -> TrackerState:
        return self.trackers.setdefault(name, TrackerState())

    def write(self) -> None:
        """Atomically: a reader never sees half a file. Not where the run's directory is gone (a launch that failed
        before anything started leaves none behind)."""
        if not self.path.parent.is_dir():
            return
        data = {"trackers": {name: asdict(state) for name, state in self.trackers.items()}}
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, self.path)
