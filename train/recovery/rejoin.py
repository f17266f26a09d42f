"""A host whose ranks crashed comes back into the running group, without the other hosts relaunching.

A rank that crashes on a host that stays up (an out-of-memory kill, a driver error) takes its host's other ranks with
it (torchrun ends them). The other hosts' heartbeats find that host's regroup store refused and the survivors go on
without it (train/recovery/survivors.py). Meanwhile the host's launcher starts its ranks again, in join mode
(train/launcher.py, ``UGRO_JOIN=1``): they load the model and data as at a start, then

1. find the running group: every host's first rank keeps the group as it knows it in its own regroup store
   (``GROUP_KEY``) and on its own disk (``hosts/<host>/group.json``); the joiner reads its host's file, written by
   its previous ranks, asks the stores it names, and takes the newest generation's main host;
2. ask to come in: its first rank writes its host, ranks, regroup store and job hash into the main host's store;
3. the main rank counts the requests in each step's exchange (train/balance/step.py ``exchange``), so every rank of the
   group learns of them in the same step; after that step they all ``admit`` them: the main rank names the grown
   group, every member forms it through the main host's store (the survivors keep their ranks, the joiners' come
   after), and the joiners take the step, weights, optimizer and scheduler state from a survivor
   (train/recovery/survivors.py ``settle``) and the shares are re-planned. Nothing is redone.

A joiner whose job differs from the group's (another job file or code) is refused, naming both jobs' hashes.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from train.config import ConfigError
from train.dist import comm, distributed
from train.dist.distributed import RankInfo
from train.metrics import EVAL, METRICS, last_logged_step
from train.recovery import door, failure, jobkey, regroup, storedata
from train.recovery.comeback import JOIN_ENV, MARK

log = logging.getLogger(__name__)

GROUP_KEY = "ugro-group"
RECORD = "group.json"
ASK_EVERY_S = 0.5
REQUEST_WAIT_S = 10  # from counting a request in to writing it: one store round trip of the asker's


@dataclass(frozen=True)
class Group:
    """A group as its members know it: launch, generation, every rank's host, the main host, the hosts' stores."""

    attempt: int
    generation: int
    hosts: tuple[str, ...]
    main: str
    stores: tuple[tuple[str, str], ...]
    job_hash: str

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

    @classmethod
    def of(cls, info: RankInfo, generation: int, job_hash: str) -> Group:
        return cls(info.attempt, generation, info.hosts, info.hosts[info.main_rank], info.stores, job_hash)


def requested() -> bool:
    """This rank was started to rejoin a running group."""
    return os.environ.get(JOIN_ENV) == "1"


def publish(run_dir: Path, info: RankInfo, generation: int, job_hash: str) -> None:
    """This host's first rank: the group as it is now, in this host's store and on its disk (for its next ranks)."""
    if info.local_rank != 0:
        return
    group = Group.of(info, generation, job_hash)
    server = distributed.store_server()
    if server is not None:
        server.set(GROUP_KEY, group.to_json())
    door.keep(server if info.is_main else None, info.attempt)
    path = run_dir / "hosts" / info.host / RECORD
    partial = path.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(group.to_json(), encoding="utf-8")
    os.replace(partial, path)


# -- the group's side: taking the joiners in ------------------------------------------------------------


def admit(info: RankInfo, generation: int, job_hash: str, timeout_s: int, key: bytes) -> tuple[RankInfo, Group] | None:
    """Collective over the group, after a step whose exchange announced joiners (train/recovery/door.py ``due``): the
    main rank reads their requests and names the grown group; everyone forms it. None when no request could be taken in
    now (refused, or from a host the group has not yet noticed is gone): the group is unchanged."""
    plan = _plan(info, generation, job_hash, key) if info.is_main else None
    door.spent()
    chosen = regroup.gather_objects(plan, comm.control_group())[info.main_rank]
    if chosen is None:
        return None
    return distributed.enter(info, chosen, info.rank, timeout_s), chosen


def _plan(info: RankInfo, generation: int, job_hash: str, key: bytes) -> Group | None:
    """The main rank: the group grown by the hosts that asked (answering each request), or None."""
    store = door.store()
    assert store is not None  # the main rank's process serves its host's store
    count = door.requests()
    hosts, stores = list(info.hosts), list(info.stores)
    accepted: list[tuple[int, int]] = []  # (request, first rank)
    answered = count
    for index in range(door.unanswered(), count):
        request = _request(store, info.attempt, index, key)
        if isinstance(request, str):
            log.warning("refused rejoin request %d: %s", index, request)
            store.set(door.answer_key(info.attempt, index), json.dumps({"refused": request}))
            continue
        if request.host in hosts:  # its old ranks are gone but the group has not noticed yet: it waits for the regroup
            answered = index
            break
        if request.job_hash != job_hash:
            why = (f"host {request.host} asked to rejoin with another job (hash {request.job_hash[:12]} against the "
                   f"group's {job_hash[:12]}): sync the same job file and train code to every host")  # fmt: skip
            log.warning("refused a rejoin: %s", why)
            store.set(door.answer_key(info.attempt, index), json.dumps({"refused": why}))
            continue
        accepted.append((index, len(hosts)))
        hosts += [request.host] * request.ranks
        stores.append((request.host, request.store))
    door.answered(answered)
    if not accepted:
        return None
    group = Group(info.attempt, generation + 1, tuple(hosts), info.hosts[info.main_rank], tuple(stores), job_hash)
    for index, first in accepted:
        answer = {"group": json.loads(group.to_json()), "first_rank": first}
        store.set(door.answer_key(info.attempt, index), json.dumps(answer))
    return group


def _request(store: dist.Store, attempt: int, index: int, key: bytes) -> storedata.Request | str:
    """Request ``index`` at the door, or why it is refused (also one whose key never came: its asker died between
    counting itself in and writing it)."""
    name = f"{door.count_key(attempt)}-{index}"
    try:
        store.wait([name], datetime.timedelta(seconds=REQUEST_WAIT_S))  # its asker writes it right after counting
    except RuntimeError:  # DistStoreError: not there in time
        return f"counted but not written within {REQUEST_WAIT_S} s"
    return storedata.request(store.get(name), key)


# -- the joiner's side ----------------------------------------------------------------------------------------


def find(run_dir: Path, host: str, attempt: int) -> Group:
    """The running group: the newest any other host's store names (from the stores this host's last ranks knew)."""
    path = run_dir / "hosts" / host / RECORD
    try:
        known = Group.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise failure.RejoinError(f"no record of the group to rejoin in {path} ({exc})") from exc
    best: Group | None = None
    for other, endpoint in known.stores:
        if other == host:
            continue
        try:
            store = regroup.endpoint_store(endpoint, 2.0)
            if not store.check([GROUP_KEY]):
                continue
            found = Group.from_json(store.get(GROUP_KEY))
        except (RuntimeError, ValueError, KeyError, TypeError):
            continue  # gone, or not a member any more
        if found.attempt == attempt and (best is None or found.generation > best.generation):
            best = found
    if best is None:
        others = ", ".join(h for h, _ in known.stores if h != host)
        raise failure.RejoinError(f"no other host of launch {attempt} answers ({others}): the run ended or every "
                                  "other host is gone; a controller relaunches it")  # fmt: skip
    return best


def come_in(run_dir: Path, info: RankInfo, job_hash: str, wait_s: int, timeout_s: int) -> tuple[Group, int]:
    """Ask the running group's main host to take this host's ranks in, and wait for the answer (at the group's next
    step boundary, at most ``wait_s``): the grown group and this rank's place in it. Collective over the host's own
    ranks: the first finds the group and asks for all of them, each waits for the answer in the main host's store,
    whose every answer takes at most ``timeout_s`` (a main host that goes silent meanwhile ends the wait then)."""
    asked: tuple[str, int] | None = None
    if info.local_rank == 0:
        group = find(run_dir, info.host, info.attempt)
        store = regroup.endpoint_store(dict(group.stores)[group.main], timeout_s)
        index = int(store.add(door.count_key(group.attempt), 1)) - 1
        request = {"host": info.host, "ranks": info.world_size, "store": dict(info.stores).get(info.host, ""),
                   "job_hash": job_hash}  # fmt: skip
        request["proof"] = jobkey.proof(jobkey.ensure(run_dir), request)
        store.set(f"{door.count_key(group.attempt)}-{index}", json.dumps(request))
        log.info("asked %s to take this host back into the group (generation %d: %s)", group.main, group.generation,
                 ", ".join(dict.fromkeys(group.hosts)))  # fmt: skip
        asked = (group.to_json(), index)
    if dist.is_initialized() and dist.get_world_size() > 1:
        asked = regroup.gather_objects(asked, comm.control_group())[0]
    assert asked is not None
    group, index = Group.from_json(asked[0]), asked[1]
    store = regroup.endpoint_store(dict(group.stores)[group.main], timeout_s)
    key = door.answer_key(group.attempt, index)
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise failure.RejoinError(f"{group.main} did not take this host in within {wait_s} s "
                                          "(distributed.startup_timeout_s)")  # fmt: skip
            time.sleep(ASK_EVERY_S)
        answer = json.loads(store.get(key))
    except RuntimeError as exc:  # its store went away: the group ended or lost its main host meanwhile
        if isinstance(exc, failure.RejoinError):
            raise
        raise failure.RejoinError(
            f"{group.main}'s store went away while this host waited to be taken in: {failure.one_line(exc)}"
        ) from exc
    if isinstance(answer, dict) and isinstance(answer.get("refused"), str):
        raise ConfigError(f"the run refused this host: {answer['refused']}")
    try:
        grown, first = Group.from_json(json.dumps(answer["group"])), int(answer["first_rank"])
    except (ValueError, KeyError, TypeError) as exc:
        why = f"{group.main}'s store answered with no group this host could join ({exc!r})"
        raise failure.RejoinError(why) from exc
    if not 0 <= first < len(grown.hosts) or grown.hosts[first] != info.host:
        raise failure.RejoinError(f"{group.main}'s store answered with rank {first}, which is not this host's")
    return grown, first + info.local_rank


def clear_mark(run_dir: Path, host: str) -> None:
    """The launcher's note that this host is coming back is answered: it is back."""
    (run_dir / "hosts" / host / MARK).unlink(missing_ok=True)


