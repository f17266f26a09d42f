"""Collectives and point-to-point calls: the one rule of which device their tensors live on, and the one way a
collective's result is read.

A group's backend decides: NCCL (the default group on GPU hosts, and every group made beside it without a
backend) carries CUDA tensors of the rank's device only; gloo (the default group on CPU, the control group made
beside NCCL for barriers and Python objects) carries CPU tensors. ``carrier(group)`` says which device that is,
``tensor``/``zeros`` make a tensor there, and every call below refuses, with one line naming the caller, a tensor
the group's backend would not carry: NCCL's own error ("No backend type associated with device type cpu") names
neither. Code in ``train/`` makes its collectives here (tests/test_devicecheck.py reads train/ for calls that go
around it); under ``UGRO_CHECK_DEVICES=1`` the same refusal happens on CPU, where NCCL would (train/dist/devicecheck.py).

When a result may be read: an NCCL work's future is complete as soon as the collective is *queued*; only
``work.wait()`` (or a wait on the work's own future, or a ``then`` of it) orders the current stream after NCCL's.
So a result is read through ``result`` (on the host: the work's wait, then the read) or ``then`` (a DDP hook: the
work's own future, whose callback waits on the work before it hands the tensor on), and nowhere else; a future made
by hand carries no CUDA events and orders nothing. Under ``UGRO_NCCL_LIKE=1`` (train/dist/nccl_like.py, every test
rank) a result lands only at ``work.wait()``, so a read any other way reads stale figures in the tests too.

When a result is a result: a wait returns also for a collective that never completed. NCCL's watchdog ends a
collective that outlived the group's timeout by recording the error in the group (``ProcessGroupNCCL.get_error``:
TIMEOUT or COMM_ERROR) and aborting the communicator; ``work.wait()`` had only made the stream wait, and the host's
read of the buffer returns whatever it holds (the caller's own figures, a partial sum). ``result`` therefore asks
every communicator of the rank, after the read, whether it failed (``failure``), and raises ``CollectiveFailed``
instead of handing the figures on; the blocking forms below (``async_op=False``) wait through it, and so do the
object collectives (``gather_objects``, ``broadcast_objects``). What DDP reads from its hook's future is checked at the
step's commit point (train/dist/health.py ``GroupHealth.committable``), after the host has read the step's figures.

Sends and receives between two ranks go through ``exchange`` only: one ``batch_isend_irecv``, so that a send and a
receive that must progress together do (NCCL: a large send completes only when its receive is posted).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType
from torch.distributed import distributed_c10d as c10d

from train.dist import devicecheck, nccl_like

T = TypeVar("T")

CONTROL = "ugro-control"  # the control group's description, by which it is found among the world's groups


def _nccl(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_backend(group) == dist.Backend.NCCL


def nccl_semantics(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default one) completes, orders and fails as NCCL does: NCCL itself, or the test
    backend that behaves like it (train/dist/nccl_like.py). Such groups are aborted, never destroyed, when broken."""
    return _nccl(group) or nccl_like.ours(group)


def control_group() -> dist.ProcessGroup | None:
    """The gloo group for monitored barriers and gathers of Python objects: the default group (None) on CPU, a gloo
    group beside NCCL on GPUs (and under the device checker, whose default group stands for NCCL). Every rank
    calls it at the same point the first time (making a group is collective)."""
    if not nccl_semantics(None) and not devicecheck.installed():
        return None
    return next(iter(control_groups()), None) or dist.new_group(backend="gloo", group_desc=CONTROL)


def control_groups() -> tuple[dist.ProcessGroup, ...]:
    """The control groups made beside the default group (none on CPU): kept in torch's registry of the world's
    groups, which a new default group (a regroup) starts empty."""
    if not dist.is_initialized():
        return ()
    return tuple(group for group in c10d._world.pg_names if group.group_desc == CONTROL)


