"""The group a rank trains in, as one immutable value: who is in it, in which order, and which launch and change of
the run it is.

Two counters tell groups apart:

- ``attempt``: which *launch* of the run this is. The controller starts attempt 0, and every relaunch it makes
  (from a checkpoint, with new processes everywhere) is the next one (``UGRO_ATTEMPT``). Nothing of one attempt's
  groups is valid in another: the store keys of every group carry it.
- ``generation``: which *change of members* within one attempt this is. A launch starts at generation 0; every change
  of the group in the same processes (survivors going on without a lost host, hosts taken back in) is the next
  generation. Whoever decides a change names the next generation; a rank takes only a group newer than its own.

A rank's place in a group is its index in ``hosts`` (every rank's host, by rank: a host with two GPUs appears twice);
the main rank is the first rank of ``main``. ``stores`` names each host's regroup store (the TCP store its first rank
keeps open from the start), through which a new group is formed and joiners ask to come in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Group:
    """One group of one launch: its members by rank, its main host, the hosts' stores and the job they run."""

    attempt: int
    generation: int
    hosts: tuple[str, ...]  # every rank's host, by rank
    main: str  # the host whose first rank is the main rank (records, checkpoints; its store forms the next group)
    stores: tuple[tuple[str, str], ...]  # (host, address:port of its regroup store), one per host
    job_hash: str  # the job every member runs (train/config.py ``cluster_hash``)

    @property
    def members(self) -> tuple[str, ...]:
        """The hosts in the group, each once, in rank order."""
        return tuple(dict.fromkeys(self.hosts))

    @property
    def main_rank(self) -> int:
        return self.hosts.index(self.main)

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def store_of(self, host: str) -> str | None:
        """``host``'s regroup store, address:port."""
        return dict(self.stores).get(host)

    def peers(self, host: str) -> dict[str, str]:
        """Every other member's regroup store (host -> address:port)."""
        return {h: e for h, e in self.stores if h != host}

    def without(self, lost: tuple[str, ...] | frozenset[str]) -> tuple[str, ...]:
        """The members that are not ``lost``, in rank order."""
        return tuple(h for h in self.members if h not in lost)

    def survivors(self, generation: int, hosts: tuple[str, ...], main: str) -> Group:
        """The next group of the surviving ``hosts`` (each once, any of this group's members): every rank of theirs
        goes on, in its order; the lost hosts' stores are left out."""
        kept = set(hosts)
        by_rank = tuple(h for h in self.hosts if h in kept)
        stores = tuple((h, e) for h, e in self.stores if h in kept)
        return Group(self.attempt, generation, by_rank, main, stores, self.job_hash)

    def survivor_rank(self, rank: int, next_group: Group) -> int | None:
        """This group's rank ``rank`` in ``next_group`` when that one is made of this one's survivors (the ranks of
        the surviving hosts keep their order), or None when its host is not one of them."""
        kept = set(next_group.members)
        if self.hosts[rank] not in kept:
            return None
        return sum(1 for h in self.hosts[:rank] if h in kept)

    def grown(self, joiners: list[tuple[str, int, str]]) -> Group:
        """The next group with ``joiners`` (host, ranks, store) after this one's ranks, in the order they asked."""
        hosts, stores = list(self.hosts), list(self.stores)
        for host, ranks, store in joiners:
            hosts += [host] * ranks
            stores.append((host, store))
        return Group(self.attempt, self.generation + 1, tuple(hosts), self.main, tuple(stores), self.job_hash)

    def proposal(self) -> dict[str, Any]:
        """What a decider proposes of it: the generation, the members, the main host (``membership.json`` of the
        controller, a survivors' proposal in a store)."""
        return {"generation": self.generation, "hosts": list(self.members), "main": self.main}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Group:
        data = json.loads(text)
        hosts = tuple(str(h) for h in data["hosts"])
        stores = tuple((str(h), str(e)) for h, e in data["stores"])
        return cls(
            int(data["attempt"]), int(data["generation"]), hosts, str(data["main"]), stores, str(data["job_hash"])
        )
