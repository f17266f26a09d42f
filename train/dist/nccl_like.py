"""A process group that behaves as NCCL does where a CPU test can see it, over gloo (``UGRO_NCCL_LIKE=1``).

Every multi-rank test on this machine runs on CPU, where gloo completes a collective's future when its result is
there and a send returns at once. On GPUs the same code runs NCCL, which differs in ways that train silently wrong
or hang on the first real cluster (``../shared/DESIGN.md``, docs/recovery.md "What NCCL does"). A rank started with
``UGRO_NCCL_LIKE=1`` (every test rank: tests/conftest.py; the test cluster's hosts set it for every SSH session,
testbed/cluster.py ``up``) makes its default group, and
every group made beside it without a backend, of this kind instead of gloo:

- **Results land at ``work.wait()``.** A collective's future is complete as soon as the collective is queued (as an
  NCCL work's is), with the caller's tensors as its value, still holding what they held. The result is written
  into them only when ``wait()`` is called on the work. On NCCL that wait (or a wait on the work's own future, or a
  ``then`` of it) orders the current stream after NCCL's; a CPU test cannot see streams, so this is stricter: only
  ``work.wait()`` lands the result, never reading the tensor, waiting on a future, or a future made by hand. Code
  that reads a result any other way reads its own figures here, as it would read a stale buffer on a GPU.
- **Point-to-point in order, and rendezvous.** Operations to one peer run in the order they were queued (NCCL: one
  stream per pair of ranks), and a send of more than ``UGRO_NCCL_LIKE_EAGER_BYTES`` (default 256) completes only
  when the peer has reached the matching receive. Two neighbours that each queue a send before the receive wait on
  each other until the collective timeout, as on NCCL once a send outgrows its buffers. Sends and receives given
  to ``dist.batch_isend_irecv`` together progress together (NCCL's group calls).
- **A lost peer hangs, and a wait returns anyway.** A collective whose peer is gone does not fail at once (gloo's
  connection reset is kept back): its ``wait()`` blocks until the group's timeout has passed since the collective
  was queued, when the watchdog records the timeout in the group (``error``, NCCL's ``get_error``) and aborts it,
  or until the group is aborted (``abort()``, as ``ncclCommAbort``). Then it *returns*, as the host's read of an
  NCCL buffer does, with NaN in the caller's tensors (``UGRO_NCCL_LIKE_GARBAGE=own``: their own figures): code that
  does not ask the group's error (train/dist/comm.py ``failure``) takes them for a result. A wait with a timeout
  (NCCL's blocking wait) raises instead.

Tensors stay CPU tensors; the device checker (train/dist/devicecheck.py) refuses the ones NCCL would not carry.
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

NAME = "ugro_nccl_like"
ENV = "UGRO_NCCL_LIKE"
EAGER_ENV = "UGRO_NCCL_LIKE_EAGER_BYTES"
GARBAGE_ENV = "UGRO_NCCL_LIKE_GARBAGE"
EAGER_BYTES = 256  # sends up to this size complete without the receive (NCCL's buffers: a few MiB)
_POLL_S = 0.05


def requested() -> bool:
    return os.environ.get(ENV, "") == "1"


class NcclWork(dist.Work):
    """One queued operation: complete (its future) at once, its result landed in the caller's tensors at ``wait``."""

    def __init__(self, group: NcclLike, what: str, result: list[torch.Tensor], land: Callable[[], None],
                 inputs: Sequence[torch.Tensor] = ()) -> None:  # fmt: skip
        super().__init__()
        # NCCL reads a collective's inputs and writes its outputs when its kernel runs, after the work queued before it
        # on the stream: a buffer the caller changes between queueing and the wait is a race there. Refused here.
        self._buffers = [(t, t._version) for t in (*result, *inputs)]
        self._group = group
        self._what = what
        self._land = land
        self._landed = False
        self._finished = False  # the operation underneath ended (well, or with a lost peer)
        self._error: str | None = None  # why it ended badly: kept back until the timeout, as NCCL hangs instead
        self._queued = time.monotonic()
        # NCCL: complete when queued. Its tensors are the CPU's (this backend's), so the future carries no devices.
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=[])
        self._future.set_result(result)
        group.pending.add(self)

    def finish(self, error: str | None = None) -> None:
        with self._group.changed:
            self._finished, self._error = True, error
            self._group.pending.discard(self)
            self._group.changed.notify_all()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        """Until the result lands. Without ``timeout`` (NCCL: the stream waits, the host goes on) a collective that
        does not complete is ended by the watchdog at the group's timeout, or by an abort: the wait then returns as
        NCCL's host read does, with the caller's tensors holding no result (``garbage``), and only the group's
        recorded error (``NcclLike.error``, the watchdog's) says so. With ``timeout`` (NCCL's blocking wait) it raises
        once that has passed, after aborting the communicator."""
        limit = self._group.timeout_s
        blocking = timeout.total_seconds() > 0
        deadline = min(limit, timeout.total_seconds()) if blocking else limit
        with self._group.changed:
            while True:
                if self._finished and self._error is None:
                    if not self._landed:
                        self._unchanged()
                        self._land()  # the result is written where the caller reads it, now and only now
                        self._landed = True
                    return True
                if self._group.aborted:
                    if blocking:
                        raise dist.DistBackendError(f"{NAME}: {self._what} ended: {self._group.aborted}")
                    self._garbage()
                    return True
                waited = time.monotonic() - self._queued
                if waited >= deadline:
                    cause = f" ({self._error})" if self._error else ""
                    why = f"{self._what} timed out after {waited:.0f} s; a peer never took part{cause}"
                    if not blocking or deadline >= limit:
                        self._group.watchdog(why)
                    else:
                        self._group.abort(f"a blocking wait timed out: {why}")
                    if blocking:
                        raise dist.DistBackendError(f"{NAME}: {why} (a blocking wait's timeout)")
                    self._garbage()
                    return True
                self._group.changed.wait(min(_POLL_S, deadline - waited))

    def _unchanged(self) -> None:
        changed = [tuple(t.shape) for t, version in self._buffers if t._version != version]
        if changed:
            raise RuntimeError(
                f"{NAME}: {self._what}: a buffer of shape {changed[0]} was changed after the collective was queued and "
                "before its wait: on NCCL the collective reads or writes it when its kernel runs, a race. Wait first."
            )

    def _garbage(self) -> None:
        """What the caller's tensors hold after a collective that never completed: ``UGRO_NCCL_LIKE_GARBAGE=nan``
        (the default) NaN in every floating tensor, ``own`` their own figures untouched (NCCL leaves either, or a
        partial sum)."""
        if self._landed or os.environ.get(GARBAGE_ENV, "nan") == "own":
            return
        with torch.no_grad():
            for tensor in self._future.value():
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
        self._landed = True

    def is_completed(self) -> bool:
        """Ended well, or ended badly underneath and aborted: a collective waiting for a lost peer is not complete
        (NCCL's is not), nor one whose gloo operation is still pending (its callback would need the GIL when the
        group is destroyed: train/dist/health.py ``GroupHealth.settle`` waits for it)."""
        return self._finished and (self._error is None or bool(self._group.aborted))

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


