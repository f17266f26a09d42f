"""Where the seconds go from `make train` to the first optimizer step: the controller's own phases, the launch
playbook's (facts, code sync, launch tasks, from its events), and the ranks' (torchrun's start and the model
load, the first step), as the main rank recorded them (run.json ``phases``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ugro.hosts.playbook import PlaybookRun

# The launch playbook's roles, as its events name them, and what they are to a person.
ROLES = {"": "facts and checks", "ugro": "facts and checks", "code_sync": "code sync", "train_launch": "launch"}


@dataclass
class Phases:
    """Moments of the controller's first launch, in epoch seconds."""

    process: float = field(default_factory=lambda: psutil.Process().create_time())
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def seconds(self, launch: PlaybookRun | None, ranks: dict[str, Any] | None) -> dict[str, float]:
        """Each phase's seconds, in order, ending with the total from the controller's start to the first step."""
        out: dict[str, float] = {}
        last = self.process
        for name in ("controller start", "preflight", "code archive"):
            if name in self.marks:
                out[name] = self.marks[name] - last
                last = self.marks[name]
        for role, ended in (launch.role_ends if launch is not None else {}).items():
            label = ROLES.get(role, role)
            out[label] = out.get(label, 0.0) + max(0.0, ended - last)
            last = max(last, ended)
        ranks = ranks or {}
        loaded, first = ranks.get("loaded"), ranks.get("first_step")
        if isinstance(loaded, int | float):  # torchrun started during the launch playbook's last tasks
            out["ranks' start (imports, model, data)"] = max(0.0, loaded - last)
            last = max(last, loaded)
        if isinstance(first, int | float):
            out["first step"] = first - last
            out["total: make train -> first step"] = first - self.process
        return {k: round(v, 2) for k, v in out.items()}


def line(seconds: dict[str, float]) -> str:
    """One line for a person: ``controller start 1.1 s, preflight 2.3 s, ... = 14.2 s``."""
    parts = [f"{k} {v:.1f} s" for k, v in seconds.items() if not k.startswith("total")]
    total = next((v for k, v in seconds.items() if k.startswith("total")), None)
    return ", ".join(parts) + (f" = {total:.1f} s" if total is not None else "")


def recorded(run_dir: Path) -> dict[str, float] | None:
    """The first launch's phases as `ugro train` recorded them in the run's run.json (``launch_phases``: what
    ``Phases.seconds`` gave), or None where there are none (a run that is not over, or not launched by it)."""
    try:
        data = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    found = data.get("launch_phases") if isinstance(data, dict) else None
    if not isinstance(found, dict):
        return None
    return {str(k): float(v) for k, v in found.items() if isinstance(v, int | float)}
