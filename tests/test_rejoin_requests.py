"""Requests to rejoin the group are checked before the main rank takes them: anyone who reaches the main host's
regroup store can write one (a store has no login), and every store publishes the group and the job's hash. A
request is taken only when it is well formed and proven with the run's key (train/recovery/jobkey.py), which only the
hosts of the launch hold. A crafted one is refused, answered and named in the log; the main rank does not fail, and a
member's request behind it is still taken in."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from train.recovery import door, jobkey
from train.recovery.group import Group

JOB_HASH = "ab" * 32
KEY = bytes(range(32))  # the run's key, as every host of the launch holds it


@pytest.fixture()
def store() -> dist.Store:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return server


def _ask(store: dist.Store, request: object, key: bytes | None = None) -> int:
    """Write a request at the door, proven with ``key`` (a member's) or carrying the proof it names."""
    if isinstance(request, dict) and key is not None:
        request = request | {"proof": jobkey.proof(key, request)}
    index = int(store.add(door.count_key(0), 1)) - 1
    store.set(f"{door.count_key(0)}-{index}", request if isinstance(request, str) else json.dumps(request))
    return index


GUEST = {"host": "h4", "ranks": 1, "store": "10.0.0.4:4000", "job_hash": JOB_HASH}  # the published job hash
CRAFTED = [
    GUEST | {"proof": "0" * 64},  # a guest who read the group and the job's hash from a store, without the key
    GUEST | {"proof": jobkey.proof(bytes(32), GUEST)},  # proven with another key (another run's)
    {"host": "guest"},  # keys missing: the main rank once failed on request["job_hash"]
    {"host": "guest", "ranks": 100000, "store": "10.0.0.9:4000", "job_hash": JOB_HASH},  # no bound on ranks
    {"host": "guest", "ranks": True, "store": "10.0.0.9:4000", "job_hash": JOB_HASH},
    {"host": "../../etc", "ranks": 1, "store": "10.0.0.9:4000", "job_hash": JOB_HASH},
    {"host": "guest", "ranks": 1, "store": "10.0.0.9:99999", "job_hash": JOB_HASH},
    {"host": "guest", "ranks": 1, "store": "10.0.0.9:4000", "job_hash": JOB_HASH, "extra": "x"},
    "not json",
]


def test_crafted_requests_are_refused_and_a_members_request_behind_them_is_taken_in(
    store: dist.Store, caplog: pytest.LogCaptureFixture
) -> None:
    group = Group(0, 0, ("h1", "h2"), "h1", (("h1", "10.0.0.1:4000"), ("h2", "10.0.0.2:4000")), JOB_HASH)
    main_door = door.Door()
    main_door.keep(store, 0)
    crafted = [_ask(store, request) for request in CRAFTED]
    member = _ask(store, {"host": "h3", "ranks": 2, "store": "10.0.0.3:4000", "job_hash": JOB_HASH}, KEY)
    with caplog.at_level("WARNING"):
        grown = main_door.propose(group, KEY)
    assert grown is not None and grown.hosts == ("h1", "h2", "h3", "h3")
    assert dict(grown.stores)["h3"] == "10.0.0.3:4000"
    for index in crafted:
        answer = json.loads(store.get(door.answer_key(0, index)))
        assert set(answer) == {"refused"}, answer
        assert f"refused rejoin request {index}: " in caplog.text, caplog.text
    assert "host h4's request is not proven with the run's key" in caplog.text
    assert json.loads(store.get(door.answer_key(0, member)))["first_rank"] == 2
