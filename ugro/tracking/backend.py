"""What every tracker does for the feed (ugro/tracking/feed.py), and what it is built from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ugro.tracking.records import Point


@dataclass(frozen=True)
class Setup:
    """The run a tracker reports: its id and directory, the job's settings (nested, as the job file has them), and
    what the controller adds to them (code hash, hosts)."""

    job_id: str
    run_dir: Path
    settings: dict[str, Any]
    code_hash: str
    hosts: list[str]

    def params(self) -> dict[str, Any]:
        """The job's settings and the run's own: job id, code hash, hosts."""
        return self.settings | {"ugro": {"job_id": self.job_id, "code_hash": self.code_hash, "hosts": self.hosts}}


class Backend(Protocol):
    """One tracker. Every method may raise whatever its library raises: the feed turns it into one warning and
    drops the tracker."""

    name: str  # as a person names it: "MLflow", "W&B"
    where: str  # where it logs: the tracking URI, the project
    fix: str  # what to do where it cannot be reached

    def open(self, ids: dict[str, str]) -> dict[str, str]:
        """Continue the tracker run ``ids`` names (the ids an earlier ``open`` returned), or start one; its ids."""
        ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_points(self, points: list[Point]) -> None: ...

    def log_artifacts(self, files: list[tuple[Path, str]]) -> None:
        """Each (file or directory, folder in the tracker run: '' the top)."""
        ...

    def finish(self, state: str) -> None:
        """End the tracker run by the run's outcome: finished, failed or stopped."""
        ...

    def detach(self) -> None:
        """Let go of the tracker run, left open for a later ``open`` to continue (`make follow`)."""
        ...

    def close(self) -> None:
        """Release what the tracker's library holds (a service process), the tracker run as it is."""
        ...
