"""The survivors of a lost host go on in their own processes: the group they leave, the one the controller names.

Every rank keeps its model, optimizer state and place in the data across a fault. When a collective fails (a peer
reset the connection) or the controller announces a new membership, the rank abandons what is under way, waits for
the controller's word on who is left (``hosts/<host>/membership.json``, written by ``playbooks/regroup.yml``), forms
a new process group with the other survivors through the new main host's store, and the survivors agree on the step
to continue from: the last one any of them completed (an optimizer step is applied only after the gradient
all-reduce completed, which needs every rank's part; a survivor that applied it gives its state to those that did
not). Nothing is redone and no checkpoint is read. A rank that hears nothing within ``distributed.regroup_timeout_s``
fails as before, and the controller relaunches from a checkpoint.

A rank's place: ``Watcher`` (a thread reading the membership file; a new membership, a silent peer or a failed
collective declares the group broken: its NCCL groups are aborted and every wait ends at once, so that no rank waits
for a dead peer until the collective timeout), ``wait`` (a collective's result, read as train/dist/comm.py says,
or GroupLost), ``rejoin``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from train.dist import comm
from train.recovery import failure

log = logging.getLogger(__name__)
T = TypeVar("T")

MEMBERSHIP = "membership.json"
POLL_S = 0.2
# hosts/<host>/peers.json: the hosts this host cannot reach (ugro/module_utils/ugro_jobstate.py reads it).
PEERS = "peers.json"
HEARTBEAT_S = 0.5  # between two rounds of connects to the peers, and each connect's timeout
SILENT_AFTER = 2  # failed connects in a row before a peer counts as silent


class GroupLost(RuntimeError):
    """The process group lost a member: a collective failed, or the controller named a new membership."""


@dataclass(frozen=True)
class Membership:
    """Who is left, as the controller decided: generation 1 after the first regroup of a launch, 2 after the next."""

    generation: int
    hosts: tuple[str, ...]  # the surviving hosts, in the run's order
    main: str  # the host whose local rank 0 is the main rank (and hosts the new group's store)

    @classmethod
    def read(cls, path: Path) -> Membership | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(int(data["generation"]), tuple(str(h) for h in data["hosts"]), str(data["main"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, or being replaced: the next read sees it whole


class Watcher:
    """Reads this host's membership file every POLL_S seconds; a newer generation breaks the group (``fail``) and
    wakes a rank waiting in ``rejoin``."""

    def __init__(self, run_dir: Path, host: str) -> None:
        self.path = run_dir / "hosts" / host / MEMBERSHIP
        self.generation = 0  # the group this rank is in
        self.broken: str | None = None  # why the current group cannot be used any more
        self.breaks = threading.Event()  # set with ``broken``: every wait (train/dist/comm.py ``result``) ends
        self._newest: Membership | None = None
        self._waiting: set[Any] = set()  # the works a wait is on now (gloo's, which no abort ends)
        self.abandoned: list[Any] = []  # works of broken groups, maybe still pending
        self.history: list[dict[str, Any]] = []  # the regroups this rank went through (train/recovery/survivors.py)
        self._lock = threading.RLock()
        self._changed = threading.Event()
        self.path.unlink(missing_ok=True)  # a membership of an earlier launch is not this one's
        threading.Thread(target=self._watch, name="ugro-membership", daemon=True).start()

    def _watch(self) -> None:
        mtime = 0.0
        while True:
            time.sleep(POLL_S)
            try:
                stamp = self.path.stat().st_mtime
            except OSError:
                continue
            if stamp == mtime:
                continue
            found = Membership.read(self.path)
            if found is None:
                continue
            mtime = stamp
            if found.generation > self.generation:
                self._newest = found
                self.fail(f"the controller named a new membership (generation {found.generation}: "
                          f"{', '.join(found.hosts)})")  # fmt: skip
                self._changed.set()

    def fail(self, why: str) -> None:
        """The current group is broken: every wait on it ends now. Groups with NCCL's semantics are aborted (from
        this thread, as NCCL's watchdog does): a collective of theirs waiting for a lost peer ends with an error,
        and a host blocked reading its result is released. A gloo wait is left at once (``comm.result``)."""
        with self._lock:
            first = self.broken is None
            self.broken = self.broken or why
            self.breaks.set()
            self.abandoned += [work for work in self._waiting if not work.is_completed()]
        if first:
            try:
                comm.abort_all()
            except Exception as exc:  # the rank's own thread may be replacing the groups: it leaves them itself
                log.warning("could not abort the broken group's communicators: %s", failure.one_line(exc))

    def waiting(self, works: list[Any], on: bool) -> None:
        with self._lock:
            (self._waiting.update if on else self._waiting.difference_update)(works)

    def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``, the collective timeout) until the collectives of broken groups have ended,
        so that the groups kept in ``_RETIRED`` can be destroyed at exit without waiting on them."""
        deadline = time.monotonic() + timeout_s
        while any(not w.is_completed() for w in self.abandoned) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def newer(self, timeout_s: float) -> Membership | None:
        """Wait up to ``timeout_s`` for a membership newer than the current group's."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self._newest
            if found is not None and found.generation > self.generation:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(min(left, POLL_S))
            self._changed.clear()

    def joined(self, membership: Membership) -> None:
        with self._lock:
            self.generation = membership.generation
            self.broken = None
            self.breaks.clear()


class Heartbeat:
    """This host's view of its peers, from its first rank: every HEARTBEAT_S seconds a TCP connect to each peer's
    regroup store (open from the start on every host). A refused connect is an answer: the host is up and only its
    job's process is gone (a killed rank is the controller's to tell, from the host's own status; counting its
    host silent would make a crash look like a cut link). The peers whose connects went unanswered (a time-out,
    no route) SILENT_AFTER times in a row are written to ``hosts/<host>/peers.json`` ({"silent": [host, ...]})
    whenever the list changes; the controller's status poll reads it, and a host that neither the controller nor
    its peers can reach is gone after one poll instead of two (ugro/run/recovery.py ``Watch``).

    A peer that turns silent or refuses breaks the group (``watch.fail``): a collective waiting on a cut link hears
    no reset and would wait out ``distributed.timeout_s``, and a dead NCCL peer is not always noticed either. The
    loop stops the heartbeat when its last step is done: a peer that then ends its process breaks nothing."""

    def __init__(self, run_dir: Path, host: str, peers: dict[str, str], watch: Watcher | None = None) -> None:
        self.path = run_dir / "hosts" / host / PEERS
        self.watch = watch
        self._peers = dict(peers)  # host -> address:port of its regroup store
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.path.unlink(missing_ok=True)  # an earlier launch's view is not this one's
        threading.Thread(target=self._beat, name="ugro-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def follow(self, group: Any) -> None:
        """After a regroup or a rejoin: the other hosts of the new group (``RankInfo.stores``) are the peers."""
        with self._lock:
            self._peers = {h: e for h, e in group.stores if h != group.host}

    def _beat(self) -> None:
        failed: dict[str, int] = {}
        written: list[str] = []
        while not self._stopped.is_set():
            with self._lock:
                peers = dict(self._peers)
            refused: list[str] = []
            for host, endpoint in peers.items():
                address, port = endpoint.rsplit(":", 1)
                try:
                    socket.create_connection((address, int(port)), timeout=HEARTBEAT_S).close()
                    failed[host] = 0
                except ConnectionRefusedError:
                    failed[host] = 0  # the host answered: it is up, its rank is not (the controller's poll says so)
                    refused.append(host)
                except OSError:
                    failed[host] = failed.get(host, 0) + 1
            silent = sorted(h for h in peers if failed.get(h, 0) >= SILENT_AFTER)
            with self._lock:  # a regroup may have left them out since this round began (``keep``)
                lost = sorted(h for h in {*silent, *refused} if h in self._peers)
            if lost and self.watch is not None and not self._stopped.is_set():
                self.watch.fail(f"cannot reach the regroup store of {', '.join(lost)}")
            if silent != written:
                partial = self.path.with_suffix(f".tmp{os.getpid()}")
                partial.write_text(json.dumps({"silent": silent, "time": round(time.time(), 3)}), encoding="utf-8")
                os.replace(partial, self.path)
                written = silent
                if silent:
                    log.warning("cannot reach the regroup store of %s", ", ".join(silent))
            self._stopped.wait(HEARTBEAT_S)


_WATCHER: list[Watcher] = []
_HEARTBEAT: list[Heartbeat] = []


# Where a batch scheduler runs the job, its scancel, preemption or time limit ends every rank at nearly the same
# moment: a rank that outlived the others by a second must not take the run over. There the survivors never decide
# themselves (as before: they wait for a membership and then fail, and the scheduler's requeue resumes).
SCHEDULERS = {"SLURM_JOB_ID": "SLURM", "KUBERNETES_SERVICE_HOST": "Kubernetes"}


def scheduler() -> str | None:
    """The batch scheduler that runs this rank (SLURM, Kubernetes), or None on ugro's own launch."""
    return next((name for variable, name in SCHEDULERS.items() if os.environ.get(variable)), None)


