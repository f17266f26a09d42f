"""The feed: follows a run's records and forwards them to the job's trackers, in a worker thread of its own, so that
a slow or lost tracker never holds the supervisor's polls.

``Feed.start`` opens one tracker run per job (continued where runs/<job-id>/tracking.json names one), ``poll``
hands it each supervisor poll, ``finish`` ends it by the run's outcome after the run's records were collected, and
``detach`` lets go of it, still open, for `make follow`. On a local cluster each poll reads the new rows of
metrics.jsonl and eval.jsonl (the run's directory is the controller's); on a remote one a poll gives only the main
rank's newest row, which is logged, and the rest of every row is logged from the fetched records at the end. A
tracker that cannot be reached, or fails later, is one warning line and is dropped: the run and its records in
runs/<job-id>/ go on without it.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.config import JobConfig
from ugro.tracking.backend import Backend, Setup
from ugro.tracking.records import (
    LIVE_KEYS,
    Point,
    Records,
    Tail,
    artifacts,
    devices,
    eval_point,
    live_point,
    train_point,
    write_card,
)
from ugro.tracking.state import TrackerState, TrackingFile

Warn = Callable[[str], None]
Status = dict[str, Any]
DETACH_WAIT_S = 30.0  # Ctrl-C: how long the worker may take to let go of the trackers


def reason(exc: BaseException) -> str:
    """One line of why a tracker call failed: the OS's error where one is in it (connection refused), else the
    exception's first line."""
    text = str(exc)
    found = re.search(r"\[Errno -?\d+\] [^'\")\]]+", text)
    line = found.group(0).strip() if found else (text.strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {line[:200]}" if line else type(exc).__name__


@dataclass
class _Sink:
    """One tracker as the feed drives it."""

    key: str  # its job key: mlflow, wandb
    backend: Backend
    state: TrackerState
    sent_devices: dict[str, str] = field(default_factory=dict)
    alive: bool = True


def backends(job: JobConfig, run_dir: Path) -> dict[str, Backend]:
    """The trackers the job reports to, built from its keys and the trackers' own variables."""
    from ugro.tracking.mlflow_backend import MlflowBackend
    from ugro.tracking.wandb_backend import WandbBackend

    built: dict[str, Backend] = {}
    for key in dict.fromkeys(job.report_to):
        built[key] = MlflowBackend.for_job(job, run_dir.name) if key == "mlflow" else WandbBackend.for_job(job, run_dir)
    return built


class Feed:
    def __init__(self, setup: Setup, trackers: dict[str, Backend], remote: bool, warn: Warn, repo: Path) -> None:
        self.setup, self.remote, self.warn, self.repo = setup, remote, warn, repo
        self.file = TrackingFile.read(setup.run_dir)
        self.sinks = [_Sink(key, backend, self.file.tracker(key)) for key, backend in trackers.items()]
        self.records = Records(setup.run_dir)
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._latest: Status | None = None
        self._ending: tuple[str, str] | None = None  # ("finish", run state) or ("detach", "")
        self._thread: threading.Thread | None = None
        if self.sinks:
            self._thread = threading.Thread(target=self._work, name="ugro-tracking", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, job: JobConfig, run_dir: Path, code_hash: str, hosts: list[str], remote: bool, warn: Warn,
              repo: Path) -> Feed:  # fmt: skip
        """The job's trackers, opening in the background (no tracker: a feed that does nothing)."""
        setup = Setup(run_dir.name, run_dir, job.model_dump(mode="json"), code_hash, list(hosts))
        trackers: dict[str, Backend] = {}
        for key in dict.fromkeys(job.report_to):
            try:
                trackers |= backends(job.model_copy(update={"report_to": [key]}), run_dir)
            except Exception as exc:  # a URI MLflow refuses outright, say: one line, the run goes on
                warn(f"{key}: not reporting to it: {reason(exc)}; the run goes on without it")
        return cls(setup, trackers, remote, warn, repo)

    # -- the supervisor's side: never waits for a tracker --------------------------------------------------

    def poll(self, main: str, statuses: dict[str, Status]) -> None:
        """One supervisor poll (Supervisor.on_poll): the main host's state, for the worker to act on."""
        if self._thread is None:
            return
        with self._lock:
            self._latest = dict(statuses.get(main) or {})
        self._wake.set()

    def finish(self, state: str) -> None:
        """The run ended (its records collected): the rest of its rows, its files, the tracker runs ended as
        ``state`` (finished, failed, stopped) says. Waits for the uploads."""
        self._end(("finish", state), None)

    def detach(self) -> None:
        """Ctrl-C: the rows so far, and the tracker runs left open for `make follow`."""
        self._end(("detach", ""), DETACH_WAIT_S)

    def _end(self, how: tuple[str, str], wait_s: float | None) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._ending = how
        self._wake.set()
        self._thread.join(wait_s)
        self._thread = None

    # -- the worker ---------------------------------------------------------------------------------------

    def _work(self) -> None:
        for sink in self.sinks:
            self._call(sink, "opening its run", self._open)
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                latest, self._latest, ending = self._latest, None, self._ending
            if latest is not None or ending is not None:
                self._forward(latest)
            if ending is not None:
                self._conclude(*ending)
                return

    def _open(self, sink: _Sink) -> None:
        sink.state.ids = sink.backend.open(sink.state.ids)
        sink.state.ended = None
        self.file.write()
        if not sink.state.params:
            sink.backend.log_params(self.setup.params())
            sink.state.params = True
            self.file.write()

    def _call(self, sink: _Sink, doing: str, act: Callable[[_Sink], object]) -> None:
        """A tracker call; one that fails is one warning, and the tracker is dropped."""
        if not sink.alive:
            return
        try:
            act(sink)
        except Exception as exc:  # whatever the tracker's library raises: the run goes on without it
            sink.alive = False
            backend = sink.backend
            self.warn(f"{backend.name} ({backend.where}): {doing} failed: {reason(exc)}; {backend.fix}. The run goes "
                      f"on without it; its records stay in {self.setup.run_dir}")  # fmt: skip
            with contextlib.suppress(Exception):  # releasing after a failure: the warning above said it
                backend.close()

    def _forward(self, latest: Status | None) -> None:
        """What a poll brought: the new rows (local), or the main rank's newest figures (remote)."""
        if self.remote:
            point = live_point(latest or {}, time.time())
            if point is not None:
                for sink in self.sinks:
                    self._call(sink, "logging", lambda s: self._live(s, point))
            return
        self._rows(list(self.records.metrics.rows()), list(self.records.evals.rows()))
        found = devices(self.setup.run_dir)
        for sink in self.sinks:
            self._call(sink, "logging", lambda s: self._devices(s, found))

    def _rows(self, rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
        for sink in self.sinks:
            self._call(sink, "logging", lambda s: self._log_rows(s, rows, evals))

    def _log_rows(self, sink: _Sink, rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> None:
        """The rows after the tracker's cursor, each once (of a step a poll gave, the figures it did not give)."""
        state = sink.state
        points = [train_point(r) for r in rows if r["step"] > state.step]
        points = [p.without(LIVE_KEYS) if p.step in state.live else p for p in points]
        now = time.time()
        points += [eval_point(r, now) for r in evals if r["step"] > state.eval_step]
        if not points:
            return
        sink.backend.log_points(points)
        state.step = max([state.step, *(int(r["step"]) for r in rows)])
        state.eval_step = max([state.eval_step, *(int(r["step"]) for r in evals)])
        state.live = [s for s in state.live if s > state.step]
        self.file.write()

    def _live(self, sink: _Sink, point: Point) -> None:
        state = sink.state
        if point.step <= state.step or point.step in state.live:
            return
        sink.backend.log_points([point])
        state.live.append(point.step)
        self.file.write()

    @staticmethod
    def _devices(sink: _Sink, found: dict[str, str]) -> None:
        if found and found != sink.sent_devices:
            sink.backend.set_tags(found)
            sink.sent_devices = dict(found)

    def _conclude(self, how: str, state: str) -> None:
        if how == "detach":
            for sink in self.sinks:
                self._call(sink, "letting go of its run", lambda s: s.backend.detach())
            return
        # Every row from the start: a remote run's records came with its logs, a resumed one's were rewritten.
        self._rows(list(Tail(self.records.metrics.path).rows()), list(Tail(self.records.evals.path).rows()))
        found = devices(self.setup.run_dir)
        card = write_card(self.setup.run_dir, self.repo) if any(s.alive for s in self.sinks) else None
        files = artifacts(self.setup.run_dir, card)
        for sink in self.sinks:
            self._call(sink, "logging", lambda s: self._devices(s, found))
            self._call(sink, "keeping the run's files", lambda s: s.backend.log_artifacts(files))
            self._call(sink, "ending its run", lambda s: self._finish(s, state))

    def _finish(self, sink: _Sink, state: str) -> None:
        sink.backend.finish(state)
        sink.state.ended = state
        self.file.write()
