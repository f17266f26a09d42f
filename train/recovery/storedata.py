"""What a rank reads from a regroup store is checked before it is used: anyone who reaches a store's port can write
to it (a store has no login), so a request to rejoin, or a membership found there, is taken only when it is one a
member could have written. Each check returns the value, or why it is refused (the caller names it in the log and
goes on without it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from train.recovery import jobkey
from train.recovery.group import Group

MAX_RANKS_PER_HOST = 64  # torchrun's ranks of one host: GPUs, or CPU processes
HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
ENDPOINT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}:(\d{1,5})\Z")
JOB_HASH = re.compile(r"^[0-9a-f]{64}\Z")
REQUEST_KEYS = frozenset({"host", "ranks", "store", "job_hash", "proof"})


@dataclass(frozen=True)
class Request:
    """A host's request to come back into the group (train/recovery/rejoin.py ``come_in``)."""

    host: str
    ranks: int
    store: str
    job_hash: str


def _text(raw: bytes | str) -> Any:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def request(raw: bytes | str, key: bytes) -> Request | str:
    """A rejoin request, or why it is not one a member's ranks could have written: its fields well formed and proven
    with the run's key (train/recovery/jobkey.py; the job's hash alone is no proof: every store publishes it)."""
    try:
        data = _text(raw)
    except (ValueError, UnicodeDecodeError):
        return "not JSON"
    if not isinstance(data, dict) or set(data) != REQUEST_KEYS:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        return f"its keys are {keys}, not {sorted(REQUEST_KEYS)}"
    host, ranks, store, job_hash = data["host"], data["ranks"], data["store"], data["job_hash"]
    if not isinstance(host, str) or not HOST.match(host):
        return f"host {str(host)[:60]!r} is not a host name"
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS_PER_HOST:
        return f"ranks {str(ranks)[:20]!r} is not a count of 1 to {MAX_RANKS_PER_HOST}"
    port = ENDPOINT.match(store) if isinstance(store, str) else None
    if port is None or not 1 <= int(port[1]) <= 65535:
        return f"store {str(store)[:60]!r} is not an address:port"
    if not isinstance(job_hash, str) or not JOB_HASH.match(job_hash):
        return f"job_hash {str(job_hash)[:20]!r} is not a job's hash"
    if not jobkey.proves(key, {k: v for k, v in data.items() if k != "proof"}, data["proof"]):
        return (f"host {host}'s request is not proven with the run's key ({jobkey.FILE} in the run directory: every "
                "host of a launch gets the controller's)")  # fmt: skip
    return Request(host, ranks, store, job_hash)


def membership(raw: bytes | str, current: Group, generation: int, key: bytes) -> Group | str:
    """The group after ``current`` that its survivors could have proposed for ``generation``, proven with the run's
    key, or why not."""
    try:
        data = _text(raw)
        found = (int(data["generation"]), tuple(data["hosts"]), data["main"])
        proof = data.get("proof")
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return "not a membership"
    found_generation, hosts, main = found
    if found_generation != generation:
        return f"generation {found_generation}, not {generation}"
    in_order = [h for h in current.members if h in set(hosts)]
    if not hosts or list(hosts) != in_order or len(in_order) != len(hosts):
        return f"hosts {[str(h)[:60] for h in hosts[:8]]} are not survivors of {list(current.members)} in their order"
    if main not in hosts:
        return f"main host {str(main)[:60]!r} is not one of them"
    proposed = current.survivors(generation, hosts, main)
    if not jobkey.proves(key, proposed.proposal(), proof):
        return f"not proven with the run's key ({jobkey.FILE})"
    return proposed