def start(run_dir: Path, host: str, peers: dict[str, str] | None = None) -> Watcher:
    """Start watching this host's membership file (once per process), and with ``peers`` (host -> regroup store,
    given to one rank per host) whether the other hosts can be reached."""
    if not _WATCHER:
        _WATCHER.append(Watcher(run_dir, host))
        if peers:
            # Under a batch scheduler the stores' addresses are the main host's (its node script names no
            # cluster address) and every rank ends at once: the heartbeat only reports there.
            watch = None if scheduler() is not None else _WATCHER[0]
            _HEARTBEAT.append(Heartbeat(run_dir, host, peers, watch))
    return _WATCHER[0]


def heartbeat() -> Heartbeat | None:
    return _HEARTBEAT[0] if _HEARTBEAT else None


def watcher() -> Watcher | None:
    return _WATCHER[0] if _WATCHER else None


def intact() -> None:
    """GroupLost if the current group was declared broken (before a collective is queued on it)."""
    watch = watcher()
    if watch is not None and watch.broken is not None:
        raise GroupLost(watch.broken)


def wait(works: dist.Work | list[dist.Work] | None) -> None:
    """``result`` without a value: the collectives ended (their results, landed, are read by what follows)."""
    result(works, lambda: None)


def result(works: dist.Work | list[dist.Work] | None, read: Callable[[], T]) -> T:
    """Wait for collectives started with ``async_op=True`` and read their result (``comm.result``: the one way);
    GroupLost if one fails or the group is declared broken meanwhile.

    The wait ends at once when the group is declared broken (``Watcher.fail``) and a signal reaches the rank while it
    waits: a rank waiting for a peer that a stop already ended still turns the stop's SIGTERM into ``Stopped`` and
    records it (train/recovery/failure.py), instead of waiting until the collective timeout or torchrun kills it."""
    watch = watcher()
    if watch is None:
        return comm.result(works, read)
    listed = [works] if isinstance(works, dist.Work) else list(works or [])
    intact()
    watch.waiting(listed, True)
    try:
        return comm.result(listed, read, watch.breaks)
    except comm.BrokenGroup as exc:
        raise GroupLost(watch.broken or str(exc)) from None
    except Exception as exc:
        if failure.kind_of(exc) != "collective" and watch.broken is None:
            raise
        if watch.broken is None:  # the collective itself failed: a peer reset the connection, or timed out
            watch.fail(f"a collective failed: {failure.one_line(exc)}")
        raise GroupLost(watch.broken or failure.one_line(exc)) from exc
    finally:
        watch.waiting(listed, False)


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``obj`` (picklable), by rank, as ``dist.all_gather_object`` gives them, but in two
    collectives a new membership abandons (``wait``) where that one blocks until the collective timeout. CPU tensors:
    ``group`` must be a gloo group (the default one on CPU; ``comm.control_group()`` beside NCCL)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [comm.zeros(1, torch.int64, group) for _ in range(world)]
    work = comm.all_gather(sizes, comm.tensor([data.numel()], torch.int64, group), group, async_op=True)
    lengths = result(work, lambda: [int(size) for size in sizes])
    padded = comm.zeros(max(lengths), torch.uint8, group)
    padded[: data.numel()] = data
    gathered = [comm.zeros(max(lengths), torch.uint8, group) for _ in range(world)]
    blobs = result(comm.all_gather(gathered, padded, group, async_op=True),
                   lambda: [t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, lengths, strict=True)])  # fmt: skip
    return [pickle.loads(blob) for blob in blobs]