@dataclass
class _P2P:
    """A send or a receive: ``tensor`` is the caller's; what travels is ``scratch``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    scratch: torch.Tensor = field(init=False)
    work: NcclWork = field(init=False)

    def __post_init__(self) -> None:
        self.scratch = self.tensor.detach().clone() if self.send else torch.empty_like(self.tensor)

    def land(self) -> None:
        if not self.send:
            with torch.no_grad():
                self.tensor.copy_(self.scratch)


class _Channel:
    """The operations to one peer, run one item at a time in the order queued (an item: one operation, or the ones
    of one ``batch_isend_irecv`` to this peer, which progress together)."""

    def __init__(self, group: NcclLike, peer: int) -> None:
        self.group = group
        self.peer = peer
        self.sent = 0  # sends to the peer so far; the peer counts its receives from here alike
        self.received = 0
        self._items: list[list[_P2P]] = []
        self._ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"ugro-nccl-like-p2p-{peer}", daemon=True)
        self.thread.start()

    def put(self, item: list[_P2P]) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def stop(self) -> None:
        with self._ready:
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self.group.aborted:
                    self._ready.wait()
                if not self._items:
                    return  # aborted: this thread makes no call into the store or gloo any more
                item = self._items.pop(0)
            try:
                if self.group.aborted:  # NCCL: every operation on an aborted communicator fails
                    raise dist.DistBackendError("the communicator was aborted")
                self._progress(item)
            except Exception as exc:  # a lost peer, a timeout or an abort: the works hang until theirs
                for op in item:
                    if not op.work.is_completed():
                        op.work.finish(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    def _progress(self, item: list[_P2P]) -> None:
        """Post the item's receives, start its sends (a large one once the peer posted its receive), then let gloo
        carry each pair. Gloo's own receive starts only once the peer's send has started, so that no gloo receive is
        left pending with nobody to match it (a hung receive here hangs in Python, where an abort reaches it)."""
        group, me = self.group, self.group.rank()
        receives = [o for o in item if not o.send]
        numbers: list[int] = []
        for _ in receives:
            self.received += 1
            numbers.append(self.received)
            group.store.set(f"p2p/{self.peer}/{me}/{self.received}/posted", "1")
        inner: list[tuple[_P2P, Any]] = []
        for op in (o for o in item if o.send):
            self.sent += 1
            key = f"p2p/{me}/{self.peer}/{self.sent}"
            if op.scratch.numel() * op.scratch.element_size() > group.eager_bytes:
                self._until(f"{key}/posted", "the peer never reached the matching receive")
            group.store.set(f"{key}/sent", "1")
            inner.append((op, group.gloo.send([op.scratch], self.peer, op.tag)))
        for op, number in zip(receives, numbers):
            self._until(f"p2p/{self.peer}/{me}/{number}/sent", "the peer never sent")
            inner.append((op, group.gloo.recv([op.scratch], self.peer, op.tag)))
        for op, work in inner:
            work.wait()  # gloo's: the peer has started its side; a peer lost since fails it
            op.work.finish()

    def _until(self, key: str, why: str) -> None:
        """Until ``key`` is in the store (or the timeout, or an abort); then it goes."""
        deadline = time.monotonic() + self.group.timeout_s
        while True:
            self._pause(deadline, why)
            if self.group.store.check([key]):
                self.group.store.delete_key(key)
                return

    def _pause(self, deadline: float, why: str) -> None:
        if self.group.aborted:
            raise dist.DistBackendError("the communicator was aborted")
        if time.monotonic() > deadline:
            self.group.abort(f"the watchdog aborted the communicator: a send or receive timed out ({why})")
            raise TimeoutError(why)
        time.sleep(0.002)


class NcclLike(dist.ProcessGroup):
    """The group: gloo underneath, NCCL's completion, ordering and failure rules on top (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, kept: Groups) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.store = store
        self.gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self.eager_bytes = int(os.environ.get(EAGER_ENV, str(EAGER_BYTES)))
        self.aborted = ""  # why the communicator was aborted (empty: it was not)
        self.error = ""  # what the watchdog recorded (ProcessGroupNCCL.get_error: a timeout), empty while none
        self.pending: set[NcclWork] = set()  # queued and not ended underneath: the device's work of this communicator
        self.changed = threading.Condition()
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()
        self._kept = kept
        kept.groups.append(self)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    def abort(self, why: str = "the communicator was aborted") -> None:  # type: ignore[override]
        """As ``ncclCommAbort``: every operation under way ends (its wait returns, holding no result), any later one
        is refused. Between ``_group_start`` and ``_group_end`` (NCCL's group call, as torch's own
        ``_abort_process_group`` makes around the aborts of several communicators) it happens at the group's end,
        with the others'. Outside one it waits first while another communicator of this process has work that cannot
        end, as ``ncclCommAbort`` does (pytorch#119797, NVIDIA/nccl#1013): until that one is aborted, its work ends,
        or its own watchdog's timeout passes."""
        if self.aborted or self._kept.deferred(self, why):
            return
        self._kept.wait_for_others(self)
        self.aborted_now(why)

    def _group_start(self) -> None:
        self._kept.group_start()

    def _group_end(self) -> None:
        self._kept.group_end()

    def watchdog(self, why: str) -> None:
        """NCCL's watchdog at a collective's timeout: the timeout recorded in the group (``get_error``), then the
        communicator aborted, from the watchdog's own thread (no group call to wait for)."""
        self.error = self.error or f"TIMEOUT: {why}"
        self.aborted_now(f"the watchdog aborted the communicator: {why}")

    def aborted_now(self, why: str) -> None:
        with self.changed:
            self.aborted = self.aborted or why
            self.changed.notify_all()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.stop()

    def shutdown(self) -> None:  # type: ignore[override]
        self.abort()

    # -- collectives: gloo on copies, the copies landed in the caller's tensors at wait() -----------------------

    def _queue(self, what: str, result: list[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
               start: Callable[[], Any], inputs: Sequence[torch.Tensor] = ()) -> NcclWork:  # fmt: skip
        """Start ``start`` (gloo, on scratch tensors); at wait() each (caller's, scratch) pair is copied."""
        if self.aborted:
            raise dist.DistBackendError(f"{NAME}: {what} on an aborted communicator ({self.aborted})")

        def land() -> None:
            with torch.no_grad():
                for mine, scratch in pairs:
                    mine.copy_(scratch)

        work = NcclWork(self, what, result, land, inputs)
        inner = start()

        def ended(future: torch.futures.Future[Any]) -> None:
            try:
                future.wait()
            except Exception as exc:  # a peer reset the connection: NCCL would not hear of it, and hang
                work.finish(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                return
            work.finish()

        inner.get_future().add_done_callback(ended)
        return work

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> NcclWork:  # type: ignore[override]
        scratch = [t.detach().clone() for t in tensors]
        return self._queue("all_reduce", tensors, list(zip(tensors, scratch)), lambda: self.gloo.allreduce(scratch, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> NcclWork:  # type: ignore[override]
        scratch = [t.detach().clone() for t in tensors]
        return self._queue("broadcast", tensors, list(zip(tensors, scratch)), lambda: self.gloo.broadcast(scratch, opts))

    def _into_rows(self, what: str, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                   start: Callable[[list[list[torch.Tensor]], list[torch.Tensor]], Any]) -> NcclWork:  # fmt: skip
        """A collective whose outputs are rows of tensors (all_gather, gather), on copies."""
        scratch = [[torch.empty_like(o) for o in row] for row in outputs]
        sent = [t.detach().clone() for t in inputs]
        pairs = [(o, s) for row, srow in zip(outputs, scratch) for o, s in zip(row, srow)]
        return self._queue(what, [o for row in outputs for o in row], pairs, lambda: start(scratch, sent), inputs)

    def _from_rows(self, what: str, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                   start: Callable[[list[torch.Tensor], list[list[torch.Tensor]]], Any]) -> NcclWork:  # fmt: skip
        """A collective whose inputs are rows of tensors (reduce_scatter, scatter), on copies."""
        scratch = [torch.empty_like(o) for o in outputs]
        sent = [[t.detach().clone() for t in row] for row in inputs]
        return self._queue(what, outputs, list(zip(outputs, scratch)), lambda: start(scratch, sent),
                           [t for row in inputs for t in row])  # fmt: skip

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> NcclWork:  # type: ignore[override]
        return self._into_rows("all_gather", outputs, inputs, lambda out, inp: self.gloo.allgather(out, inp, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> NcclWork:  # type: ignore[override]
        return self._into_rows("gather", outputs, inputs, lambda out, inp: self.gloo.gather(out, inp, opts))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> NcclWork:  # type: ignore[override]
        return self._from_rows("reduce_scatter", outputs, inputs,
                               lambda out, inp: self.gloo.reduce_scatter(out, inp, opts))  # fmt: skip

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> NcclWork:  # type: ignore[override]
        return self._from_rows("scatter", outputs, inputs, lambda out, inp: self.gloo.scatter(out, inp, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> NcclWork:  # type: ignore[override]
        scratch, sent = torch.empty_like(output), input.detach().clone()
        return self._queue("all_gather_into_tensor", [output], [(output, scratch)],
                           lambda: self.gloo._allgather_base(scratch, sent, opts), [input])  # fmt: skip

    def barrier(self, opts: Any) -> NcclWork:  # type: ignore[override]
        return self._queue("barrier", [], [], lambda: self.gloo.barrier(opts))

    # -- point-to-point ---------------------------------------------------------------------------------------

    def _channel(self, peer: int) -> _Channel:
        with self._lock:
            if peer not in self._channels:
                self._channels[peer] = _Channel(self, peer)
            return self._channels[peer]

    def p2p(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]]) -> list[NcclWork]:
        """Queue ``ops`` ((send?, tensor, group peer, tag)) to progress together, one item per peer's channel."""
        if self.aborted:
            raise dist.DistBackendError(f"{NAME}: a send or receive on an aborted communicator")
        by_peer: dict[int, list[_P2P]] = {}
        works: list[NcclWork] = []
        for send, tensor, peer, tag in ops:
            op = _P2P(send, tensor, peer, tag)
            op.work = NcclWork(self, f"{'send to' if send else 'receive from'} rank {peer}", [tensor], op.land)
            by_peer.setdefault(peer, []).append(op)
            works.append(op.work)
        for peer, item in by_peer.items():
            self._channel(peer).put(item)
        return works

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> NcclWork:  # type: ignore[override]
        return self.p2p([(True, tensors[0], dst, tag)])[0]

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> NcclWork:  # type: ignore[override]
        return self.p2p([(False, tensors[0], src, tag)])[0]


class Groups:
    """Every group of this process, until its exit: the backend's creator, registered once with torch (which keeps it
    as long as the process). Gloo's group inside each is let go only at exit, on the main thread, after the channels'
    threads stopped: let go with the last reference to the group, it could go on one of gloo's own threads (a
    collective's callback holds the work, the work its group), whose destructor then joins itself and ends the process
    with an abort; or in the interpreter's last collection, racing gloo's network thread."""

    def __init__(self) -> None:
        self.groups: list[NcclLike] = []
        self.depth = 0  # inside a group call (NCCL's ncclGroupStart ... ncclGroupEnd) while above 0
        self.aborts: list[tuple[NcclLike, str]] = []  # the aborts asked for inside it
        atexit.register(self.abort_all)

    def create(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> NcclLike:
        return NcclLike(store, rank, size, timeout, self)

    def group_start(self) -> None:
        self.depth += 1

    def group_end(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            aborts, self.aborts = self.aborts, []
            for group, why in aborts:
                group.aborted_now(why)

    def deferred(self, group: NcclLike, why: str) -> bool:
        """Whether ``group``'s abort waits for the end of the group call it was asked in."""
        if self.depth:
            self.aborts.append((group, why))
        return bool(self.depth)

    def wait_for_others(self, me: NcclLike) -> None:
        """Until no other communicator has work that cannot end (``NcclLike.abort``). The watchdog of one whose
        oldest work is past its timeout aborts it, as NCCL's does in its own thread."""
        while True:
            hung = [(group, work) for group in self.groups if group is not me and not group.aborted
                    for work in list(group.pending)]  # fmt: skip
            if not hung:
                return
            for group, work in hung:
                if time.monotonic() - work._queued >= group.timeout_s and not group.aborted:
                    group.watchdog(f"{work._what} timed out")
            time.sleep(_POLL_S)

    def abort_all(self) -> None:
        self.group_start()
        for group in self.groups:
            group.abort()
        self.group_end()
        for group in self.groups:
            for channel in list(group._channels.values()):
                channel.thread.join(timeout=1.0)
            group.gloo = None
        self.groups.clear()


_ORIGINAL_BATCH = c10d.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    """``dist.batch_isend_irecv``: on this group the operations progress together (NCCL's group call)."""
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else c10d._get_default_group()
    if not isinstance(group, NcclLike):
        return _ORIGINAL_BATCH(p2p_op_list)
    ops = [(op.op is c10d.isend, op.tensor, op.group_peer, op.tag) for op in p2p_op_list]
    return list(group.p2p(ops))


def install() -> str | None:
    """Register the backend when ``UGRO_NCCL_LIKE=1`` (once: torch's registry of backends says whether it is): its
    name, for ``init_process_group``; else None."""
    if not requested():
        return None
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, Groups().create, devices=["cpu"])
        dist.batch_isend_irecv = _batch_isend_irecv
    return NAME


def ours(group: Any) -> bool:
    """Whether ``group`` (None: the default one) is of this kind."""
    if not dist.is_initialized():
        return False
    return isinstance(group if group is not None else c10d._get_default_group(), NcclLike)