def carrier(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group`` (None: the default group) carries."""
    if group is not None and group.group_desc == CONTROL:
        return torch.device("cpu")
    if _nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return devicecheck.RANK_DEVICE if devicecheck.installed() else torch.device("cpu")


def tensor(values: Any, dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``values`` as a tensor on the device ``group`` carries."""
    return torch.tensor(values, dtype=dtype, device=carrier(group))


def zeros(shape: int | Sequence[int], dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=carrier(group))


def check(call: str, tensors: torch.Tensor | Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Refuse a tensor that ``group``'s backend does not carry, naming the call and its caller."""
    if devicecheck.installed():
        devicecheck.check(call, tensors, group)
        return
    wanted = carrier(group).type
    for item in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        if item.device.type != wanted:
            raise devicecheck.WrongDevice(
                f"{call} at {devicecheck.caller()} was given a {item.device.type} tensor; this group "
                f"({dist.get_backend(group)}) carries {wanted} tensors only. Make it with train.dist.comm (comm.tensor, "
                "comm.zeros) or on the rank's device."
            )


def _queued(work: dist.Work | None, async_op: bool) -> dist.Work | None:
    """The work for the caller to wait on (``async_op``), or none once its result is known good (``result``)."""
    if async_op:
        return work
    result(work, lambda: None)
    return None


def all_reduce(
    value: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    check("all_reduce", value, group)
    return _queued(dist.all_reduce(value, op=op, group=group, async_op=True), async_op)


def all_gather(
    out: list[torch.Tensor], value: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    check("all_gather", [value, *out], group)
    return _queued(dist.all_gather(out, value, group=group, async_op=True), async_op)


def broadcast(
    value: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    check("broadcast", value, group)
    return _queued(dist.broadcast(value, src=src, group=group, async_op=True), async_op)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None, broken: threading.Event | None = None) -> list[Any]:
    """Collective: every rank's ``obj`` (picklable), by rank, as ``dist.all_gather_object`` gives them, in two
    collectives whose results are checked (``result``) before a byte is unpickled: a size or a payload that a
    watchdog left in the buffer never becomes an object. ``group`` must carry CPU tensors for the pickles' sake where
    it is gloo; on NCCL the bytes travel on the rank's device."""
    data = _pickled(obj)
    world = dist.get_world_size(group)
    sizes = [zeros(1, torch.int64, group) for _ in range(world)]
    work = all_gather(sizes, tensor([data.numel()], torch.int64, group), group, async_op=True)
    lengths = result(work, lambda: [int(size) for size in sizes], broken)
    padded = zeros(max(lengths), torch.uint8, group)
    padded[: data.numel()] = data.to(padded.device)
    gathered = [zeros(max(lengths), torch.uint8, group) for _ in range(world)]
    blobs = result(all_gather(gathered, padded, group, async_op=True),
                   lambda: [t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, lengths, strict=True)], broken)  # fmt: skip
    return [pickle.loads(blob) for blob in blobs]


def broadcast_objects(obj: Any, src: int, group: dist.ProcessGroup | None = None,
                      broken: threading.Event | None = None) -> Any:  # fmt: skip
    """Collective: rank ``src``'s ``obj`` (picklable; the others pass anything) on every rank, in two checked
    broadcasts (``gather_objects`` says why). ``src`` is a global rank."""
    mine = dist.get_rank() == src
    data = _pickled(obj) if mine else None
    size = tensor([data.numel() if data is not None else 0], torch.int64, group)
    length = result(broadcast(size, src, group, async_op=True), lambda: int(size), broken)
    payload = zeros(length, torch.uint8, group)
    if data is not None:
        payload[:] = data.to(payload.device)
    blob = result(broadcast(payload, src, group, async_op=True), lambda: payload.cpu().numpy().tobytes(), broken)
    return obj if mine else pickle.loads(blob)


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]] = (), receives: Sequence[tuple[torch.Tensor, int]] = ()
) -> list[dist.Work]:
    """Queue ``sends`` ((tensor, global rank)) and ``receives`` ((buffer, global rank)) of the default group as one
    batch that progresses together (NCCL's group call: a send to a neighbour and the receive from it cannot wait on
    each other). The works: wait on every one (``result``) before a receive's buffer is read or a send's tensor is
    reused. The only point-to-point call in train/."""
    check("batch_isend_irecv", [t for t, _ in (*sends, *receives)], None)
    ops = [dist.P2POp(c10d.isend, tensor, peer) for tensor, peer in sends]
    ops += [dist.P2POp(c10d.irecv, buffer, peer) for buffer, peer in receives]
    return list(dist.batch_isend_irecv(ops)) if ops else []


def result(works: dist.Work | Sequence[dist.Work] | None, read: Callable[[], T],
           broken: threading.Event | None = None) -> T:  # fmt: skip
    """The one way to read collectives' results on the host: wait on each work (NCCL: the current stream waits for
    NCCL's; the test backend: the result lands now), then ``read``. On gloo the wait is on the work's future in
    Python, so that a signal (a stop's SIGTERM) and ``broken`` (set when the group is declared broken) reach the
    caller; a group with NCCL's semantics is aborted instead (train/dist/health.py ``GroupHealth.fail``), which
    ends its wait with an error. ``BrokenGroup`` when ``broken`` was set."""
    for work in [works] if isinstance(works, dist.Work) else (works or ()):
        try:
            future = work.get_future()  # NCCL's and the test backend's: complete already
        except RuntimeError:
            future = None  # gloo's sends and receives have none: their wait blocks
        if future is not None:
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            while not done.wait(0.05):
                if broken is not None and broken.is_set():
                    raise BrokenGroup("the group was declared broken while a collective was under way")
        work.wait()
    value = read()
    if broken is not None and broken.is_set():  # NCCL: the read returned because the communicator was aborted
        raise BrokenGroup("the group was declared broken while a collective's result was read")
    why = failure()
    if why is not None:  # NCCL's watchdog ended it: the read returned what the buffer held
        raise CollectiveFailed(f"a collective did not complete, its buffer is no result: {why}")
    return value


