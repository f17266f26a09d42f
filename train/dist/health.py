"""Whether the rank's process group can still be used, and the wait on a collective that ends when it cannot.

A group breaks when a peer is lost: a collective fails (a peer reset the connection), or whatever watches the group
(train/recovery/watch.py: the controller's proposal file, the peers' heartbeat) declares it broken with ``fail``.
Then every wait on it ends at once: groups with NCCL's semantics are aborted (their collectives end with an error,
as NCCL's watchdog ends them), and a wait on gloo's is left (``comm.result``), so that no rank waits for a dead peer
until the collective timeout. The rank then learns who is left and forms a new group (train/recovery/membership.py);
``renewed`` makes the health that of the new group.

One ``GroupHealth`` per rank, held by its membership and handed to whatever waits on collectives (the step's
exchange, DDP's hook, the held-out loss, the pipeline's exchanges). Where nobody watches the group (one host),
``watched`` is False and a wait is ``comm.result`` itself: a failed collective is the rank's failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from train.dist import comm

log = logging.getLogger(__name__)
T = TypeVar("T")

SETTLE_POLL_S = 0.2


class GroupLost(RuntimeError):
    """The process group lost a member: a collective failed, or the group was declared broken."""


# Text of collective errors that gloo and NCCL raise as plain RuntimeError.
COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe")


def collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a peer reset the connection, a communicator aborted, a timeout)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, dist.DistError | TimeoutError | ConnectionError | GroupLost | comm.BrokenGroup):
        return True  # the last two: the group declared broken (a peer lost, a membership without this host)
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in COLLECTIVE_WORDS)


def one_line(exc: BaseException) -> str:
    """The exception as its type and the first non-empty line of its message (train/recovery/failure.py builds on it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class GroupHealth:
    """The rank's current group: broken or not, why, and the collectives waited on now (see the module)."""

    def __init__(self, stopped: Callable[[], bool] = lambda: False) -> None:
        self.stopped = stopped  # whether a stop reached the rank: then a failed wait is the stop's, no lost peer
        self.watched = False  # set once something watches the group (several hosts): then it may break
        self.broken: str | None = None  # why the current group cannot be used any more
        self.breaks = threading.Event()  # set with ``broken``: every wait ends
        self.abandoned: list[Any] = []  # works of broken groups, maybe still pending
        self._waiting: set[Any] = set()  # the works a wait is on now (gloo's, which no abort ends)
        self._guarded: list[Callable[[Exception], None]] = []  # how to end what ``guarded`` handed out
        self._lock = threading.RLock()

    def fail(self, why: str) -> None:
        """The current group is broken: every wait on it ends now. Groups with NCCL's semantics are aborted (from the
        caller's thread, as NCCL's watchdog does): a collective of theirs waiting for a lost peer ends with an error,
        and a host blocked reading its result is released. A gloo wait is left at once (``comm.result``)."""
        with self._lock:
            first = self.broken is None
            self.broken = self.broken or why
            self.breaks.set()
            self.abandoned += [work for work in self._waiting if not work.is_completed()]
            guarded, self._guarded, reason = self._guarded, [], self.broken
        for end in guarded:
            end(GroupLost(reason))
        if first:
            try:
                comm.abort_all()
            except Exception as exc:  # the rank's own thread may be replacing the groups: it leaves them itself
                log.warning("could not abort the broken group's communicators: %s", one_line(exc))

    def renewed(self) -> None:
        """The rank is in a new group: nothing is broken."""
        with self._lock:
            self.broken = None
            self.breaks.clear()

    def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``, the collective timeout) until the collectives of broken groups have ended,
        so that the broken groups the membership keeps can be destroyed at exit without waiting on them."""
        deadline = time.monotonic() + timeout_s
        while any(not w.is_completed() for w in self.abandoned) and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)

    def guarded(self, future: torch.futures.Future[T], group: dist.ProcessGroup | None = None) -> torch.futures.Future[T]:
        """``future`` (of a collective on ``group``), or on a group without NCCL's semantics (plain gloo: CPU tensors)
        one that also ends, with GroupLost, as soon as the group is declared broken. For what waits on a future where no
        Python check reaches it: DDP waits on its communication hook's future in C++, and nothing aborts a gloo
        collective whose peer sends no reset (a cut link, a frozen host). A group with NCCL's semantics is aborted
        instead (``fail``), which fails the future itself; there the future is handed on as it is, CUDA-aware."""
        if not self.watched or comm.nccl_semantics(group):
            return future
        out, end = comm.breakable(future, group)
        with self._lock:
            if self.broken is not None:
                raise GroupLost(self.broken)
            self._guarded.append(end)

        def forget(_: torch.futures.Future[T]) -> None:
            with self._lock:
                if end in self._guarded:
                    self._guarded.remove(end)

        out.add_done_callback(forget)
        return out

    def intact(self) -> None:
        """GroupLost if the current group was declared broken (before a collective is queued on it)."""
        if self.broken is not None:
            raise GroupLost(self.broken)

    def lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` ended a step because the group lost a member (then the rank may go on in a new group).
        Any failed collective counts, also one not waited on through ``result``: gloo raises a plain RuntimeError
        for a peer that reset the connection during a blocking one."""
        if not self.watched:
            return False
        if isinstance(exc, GroupLost) or self.broken is not None:
            return True
        if self.peer_lost(exc):
            self.fail(f"a collective failed: {one_line(exc)}")
            return True
        return False

    def peer_lost(self, exc: BaseException) -> bool:
        """``exc`` is a collective that failed because of a peer, not a stop that reached this rank meanwhile."""
        return collective_error(exc) and not self.stopped() and not isinstance(exc, GroupLost)

    def wait(self, works: dist.Work | list[dist.Work] | None) -> None:
        """``result`` without a value: the collectives ended (their results, landed, are read by what follows)."""
        self.result(works, lambda: None)

    def result(self, works: dist.Work | list[dist.Work] | None, read: Callable[[], T]) -> T:
        """Wait for collectives started with ``async_op=True`` and read their result (``comm.result``: the one way);
        GroupLost if one fails, did not complete (NCCL's watchdog ended it), or the group is declared broken meanwhile.

        The wait ends at once when the group is declared broken, and a signal reaches the rank while it waits: a rank
        waiting for a peer that a stop already ended still turns the stop's SIGTERM into ``Stopped`` and records it
        (train/recovery/failure.py), instead of waiting until the collective timeout or torchrun kills it."""
        listed = [works] if isinstance(works, dist.Work) else list(works or [])
        return self._guard(lambda: comm.result(listed, read, self._breaks()), listed)

    def _breaks(self) -> threading.Event | None:
        return self.breaks if self.watched else None

    def _guard(self, call: Callable[[], T], works: Sequence[Any] = ()) -> T:
        """``call`` (which waits on ``works``, or on collectives of its own, through ``comm.result``), a failure turned
        into GroupLost where the group is watched: the one guard of every blocking collective of a step in train/."""
        if not self.watched:
            return call()
        self.intact()
        with self._lock:
            self._waiting.update(works)
        try:
            return call()
        except comm.BrokenGroup as exc:
            raise GroupLost(self.broken or str(exc)) from None
        except Exception as exc:
            if not self.peer_lost(exc) and self.broken is None:
                raise
            if self.broken is None:  # the collective itself failed: a peer reset the connection, or timed out
                self.fail(f"a collective failed: {one_line(exc)}")
            raise GroupLost(self.broken or one_line(exc)) from exc
        finally:
            with self._lock:
                self._waiting.difference_update(works)

    def committable(self, device: torch.device) -> None:
        """The step's commit point, before its update is applied: the host waits for the device (every collective
        the step queued has ended there), then asks whether one was ended by a watchdog or the group broke. DDP
        hands its hook's buffers to the gradients with no host wait; on NCCL a collective the watchdog timed out
        leaves in them whatever they held, and only the group's recorded error tells (``comm.failure``). GroupLost
        (a watched group) or ``comm.CollectiveFailed``: a failed collective, never an update."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._guard(lambda: comm.result(None, lambda: None, self._breaks()))

    def gather_objects(self, obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        """Collective: every rank's ``obj`` (picklable), by rank (``comm.gather_objects``), under the guard: a broken
        group abandons it where ``dist.all_gather_object`` blocks until the collective timeout. CPU tensors: ``group``
        must be a gloo group (the default one on CPU; ``comm.control_group()`` beside NCCL)."""
        return self._guard(lambda: comm.gather_objects(obj, group, self._breaks()))

    def broadcast_objects(self, obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
        """Collective: rank ``src``'s ``obj`` on every rank (``comm.broadcast_objects``), under the guard."""
        return self._guard(lambda: comm.broadcast_objects(obj, src, group, self._breaks()))
