"""The main rank's door: hosts whose ranks came back ask to rejoin in its regroup store (train/recovery/rejoin.py
``come_in``), each step's exchange carries how many wait (train/balance/step.py ``exchange``: ``StepClock.proposing``),
so that every rank of the group learns it in the same step, and after that step the main rank reads the requests and
proposes the grown group (``Door.propose``), which every member then forms (train/recovery/membership.py)."""

from __future__ import annotations

import datetime
import json
import logging

import torch.distributed as dist

from train.recovery import storedata
from train.recovery.group import Group

log = logging.getLogger(__name__)

REQUEST_WAIT_S = 10  # from counting a request in to writing it: one store round trip of the asker's


def count_key(attempt: int) -> str:
    """The store key counting launch ``attempt``'s requests; request ``i`` is under ``f"{count_key}-{i}"``."""
    return f"ugro-join-{attempt}"


def answer_key(attempt: int, index: int) -> str:
    return f"ugro-admit-{attempt}-{index}"


class Door:
    """The requests to rejoin at the main rank's store, and how many of them it has answered. Every rank has one; only
    the main rank's has a store (``keep``)."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None  # the main rank's own regroup store; None on every other rank
        self.attempt = 0
        self.answered = 0  # the requests before this one are taken in or refused

    def keep(self, store: dist.Store | None, attempt: int) -> None:
        """After every change of group: the main rank keeps the door (its host's store), every other rank none. A host
        that becomes the main one counts from the requests its store holds now."""
        moved = store is not None and store is not self.store
        self.store, self.attempt = store, attempt
        if moved:
            self.answered = self.requests()

    def requests(self) -> int:
        """The requests made at this door so far (0 on a rank that keeps none)."""
        return int(self.store.add(count_key(self.attempt), 0)) if self.store is not None else 0

    def waiting(self) -> int:
        """The requests not answered yet: this rank's term of the step's exchange (0 on every rank but the main one)."""
        return max(0, self.requests() - self.answered)

    def propose(self, group: Group, key: bytes) -> Group | None:
        """The main rank: ``group`` grown by the hosts that asked (answering each request), or None."""
        assert self.store is not None  # the main rank's process serves its host's store
        count = self.requests()
        joiners: list[tuple[str, int, str]] = []
        accepted: list[tuple[int, int]] = []  # (request, first rank)
        answered = count
        for index in range(self.answered, count):
            request = self._request(index, key)
            if isinstance(request, str):
                self._refuse(index, request)
                continue
            if request.host in group.hosts:  # its old ranks are gone but the group has not noticed: it waits for that
                answered = index
                break
            if request.job_hash != group.job_hash:
                self._refuse(index, f"host {request.host} asked to rejoin with another job (hash "
                                    f"{request.job_hash[:12]} against the group's {group.job_hash[:12]}): sync the "
                                    "same job file and train code to every host")  # fmt: skip
                continue
            accepted.append((index, group.world_size + sum(ranks for _, ranks, _ in joiners)))
            joiners.append((request.host, request.ranks, request.store))
        self.answered = max(self.answered, answered)
        if not accepted:
            return None
        grown = group.grown(joiners)
        for index, first in accepted:
            answer = {"group": json.loads(grown.to_json()), "first_rank": first}
            self.store.set(answer_key(self.attempt, index), json.dumps(answer))
        return grown

    def _refuse(self, index: int, why: str) -> None:
        assert self.store is not None
        log.warning("refused rejoin request %d: %s", index, why)
        self.store.set(answer_key(self.attempt, index), json.dumps({"refused": why}))

    def _request(self, index: int, key: bytes) -> storedata.Request | str:
        """Request ``index`` at the door, or why it is refused (also one whose key never came: its asker died between
        counting itself in and writing it)."""
        assert self.store is not None
        name = f"{count_key(self.attempt)}-{index}"
        try:
            self.store.wait([name], datetime.timedelta(seconds=REQUEST_WAIT_S))  # its asker writes it after counting
        except RuntimeError:  # DistStoreError: not there in time
            return f"counted but not written within {REQUEST_WAIT_S} s"
        return storedata.request(self.store.get(name), key)