def broken(exc: BaseException) -> bool:
    """Whether ``exc`` ended a step because the group lost a member (then the rank may rejoin the survivors)."""
    watch = watcher()
    if watch is None or isinstance(exc, failure.NonFiniteError):  # every rank found it: going on would repeat it
        return False
    if isinstance(exc, GroupLost) or watch.broken is not None:
        return True
    # Any failed collective, also one not run through ``wait``: gloo raises a plain RuntimeError for a peer that
    # reset the connection during a blocking one.
    if failure.kind_of(exc) == "collective":
        watch.fail(f"a collective failed: {failure.one_line(exc)}")
        return True
    return False


# -- forming the new group ----------------------------------------------------------------------------------


class StoreServer:
    """This host's store for a new group, listening from the start on a port of the ephemeral range (which the
    firewall opens to the cluster's members): a regroup never waits for a server to come up."""

    def __init__(self, address: str) -> None:
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.endpoint = f"{address}:{self.store.port}"


def endpoint_store(endpoint: str, timeout_s: float) -> dist.Store:
    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def new_ranks(hosts_by_rank: tuple[str, ...], survivors: tuple[str, ...]) -> list[int]:
    """The old ranks that go on, in order: every rank of every surviving host (their new ranks are their places)."""
    return [rank for rank, host in enumerate(hosts_by_rank) if host in survivors]


