"""The controller's checkpoint copies (ugro/run/replicas.py) on the test cluster: a copy from a host whose link was
cut is given up as soon as the controller says that host left the run, instead of waiting for SSH's timeouts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from testbed import cluster as tb
from ugro.run.replicas import Replicator


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