def catch_up(run_dir: Path, info: RankInfo, newcomer: bool) -> None:
    """Collective over the grown group: the rows of ``metrics.jsonl`` and ``eval.jsonl`` the newcomers missed while
    they were away, from the main rank's files into each newcomer host's ``hosts/<host>/``, where its first rank keeps
    the run's rows should its host take the run's records up (train/metrics.py ``take_over``)."""
    keeper = newcomer and info.local_rank == 0
    folder = run_dir / "hosts" / info.host
    mine = (last_logged_step(folder) or 0) if keeper else None
    wanted = [step for step in regroup.gather_objects(mine, comm.control_group()) if step is not None]
    if not wanted:
        return
    since = min(wanted)
    rows = {name: _rows_after(run_dir / name, since) for name in (METRICS, EVAL)} if info.is_main else None
    sent = regroup.gather_objects(rows, comm.control_group())[info.main_rank]
    if not keeper or not sent or mine is None:
        return
    for name, lines in sent.items():
        missed = [line for step, line in lines if step > mine]
        if missed:
            with (folder / name).open("a", encoding="utf-8") as fh:
                fh.writelines(line + "\n" for line in missed)


def _rows_after(path: Path, step: int) -> list[tuple[int, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            number = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if number > step:
            rows.append((number, line))
    return rows
