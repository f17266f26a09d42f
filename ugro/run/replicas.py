"""Checkpoints off the main host: the controller's verified copy, replicas, and placing one for a relaunch.

While the controller follows a run it fetches every new checkpoint from the main host into its own
``runs/<id>/checkpoints/`` (every file its sha256 manifest lists, checked here before the copy counts) and,
with ``checkpoint.replicas: N``, pushes it to N other hosts. Before a relaunch (or ``--resume auto``) it
finds the newest intact checkpoint wherever one exists -- a host's disk or its own copy -- and gives it to
the new main host. No shared filesystem.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ugro.hosts.playbook import run_playbook
from ugro.module_utils import ugro_checkpoints

# The run's own records, which the host that continues a run appends to (train/metrics.py).
RECORDS = ("metrics.jsonl", "eval.jsonl", "run.json")


def _file_stats(path: Path) -> tuple[tuple[str, int, int], ...]:
    stats = ((f.relative_to(path).as_posix(), f.stat()) for f in sorted(path.rglob("*")) if f.is_file())
    return tuple((rel, st.st_size, st.st_mtime_ns) for rel, st in stats)


@dataclass
class Replicator:
    inventory: Path
    run_dir: Path  # the controller's runs/<id>
    private_dir: Path
    keep_last: int
    remote: bool  # False where the hosts write into the controller's own checkout (nothing to copy)
    # Checkpoint name -> the sizes and times of its files when they last passed their checksums: a status poll
    # asks for the newest intact checkpoint every few seconds, and hashing an 8B adapter's optimizer state each
    # time costs hundreds of MB read per poll.
    _verified: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict, init=False, repr=False)

    def _play(
        self, action: str, hosts: list[str], main: str, cancelled: Callable[[], bool] | None = None, **extra: Any
    ) -> Any:
        """Run the checkpoint playbook; ``cancelled`` (asked every 0.2 s) ends it early: a copy from or to a host
        that left the run would otherwise wait for SSH's keepalive timeout (minutes) where its link was cut."""
        extravars = {"ugro_job_id": self.run_dir.name, "ugro_checkpoint_action": action, "ugro_main_host": main}
        enough = (lambda _run: cancelled()) if cancelled is not None else None
        return run_playbook(
            "checkpoint.yml", self.inventory, extravars | extra, self.private_dir, limit=hosts, enough=enough
        )

    def local_newest(self) -> dict[str, Any] | None:
        """{name, step, path} of the controller's newest intact checkpoint, or None. Each checkpoint's files are
        hashed once, and again only when one of them changed (its size or modification time)."""
        return ugro_checkpoints.newest_intact(self.run_dir, self._problem)

    def _problem(self, path: Path) -> str | None:
        """``ugro_checkpoints.problem``, skipped for a checkpoint whose files are as they were when they passed."""
        seen = _file_stats(path)
        if self._verified.get(path.name) == seen:
            return None
        why = ugro_checkpoints.problem(path)
        if why is None:
            self._verified[path.name] = seen
        return why

    def fetch(self, host: str, name: str, cancelled: Callable[[], bool] | None = None) -> str | None:
        """Copy checkpoint ``name`` (and the run's records) from ``host`` to the controller; None when the copy
        is intact, else why not (also when ``cancelled`` said to stop)."""
        if not self.remote:
            return None
        if ugro_checkpoints.step_of(Path(name)) is None or Path(name).name != name:
            # The name comes from the host's own report: "..", "/" or a path would make `final` the run directory
            # (or anything), which the copy then replaces.
            return f"{host}: {name[:80]!r} is not a checkpoint's name (step-NNNNNN); nothing was copied"
        root = self.run_dir / "checkpoints"
        final = root / name
        if final.is_dir() and ugro_checkpoints.problem(final) is None:
            return None
        root.mkdir(parents=True, exist_ok=True)
        tag = f"{name}-{threading.get_ident()}"  # the background copy and a recovery's may overlap
        archive, unpacked = root / f".incoming-{tag}.tar", root / f".incoming-{tag}"
        try:
            run = self._play(
                "fetch", [host], host, cancelled, ugro_checkpoint_name=name, ugro_checkpoint_dest=str(archive)
            )
            if run.runner is not None and run.runner.status == "canceled":
                return f"{host}: the copy was given up ({host} left the run)"
            if not run.ok:
                return f"{host}: {run.failures.get(host, 'the fetch failed')}"
            shutil.rmtree(unpacked, ignore_errors=True)
            with tarfile.open(archive) as tar:
                tar.extractall(unpacked, filter="data")
            why = ugro_checkpoints.problem(unpacked / "checkpoints" / name)
            if why is not None:
                return f"{host}: the copy of {name} {why}"
            shutil.rmtree(final, ignore_errors=True)
            (unpacked / "checkpoints" / name).rename(final)
            for record in RECORDS:
                if (unpacked / record).is_file():
                    os.replace(unpacked / record, self.run_dir / record)
        finally:
            archive.unlink(missing_ok=True)
            shutil.rmtree(unpacked, ignore_errors=True)
        for old in ugro_checkpoints.listed(self.run_dir)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return None

    def push(
        self, hosts: list[str], main: str, records: bool, cancelled: Callable[[], bool] | None = None
    ) -> dict[str, str]:
        """Copy the controller's newest intact checkpoint to ``hosts`` (with ``records``, also the run's metrics
        and record, which the host continuing the run appends to); host -> why it failed (``cancelled``: as in
        ``fetch``)."""
        newest = self.local_newest()
        if not self.remote or newest is None or not hosts:
            return {}
        archive = self.run_dir / "checkpoints" / f".push-{newest['name']}.tar"
        try:
            with tarfile.open(archive, "w") as tar:
                tar.add(newest["path"], arcname=f"checkpoints/{newest['name']}")
                for record in RECORDS if records else ():
                    if (self.run_dir / record).is_file():
                        tar.add(self.run_dir / record, arcname=record)
            run = self._play(
                "push",
                hosts,
                main,
                cancelled,
                ugro_checkpoint_archive=str(archive),
                ugro_checkpoint_step=newest["step"],
            )
        finally:
            archive.unlink(missing_ok=True)
        return dict(run.failures)

    def find(self, hosts: list[str], main: str) -> tuple[dict[str, dict[str, Any] | None], dict[str, str]]:
        """Each host's newest intact checkpoint ({name, step, path} or None), and host -> why it did not answer."""
        run = self._play("find", hosts, main)
        key = "train_job_checkpoint"
        found = {h: facts.get(key) for h, facts in run.facts.items() if key in facts}
        return found, dict(run.failures)

    def place(self, hosts: list[str], main: str) -> tuple[int | None, dict[str, str]]:
        """Make sure ``main`` holds the newest intact checkpoint that exists anywhere (hosts or controller).
        Returns its step (None: there is none) and host -> problem for hosts that could not take part."""
        found, problems = self.find(hosts, main)
        ours = self.local_newest()
        best_host, best = max(
            ((h, c) for h, c in found.items() if c is not None), key=lambda hc: int(hc[1]["step"]), default=(None, None)
        )
        if best is not None and best_host is not None and (ours is None or int(best["step"]) > int(ours["step"])):
            if best_host == main:
                return int(best["step"]), problems
            why = self.fetch(best_host, str(best["name"]))
            if why is not None:
                problems[best_host] = why
            ours = self.local_newest()
        if ours is None:
            return None, problems
        have = found.get(main)
        if have is None or int(have["step"]) < int(ours["step"]):
            problems |= self.push([main], main, records=True)
        return int(ours["step"]), problems
