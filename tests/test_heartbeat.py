"""A host's first rank tells the controller which peers it cannot reach (train/recovery/watch.py Heartbeat), so that a
host whose link is cut counts as gone after one silent status poll instead of two.

Real sockets on loopback: a peer's regroup store (a real TCPStore) answers; so does a host whose port is closed (it
refuses: the host is up, its rank is gone); a listening socket whose queue is full drops the connect, as a host
behind a cut link does.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch.distributed as dist
from helpers import closed_port, unanswering_port

from train.recovery import watch
from train.recovery.group import Group
from ugro.module_utils import ugro_jobstate


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


def test_a_peer_that_does_not_answer_is_reported_and_one_that_answers_or_refuses_is_not(tmp_path: Path) -> None:
    (tmp_path / "hosts" / "h1").mkdir(parents=True)
    live = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    held: list[socket.socket] = []
    peers = {
        "h2": f"127.0.0.1:{live.port}",
        "h3": f"127.0.0.1:{closed_port()}",  # up, its rank killed
        "h4": f"127.0.0.1:{unanswering_port(held)}",  # cut off
    }
    beat = watch.Heartbeat(tmp_path, "h1", peers)
    try:
        path = tmp_path / "hosts" / "h1" / watch.PEERS
        assert _silent(path, ["h4"], within_s=5) == ["h4"]
        time.sleep(3 * watch.HEARTBEAT_S)  # and it stays so: h3 refuses at every round
        assert ugro_jobstate.silent_peers(tmp_path, "h1") == ["h4"]  # what the controller's status poll reads
        # After a regroup without h4 it is no peer any more.
        stores = tuple((h, e) for h, e in peers.items() if h != "h4")
        beat.follow(Group(0, 1, tuple(h for h, _ in stores), "h2", stores, "ab" * 32))
        assert _silent(path, [], within_s=5) == []
    finally:
        beat.stop()
        for sock in held:
            sock.close()