def failure() -> str | None:
    """Why a communicator of this rank (a group with NCCL's semantics) failed, or None while none has. NCCL's
    watchdog records a timed-out or failed collective in its group (``ProcessGroupNCCL.get_error``) before it aborts
    the communicator; the test backend records the same (train/dist/nccl_like.py ``NcclLike.error``)."""
    if not dist.is_initialized():
        return None
    for group in list(c10d._world.pg_names):
        if isinstance(group, nccl_like.NcclLike):
            if group.error:
                return f"{nccl_like.NAME} group {group.group_desc or group.group_name}: {group.error}"
        elif _nccl(group):
            error = group._get_backend(torch.device("cuda")).get_error()
            if error != ErrorType.SUCCESS:
                return f"NCCL group {group.group_desc or group.group_name}: {error.name}"
    return None


def then(
    work: dist.Work | None, read: Callable[[], T], group: dist.ProcessGroup | None = None
) -> torch.futures.Future[T]:
    """A future of ``read()`` after ``work`` on ``group`` (for DDP's communication hooks): a ``then`` of the work's own
    future (CUDA-aware on NCCL), whose callback waits on the work before it reads where the group has NCCL's
    semantics. On gloo the future completes once the result is written, and its callback runs on gloo's own thread
    before the work counts as complete: a wait on the work there would wait on itself; the future's own value says
    whether the collective failed. Either way a failed collective fails the future: its buffer is never handed on as
    a result."""
    assert work is not None, "then: the collective must be started with async_op=True"
    wait = nccl_semantics(group)

    def landed(done: torch.futures.Future[Any]) -> T:
        if wait:
            work.wait()
        else:
            done.value()  # raises the collective's error
        return read()

    return work.get_future().then(landed)


def breakable(
    future: torch.futures.Future[T], group: dist.ProcessGroup | None = None
) -> tuple[torch.futures.Future[T], Callable[[Exception], None]]:
    """``future`` (of a collective on ``group``) as a future that something else may also end early, and how to end
    it: ``end(error)`` fails it unless the collective ended first. For what waits on a collective's future where no
    Python check reaches it (DDP waits on its hook's future in C++). Only on a group without NCCL's semantics (plain
    gloo: CPU tensors, nothing for CUDA events to order), whose pending collectives nothing else ends: a group with
    NCCL's semantics is aborted instead, which fails the future itself, so there ``future`` is handed on as it is,
    CUDA-aware, and ``end`` does nothing."""
    if nccl_semantics(group):
        return future, lambda _error: None
    out: torch.futures.Future[Any] = torch.futures.Future(devices=[])  # CPU tensors only: no devices to carry
    lock = threading.Lock()

    def complete(value: Any = None, error: Exception | None = None) -> None:
        with lock:
            if out.done():
                return
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(value)

    def landed(done: torch.futures.Future[T]) -> None:
        try:
            value = done.value()
        except Exception as exc:  # the collective's error, handed on
            complete(error=exc)
            return
        complete(value=value)

    future.add_done_callback(landed)
    return cast("torch.futures.Future[T]", out), lambda error: complete(error=error)


class BrokenGroup(RuntimeError):
    """A wait ended because the group was declared broken (train/dist/health.py turns it into GroupLost)."""


class CollectiveFailed(dist.DistBackendError):
    """A wait returned for a collective that did not complete (NCCL's watchdog timed it out or saw its communicator
    fail): its buffer holds no result. A failed collective, as a lost peer's (train/dist/health.py)."""


def _group_call() -> Any:
    """What opens and closes one NCCL group call (``_group_start``/``_group_end``): the default group's NCCL backend,
    or the test backend's default group; None on plain gloo."""
    default = c10d._get_default_group()
    if nccl_like.ours(default):
        return default
    return default._get_backend(torch.device("cuda")) if _nccl(None) else None


def abort_all() -> None:
    """Abort every group with NCCL's semantics (``ncclCommAbort``): their waits return, holding no result. In one
    NCCL group call, newest group first, as torch's ``_abort_process_group`` does: aborted one after another, the
    abort of one communicator can wait forever on another's hung kernel (pytorch#119797, NVIDIA/nccl#1013), and a
    pipeline holds several (the default group, the gradient-sync subgroups). From any thread: the world's registry is
    left as it is (train/dist/distributed.py ``leave`` clears it on the rank's own thread)."""
    if not dist.is_initialized():
        return
    names = c10d._world.pg_names
    groups = [g for g in sorted(names, key=lambda g: names[g], reverse=True) if nccl_semantics(g)]
    call = _group_call()
    if call is not None:
        call._group_start()
    try:
        for group in groups:
            group.abort()
    finally:
        if call is not None:
            call._group_end()
