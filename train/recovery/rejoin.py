"""A host whose ranks crashed comes back into the running group, without the other hosts relaunching.

A rank that crashes on a host that stays up (an out-of-memory kill, a driver error) takes its host's other ranks with
it (torchrun ends them). The other hosts' heartbeats find that host's regroup store refused and the survivors go on
without it (train/recovery/membership.py). Meanwhile the host's launcher starts its ranks again, in join mode
(train/launcher.py, ``UGRO_JOIN=1``): they load the model and data as at a start, then

1. find the running group: every host's first rank keeps the group as it knows it in its own regroup store
   (``GROUP_KEY``) and on its own disk (``hosts/<host>/group.json``); the joiner reads its host's file, written by
   its previous ranks, asks the stores it names, and takes the newest generation's main host;
2. ask to come in: its first rank writes its host, ranks, regroup store and job hash into the main host's store;
3. the main rank counts the requests in each step's exchange (train/balance/step.py ``exchange``), so every rank of the
   group learns of them in the same step; after that step the main rank proposes the grown group
   (train/recovery/door.py), every member forms it through the main host's store (the survivors keep their ranks, the
   joiners' come after), and the joiners take the step, weights, optimizer and scheduler state from a survivor
   (train/recovery/membership.py ``Membership.enter``) and the shares are re-planned. Nothing is redone.

A joiner whose job differs from the group's (another job file or code) is refused, naming both jobs' hashes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from train.config import ConfigError
from train.dist import comm, distributed
from train.dist.distributed import RankInfo
from train.dist.health import GroupHealth
from train.metrics import EVAL, METRICS, last_logged_step
from train.recovery import door, failure, jobkey
from train.recovery.comeback import JOIN_ENV, MARK
from train.recovery.group import Group

log = logging.getLogger(__name__)

GROUP_KEY = "ugro-group"
RECORD = "group.json"
ASK_EVERY_S = 0.5


def requested() -> bool:
    """This rank was started to rejoin a running group."""
    return os.environ.get(JOIN_ENV) == "1"


def publish(run_dir: Path, host: str, group: Group, store: dist.Store | None) -> None:
    """This host's first rank: the group as it is now, in this host's store and on its disk (for its next ranks)."""
    if store is not None:
        store.set(GROUP_KEY, group.to_json())
    path = run_dir / "hosts" / host / RECORD
    partial = path.with_suffix(f".tmp{os.getpid()}")
    partial.write_text(group.to_json(), encoding="utf-8")
    os.replace(partial, path)


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
            store = distributed.endpoint_store(endpoint, 2.0)
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


def come_in(run_dir: Path, info: RankInfo, job_hash: str, timeouts: tuple[int, int],
            health: GroupHealth) -> tuple[Group, int]:  # fmt: skip
    """Ask the running group's main host to take this host's ranks in, and wait for the answer (at the group's next
    step boundary, at most ``wait_s``): the grown group and this rank's place in it. Collective over the host's own
    ranks: the first finds the group and asks for all of them, each waits for the answer in the main host's store,
    whose every answer takes at most ``timeout_s`` (a main host that goes silent meanwhile ends the wait then).
    ``timeouts``: (``wait_s``, ``timeout_s``)."""
    wait_s, timeout_s = timeouts
    asked: tuple[str, int] | None = None
    if info.local_rank == 0:
        group = find(run_dir, info.host, info.attempt)
        store = distributed.endpoint_store(dict(group.stores)[group.main], timeout_s)
        index = int(store.add(door.count_key(group.attempt), 1)) - 1
        request = {"host": info.host, "ranks": info.world_size, "store": dict(info.stores).get(info.host, ""),
                   "job_hash": job_hash}  # fmt: skip
        request["proof"] = jobkey.proof(jobkey.ensure(run_dir), request)
        store.set(f"{door.count_key(group.attempt)}-{index}", json.dumps(request))
        log.info("asked %s to take this host back into the group (generation %d: %s)", group.main, group.generation,
                 ", ".join(dict.fromkeys(group.hosts)))  # fmt: skip
        asked = (group.to_json(), index)
    if dist.is_initialized() and dist.get_world_size() > 1:
        asked = health.gather_objects(asked, comm.control_group())[0]
    assert asked is not None
    group, index = Group.from_json(asked[0]), asked[1]
    store = distributed.endpoint_store(dict(group.stores)[group.main], timeout_s)
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


def catch_up(run_dir: Path, info: RankInfo, newcomer: bool, health: GroupHealth) -> None:
    """Collective over the grown group: the rows of ``metrics.jsonl`` and ``eval.jsonl`` the newcomers missed while
    they were away, from the main rank's files into each newcomer host's ``hosts/<host>/``, where its first rank keeps
    the run's rows should its host take the run's records up (train/metrics.py ``take_over``)."""
    keeper = newcomer and info.local_rank == 0
    folder = run_dir / "hosts" / info.host
    mine = (last_logged_step(folder) or 0) if keeper else None
    wanted = [step for step in health.gather_objects(mine, comm.control_group()) if step is not None]
    if not wanted:
        return
    since = min(wanted)
    rows = {name: _rows_after(run_dir / name, since) for name in (METRICS, EVAL)} if info.is_main else None
    sent = health.gather_objects(rows, comm.control_group())[info.main_rank]
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
