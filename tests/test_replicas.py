"""The controller's checkpoint copies (ugro/run/replicas.py) on the test cluster: a copy from a host whose link was
cut is given up as soon as the controller says that host left the run, instead of waiting for SSH's timeouts; the
newest copy is hashed once per checkpoint; a copy that fails with an error does not end the supervision."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import small_job
from rich.console import Console

from testbed import cluster as tb
from train.config import JobConfig
from ugro.hosts.inventory import Cluster
from ugro.module_utils import ugro_checkpoints
from ugro.run.records import RunRecord
from ugro.run.replicas import Replicator
from ugro.run.supervisor import Outcome, Supervisor


def test_a_copy_from_a_host_whose_link_was_cut_is_given_up_when_the_host_leaves(
    testbed: Any, cluster: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "runs" / "replicas-cut-20261126-000000"
    copies = Replicator(cluster, run_dir, tmp_path / "ansible", keep_last=3, remote=True)
    left = threading.Event()
    tb.set_link(testbed.dir, "tb2", up=False)
    try:
        began = time.monotonic()
        threading.Timer(1.0, left.set).start()  # the supervisor learns that tb2 is gone while the copy waits
        why = copies.fetch("tb2", "step-000005", cancelled=left.is_set)
        waited = time.monotonic() - began
    finally:
        tb.set_link(testbed.dir, "tb2", up=True)
    assert why is not None and "given up" in why and why.startswith("tb2:"), why
    # SSH alone would hold it for its ConnectTimeout (30 s) or keepalives (minutes).
    assert waited < 10, f"the copy took {waited:.1f} s to give up"
    assert not list((run_dir / "checkpoints").glob(".incoming-*")), "the given-up copy left files behind"


def _checkpoint(run_dir: Path, step: int, payload: bytes) -> Path:
    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    (folder / ugro_checkpoints.MANIFEST).write_text(json.dumps({"files": {"state.pt": digest}}))
    return folder


def test_the_newest_checkpoint_is_hashed_once_per_checkpoint_not_once_per_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "runs" / "hashed-20261127-000000"
    _checkpoint(run_dir, 5, b"older")
    newest = _checkpoint(run_dir, 10, b"x" * 4096)
    hashed: list[str] = []
    real = ugro_checkpoints.sha256_file

    def counted(path: Path) -> str:
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(ugro_checkpoints, "sha256_file", counted)
    copies = Replicator(tmp_path / "inventory.yml", run_dir, tmp_path / "ansible", keep_last=3, remote=True)
    for _ in range(5):  # five status polls
        found = copies.local_newest()
        assert found is not None and found["step"] == 10
    assert hashed == ["state.pt"], hashed
    (newest / "state.pt").write_bytes(b"y" * 10)  # changed on disk: checked again, and found broken
    found = copies.local_newest()
    assert found is not None and found["step"] == 5, found


class _FullDisk(Replicator):
    def fetch(self, host: str, name: str, cancelled: Any = None) -> str | None:
        raise OSError(28, "No space left on device")


def test_a_copy_that_fails_with_an_error_is_one_line_in_the_record_and_supervision_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "full-disk-20261127-000000"
    out = io.StringIO()
    supervisor = Supervisor(
        JobConfig.model_validate(small_job()), Cluster(["h1", "h2"], "h1", remote=True), tmp_path / "inventory.yml",
        run_dir, {}, Console(file=out, width=200), poll_s=1.0,
    )  # fmt: skip
    supervisor.copies = _FullDisk(tmp_path / "inventory.yml", run_dir, tmp_path / "ansible", keep_last=3, remote=True)
    supervisor._replicate("h1", {"last_checkpoint": "checkpoints/step-000010"}, ["h1", "h2"])
    supervisor._copies_settled(["h1", "h2"])  # a fault being handled waits for the copy: it must not raise
    line = "checkpoint step-000010: the copy from h1 failed: OSError: [Errno 28] No space left on device"
    assert supervisor.copy_failures == [line]
    assert line in out.getvalue()
    record = Outcome("finished", {}, ["h1", "h2"], "h1", copy_failures=supervisor.copy_failures).record()
    record.write(run_dir)
    assert RunRecord.read(run_dir) is not None and RunRecord.read(run_dir).copy_failures == [line]  # type: ignore[union-attr]


class _SlowCopy(Replicator):
    """A copy that takes 0.3 s and records which checkpoint it fetched and when it started."""

    started: list[tuple[str, float]]

    def fetch(self, host: str, name: str, cancelled: Any = None) -> str | None:
        self.started.append((name, time.monotonic()))
        time.sleep(0.3)
        return None

    def push(self, hosts: list[str], main: str, records: bool, cancelled: Any = None) -> dict[str, str]:
        return {}

    def local_newest(self) -> dict[str, Any] | None:
        return None


def test_checkpoints_written_faster_than_copied_are_copied_with_rests_between(tmp_path: Path) -> None:
    """A checkpoint every 50 ms, each copy 0.3 s: the controller copies the newest one, rests twice the copy's
    time, then copies the newest again; it never copies back to back."""
    run_dir = tmp_path / "runs" / "fast-ckpt-20261128-000000"
    supervisor = Supervisor(
        JobConfig.model_validate(small_job()), Cluster(["h1", "h2"], "h1", remote=True), tmp_path / "inventory.yml",
        run_dir, {}, Console(file=io.StringIO()), poll_s=1.0,
    )  # fmt: skip
    copies = _SlowCopy(tmp_path / "inventory.yml", run_dir, tmp_path / "ansible", keep_last=3, remote=True)
    copies.started = []
    supervisor.copies = copies
    began = time.monotonic()
    step = 0
    while time.monotonic() - began < 2.5:
        step += 5
        supervisor._replicate("h1", {"last_checkpoint": f"checkpoints/step-{step:06d}"}, ["h1", "h2"])
        time.sleep(0.05)
    supervisor._copies_settled(["h1", "h2"])
    starts = [t for _, t in copies.started]
    assert 2 <= len(starts) <= 3, copies.started  # back to back, 2.5 s would hold eight
    assert all(b - a >= 0.3 * 3 - 0.05 for a, b in itertools.pairwise(starts)), copies.started
    names = [n for n, _ in copies.started]
    assert names == sorted(names) and len(set(names)) == len(names)  # each time the newest, never one twice


@pytest.mark.parametrize("name", ["..", ".", "/etc", "step-000004/../..", "step-x", ""])
def test_a_checkpoint_name_from_a_hosts_report_that_is_not_one_copies_nothing(tmp_path: Path, name: str) -> None:
    """A host reports its newest checkpoint's name; one that is no checkpoint's (``..`` with an empty manifest once
    made the controller replace its own run directory) is refused before any copy, and the run directory stays."""
    run_dir = tmp_path / "runs" / "job-1"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    copies = Replicator(tmp_path / "inventory.yml", run_dir, tmp_path / "ansible", keep_last=3, remote=True)
    why = copies.fetch("tb2", name)
    assert why is not None and "is not a checkpoint's name (step-NNNNNN); nothing was copied" in why, why
    assert (run_dir / "metrics.jsonl").read_text() == "{}\n"
    assert not (tmp_path / "ansible").exists()  # no playbook ran