# The broken groups and the DDP wrappers over them, kept until the process ends. A collective abandoned in one may
# still be pending (a cut link: it ends at the collective timeout), and the gloo thread that ends it runs its
# future's Python callback, which needs the GIL; destroying the group on this thread (holding the GIL) joins that
# thread: a deadlock. Kept here, they are destroyed only at exit, after ``settle`` has waited for those collectives.
_RETIRED: list[Any] = []


def retire(thing: Any) -> None:
    _RETIRED.append(thing)


def form(backend: str, store: dist.Store, attempt: int, generation: int, rank: int, world: int, timeout_s: float,
         device: torch.device, kind: str = "regroup") -> None:  # fmt: skip
    """Leave the broken default group (without waiting for what is under way in it) and form the new one.

    gloo: destroying the group returns at once, a collective pending on the lost peer fails with it. NCCL: such a
    collective is a kernel on the GPU waiting for a peer that is gone; it holds its stream, and destroying the
    group would wait for it. Aborting every communicator (``leave``) ends those kernels with an error. The new
    group is formed with ``device_id``: NCCL connects its communicator now, on this rank's GPU, not at the
    first collective. The model, the optimizer state and the gradients stay on the GPU throughout: they belong
    to the process, not to the group. ``kind``: "regroup" (survivors), "grow" (hosts taken back in:
    train/recovery/rejoin.py), each generation's keys apart in the store, so that a grow that failed half-way leaves
    nothing a regroup reads."""
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):  # the default, control and pipeline groups
            retire(group)
        leave()
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device
    prefixed = dist.PrefixStore(f"ugro-{kind}-{attempt}-{generation}", store)
    dist.init_process_group(store=prefixed, rank=rank, world_size=world, **kwargs)


def leave() -> None:
    """Leave every process group of the broken membership: NCCL's aborted, gloo's destroyed."""
    if comm.nccl_semantics(None):  # NCCL, or the test backend that behaves like it
        dist.distributed_c10d._abort_process_group()  # every group, the control and pipeline ones too
    else:
        dist.destroy_process_group()


def agree_step(done: int) -> tuple[int, int, int]:
    """Collective over the new group: the step to continue from (the newest any survivor completed), the lowest
    rank that completed it (whose state the others take), and how many ranks had not."""
    mine = comm.tensor([done, dist.get_rank()], torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    comm.all_gather(everyone, mine)
    target = max(int(t[0]) for t in everyone)
    source = min(int(t[1]) for t in everyone if int(t[0]) == target)
    behind = sum(1 for t in everyone if int(t[0]) < target)
    if behind:
        log.info("regroup: %d rank(s) had not applied step %d; they take rank %d's state", behind, target, source)
    return target, source, behind


def share_state(optimizer: torch.optim.Optimizer, scheduler: Any, source: int) -> None:
    """Collective: every rank takes ``source``'s optimizer and scheduler state (the weights follow with the
    re-wrap's broadcast of the trainable parameters)."""
    payload: list[Any] = [(optimizer.state_dict(), scheduler.state_dict())] if dist.get_rank() == source else [None]
    dist.broadcast_object_list(payload, src=source)
    if dist.get_rank() != source:
        optimizer_state, scheduler_state = payload[0]
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(scheduler_state)
