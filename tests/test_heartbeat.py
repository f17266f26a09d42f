"""A host's first rank tells the controller which peers it cannot reach (train/regroup.py Heartbeat), so that a
host whose link is cut counts as gone after one silent status poll instead of two.

Real sockets on loopback: a peer's regroup store (a real TCPStore) answers, a closed port does not.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch.distributed as dist

from train import regroup
from ugro.module_utils import ugro_jobstate


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once the socket is closed


def _silent(path: Path, expected: list[str], within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    found: list[str] = []
    while time.monotonic() < deadline:
        try:
            found = json.loads(path.read_text())["silent"]
        except (OSError, ValueError):
            found = []
        if found == expected:
            break
        time.sleep(0.05)
    return found


def test_a_peer_that_does_not_answer_is_reported_and_one_that_does_is_not(tmp_path: Path) -> None:
    (tmp_path / "hosts" / "h1").mkdir(parents=True)
    live = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    peers = {"h2": f"127.0.0.1:{live.port}", "h3": f"127.0.0.1:{_closed_port()}"}
    beat = regroup.Heartbeat(tmp_path, "h1", peers)
    try:
        path = tmp_path / "hosts" / "h1" / regroup.PEERS
        assert _silent(path, ["h3"], within_s=5) == ["h3"]
        # What the controller's status poll reads (ugro_host_facts job subset).
        assert ugro_jobstate.silent_peers(tmp_path, "h1") == ["h3"]
        # After a regroup without h3 it is no peer any more.
        beat.keep(("h1", "h2"))
        assert _silent(path, [], within_s=5) == []
    finally:
        beat.stop()
