"""Process group set-up, DDP wrapping, and the start-up guard that every rank runs the same job."""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import typing
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from train.dist import comm, devicecheck, nccl_like
from train.dist.health import GroupHealth
from train.config import ConfigError, JobConfig
from train.balance.step import StepClock


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    host: str
    device: torch.device
    main_rank: int = 0  # writes metrics and checkpoints: local rank 0 of the main host
    hosts: tuple[str, ...] = ()  # the host of every rank, by rank
    attempt: int = 0  # which launch of the run this is (the controller's UGRO_ATTEMPT)
    stores: tuple[tuple[str, str], ...] = ()  # (host, address:port of its regroup store) for every host

    @property
    def is_main(self) -> bool:
        return self.rank == self.main_rank


class StoreServer:
    """This host's regroup store, kept by its first rank and listening from the start on a port of the ephemeral range
    (which the firewall opens to the cluster's members): a regroup never waits for a server to come up, and a host
    that becomes the main one forms the next group through it."""

    def __init__(self, address: str) -> None:
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.endpoint = f"{address}:{self.store.port}"


def endpoint_store(endpoint: str, timeout_s: float) -> dist.Store:
    """A client of the store at ``endpoint`` (address:port)."""
    host, port = endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def init(timeout_s: int) -> tuple[RankInfo, StoreServer | None]:
    """Join the process group torchrun prepared: NCCL on CUDA, gloo on CPU. This rank's place, and on each host's
    first rank of a distributed run its regroup store."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        # Tests: the default group behaves as NCCL does (train/dist/nccl_like.py), and under the device checker the
        # rank's device stands for its GPU (train/dist/devicecheck.py).
        device = devicecheck.RANK_DEVICE if devicecheck.install() else torch.device("cpu")
        backend = cpu_backend()
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device
            # A collective past the timeout: the watchdog aborts the communicator and the wait raises, and the
            # rank records the failure (the default, 3, ends the process without a word). A regroup aborts the
            # broken group itself before (``leave``).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        dist.init_process_group(**kwargs)
        comm.control_group()  # made now, while every rank is here: made later, a lost peer would block it
    host = os.environ.get("UGRO_HOST") or socket.gethostname()
    server = _store_server() if dist.is_initialized() and local_rank == 0 else None
    main_rank, hosts, stores = _roll_call(host, rank, local_rank, world, server)
    attempt = int(os.environ.get("UGRO_ATTEMPT", "0"))
    return RankInfo(rank, local_rank, world, host, device, main_rank, hosts, attempt, stores), server


def _store_server() -> StoreServer:
    address = os.environ.get("UGRO_CLUSTER_ADDRESS") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return StoreServer(address)


def cpu_backend() -> str:
    """gloo, or in the tests the backend that behaves as NCCL does (``UGRO_NCCL_LIKE=1``)."""
    return nccl_like.install() or "gloo"


def collectives_backend() -> str | None:
    """The default group's backend as torch names it (nccl, gloo, or the tests' ugro_nccl_like); None in a
    one-process run without a group."""
    return str(dist.get_backend()) if dist.is_initialized() else None


def _roll_call(
    host: str, rank: int, local_rank: int, world: int, server: StoreServer | None
) -> tuple[int, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Every rank's host, the rank whose disk holds the run, and every host's regroup store.

    The main rank is local rank 0 on the host the launcher marked UGRO_MAIN_HOST=1: c10d
    rendezvous numbers nodes by their address, not by inventory order, so global rank 0 may
    live on any host; checkpoints and metrics belong on the main host all the same.
    Local rank 0 of every host opens the store a regroup would use if that host became the main one.
    """
    candidate = rank if os.environ.get("UGRO_MAIN_HOST") == "1" and local_rank == 0 else world
    if not dist.is_initialized():
        return 0, (host,), ()
    endpoint = server.endpoint if server is not None else ""
    entries: list[tuple[str, int, str]] = comm.gather_objects((host, candidate, endpoint))
    chosen = min(c for _, c, _ in entries)
    stores = tuple((h, e) for h, _, e in entries if e)
    return (chosen if chosen < world else 0), tuple(h for h, _, _ in entries), stores


def form(new: RankInfo, store: dist.Store, prefix: str, timeout_s: int, retired: list[Any]) -> None:
    """Leave the current default group (without waiting for what is under way in it) and form ``new``'s through
    ``store``, under ``prefix`` (every group's keys apart in the store).

    The groups left behind go into ``retired``, kept until the process ends: a collective abandoned in one may still be
    pending (a cut link: it ends at the collective timeout), and the gloo thread that ends it runs its future's Python
    callback, which needs the GIL; destroying the group on this thread (holding the GIL) would join that thread: a
    deadlock. gloo: destroying the group returns at once, a collective pending on the lost peer fails with it. NCCL:
    such a collective is a kernel on the GPU waiting for a peer that is gone; it holds its stream, and destroying the
    group would wait for it. Aborting every communicator (``leave``) ends those kernels with an error. The new group is
    formed with ``device_id``: NCCL connects its communicator now, on this rank's GPU, not at the first collective.
    The model, the optimizer state and the gradients stay on the device throughout: they belong to the process, not
    to the group."""
    if dist.is_initialized():
        retired.extend(dist.distributed_c10d._world.pg_map)  # the default, control and pipeline groups
        leave()
    kwargs: dict[str, Any] = {"backend": "nccl" if new.device.type == "cuda" else cpu_backend(),
                              "timeout": datetime.timedelta(seconds=timeout_s)}  # fmt: skip
    if new.device.type == "cuda":
        kwargs["device_id"] = new.device
    dist.init_process_group(store=dist.PrefixStore(prefix, store), rank=new.rank, world_size=new.world_size, **kwargs)
    comm.control_group()  # the new group's, made while every member is here


def leave() -> None:
    """Leave every process group of the current default group: NCCL's aborted, gloo's destroyed."""
    if comm.nccl_semantics(None):  # NCCL, or the test backend that behaves like it
        comm.abort_all()  # in one group call, as torch does it for NCCL (not for the test backend)
        dist.distributed_c10d._abort_process_group()  # every group, the control and pipeline ones too
    else:
        dist.destroy_process_group()


def wait_for_all(what: str, timeout_s: int) -> None:
    """Collective: every rank waits here for all the others, at most ``timeout_s`` seconds.

    For the waits that take each rank its own, long time (loading the model; the main rank writing the
    adapter and the samples at the end) rather than the process-group timeout, which bounds every other
    collective so that a lost peer is noticed within ``distributed.timeout_s``. A gloo monitored barrier:
    on a timeout it names the ranks that did not arrive. Without the final wait the non-main ranks tore
    their gloo connections down while the main rank still worked, and once a rank aborted at exit.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        dist.monitored_barrier(group=comm.control_group(), timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise dist.DistError(f"waiting until {what}: {exc}") from exc


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(problem: str | None, info: RankInfo) -> None:
    """Collective: if any rank could not load its configuration, every rank raises the same error."""
    problems: list[str | None] = [problem]
    if dist.is_initialized():
        problems = comm.gather_objects(problem)
    found = list(dict.fromkeys(p for p in problems if p))
    if found:
        raise ConfigError("\n".join(found))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_same_job(job: JobConfig, info: RankInfo) -> None:
    """All-gather every rank's cluster-wide config; on any difference fail on every rank, naming it."""
    if not dist.is_initialized():
        return
    mine = (info.host, info.rank, job.cluster_hash(), _flatten(job.cluster_wide()))
    everyone: list[Any] = comm.gather_objects(mine)
    ref_host, _, ref_hash, ref_flat = everyone[0]
    for host, rank, digest, flat in everyone[1:]:
        if digest == ref_hash:
            continue
        keys = sorted(k for k in set(flat) | set(ref_flat) if flat.get(k) != ref_flat.get(k))
        shown = ", ".join(f"{k} ({ref_flat.get(k)!r} on {ref_host} vs {flat.get(k)!r})" for k in keys)
        raise ConfigError(
            f"host {host} (rank {rank}) runs a different job than {ref_host}: cluster-wide key(s) differ: {shown}. "
            "Sync the same job file and train code to every host."
        )


def compression(job: JobConfig, info: RankInfo, model: torch.nn.Module) -> str:
    """bf16 or none: auto compresses fp32 gradients when they cross a network link (ranks on several hosts)."""
    setting = job.distributed.grad_compression
    if setting != "auto":
        return setting
    fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    return "bf16" if fp32 and len(set(info.hosts)) > 1 else "none"


@dataclass
class _HookState:
    clock: StepClock
    compress: bool
    health: GroupHealth
    process_group: dist.ProcessGroup | None = None


def _timed_allreduce(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: note that this rank's gradients are ready, then all-reduce them (averaged).

    DDP reads the bucket when the returned future completes: a ``then`` of the all-reduce's own future whose callback
    waits on the work first (``comm.then``), so that the bucket is read after NCCL wrote it. torch's default hooks
    hand the work's future on without that wait, which NCCL makes right through CUDA streams but the test backend
    does not (train/dist/nccl_like.py: stricter, a result lands only at ``work.wait()``). On plain gloo the future
    also ends when the group is declared broken (``GroupHealth.guarded``): DDP waits on it where nothing else would
    end the wait for a peer that sends no reset."""
    # On CUDA the lap records an event on this thread's current stream. DDP calls the hook from autograd's
    # device thread, whose current stream is the one the backward kernels of this bucket were queued on, so the
    # event completes exactly when the GPU has computed the bucket's gradients, before the all-reduce (queued
    # next, on NCCL's stream) and its wait for slower ranks.
    state.clock.lap()
    state.health.intact()  # a group declared broken takes no new collective (its NCCL groups are aborted already)
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    group = state.process_group
    if not state.compress:
        buffer.div_(world)
        work = comm.all_reduce(buffer, group=group, async_op=True)
        return state.health.guarded(comm.then(work, lambda: buffer, group), group)
    compressed = buffer.to(torch.bfloat16).div_(world)

    def decompressed() -> torch.Tensor:
        return buffer.copy_(compressed)

    work = comm.all_reduce(compressed, group=group, async_op=True)
    return state.health.guarded(comm.then(work, decompressed, group), group)


# DDP inspects the hook's annotations as objects; `from __future__ import annotations` left strings.
_timed_allreduce.__annotations__ = typing.get_type_hints(_timed_allreduce)


def broadcast_trainable(model: torch.nn.Module, info: RankInfo, src: int = 0) -> int:
    """Collective: every rank takes rank ``src``'s trainable parameters; returns the bytes broadcast.

    Ranks first agree that they hold the same trainable parameters (names, shapes, dtypes): DDP's
    own check is part of the start-up sync that ``wrap`` turns off. Then one broadcast per dtype
    (and device) of all of them flattened together, not one per tensor.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layout = hashlib.sha256(repr([(n, tuple(p.shape), str(p.dtype)) for n, p in named]).encode()).hexdigest()
    entries: list[tuple[str, int, str, int]] = comm.gather_objects((info.host, info.rank, layout, len(named)))
    ref_host, ref_rank, ref_layout, ref_count = entries[src]
    odd = [f"{host} (rank {rank}: {count} tensors)" for host, rank, digest, count in entries if digest != ref_layout]
    if odd:
        raise ConfigError(
            f"the trainable parameters differ from {ref_host}'s (rank {ref_rank}: {ref_count} tensors) on "
            f"{', '.join(odd)}: every host must load the same base model and adapter. Sync the model directory "
            "and the train code to every host."
        )
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for _, param in named:
        groups.setdefault((param.device, param.dtype), []).append(param)
    sent = 0
    with torch.no_grad():
        for params in groups.values():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            comm.broadcast(flat, src=src)
            for target, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
                target.copy_(value.view_as(target))
            sent += flat.numel() * flat.element_size()
    return sent


def wrap(model: torch.nn.Module, info: RankInfo, clock: StepClock | None = None, compress: str = "none", src: int = 0,
         health: GroupHealth | None = None) -> torch.nn.Module:  # fmt: skip
    """DDP over the trainable (LoRA) parameters only, with a timing (and optionally bf16) all-reduce hook.

    DDP's start-up sync (``init_sync``) would broadcast every parameter and buffer from rank 0, the
    frozen base included: every rank loads identical base weights from disk, and broadcasting a
    quantized 7B base would cost ~30 s on 1 GbE. It is turned off, and only the trainable
    parameters are broadcast, once, so that every rank starts from rank ``src``'s (0 at the start; after a
    regroup the survivor whose state the others take).
    """
    if not dist.is_initialized() or info.world_size == 1:
        return model  # one rank: nothing to synchronize, DDP would only add its bookkeeping to every step
    broadcast_trainable(model, info, src)
    ddp = DistributedDataParallel(
        model,
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        init_sync=False,
        forward_sync_buffers=False,  # buffers (rotary tables) are computed alike on every rank
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(_HookState(clock or StepClock(), compress == "bf16", health or GroupHealth()),
                           _timed_allreduce)  # fmt: skip
    return ddp


def check_gradients_agree(params: list[torch.nn.Parameter], info: RankInfo, backend: str, health: GroupHealth) -> None:
    """Collective, once, after the first synchronizing backward under DDP: every rank holds the same gradients.

    DDP all-reduces them, so they agree to the bit. A library that silently turns DDP's synchronization off (unsloth
    did, with one GPU per node) leaves each rank training its own adapter while every step looks normal; this
    stops the run at its first step, naming the hosts, instead of handing over one rank's adapter as the whole's.
    """
    if not dist.is_initialized() or info.world_size == 1:
        return
    squares = comm.zeros((), torch.float64)
    for param in params:
        if param.grad is not None:
            squares += param.grad.detach().double().pow(2).sum()
    everyone = [comm.zeros((), torch.float64) for _ in range(info.world_size)]
    gathered = health.result(comm.all_gather(everyone, squares, async_op=True), lambda: [float(t) for t in everyone])
    norms = [value**0.5 for value in gathered]
    if max(norms) - min(norms) <= 1e-6 * max(max(norms), 1e-12):
        return
    shown = ", ".join(
        f"{host} (rank {rank}): {norm:.6g}" for rank, (host, norm) in enumerate(zip(info.hosts, norms, strict=True))
    )
    raise ConfigError(
        f"model.backend: {backend}: after the first step's synchronizing backward the ranks' gradient norms differ "
        f"({shown}): DDP did not all-reduce the gradients, and every host would train an adapter of its own. "
        "unsloth has had a bug that turns DDP's synchronization off; set model.backend: hf in the job, or an "
        "unsloth version without it."
    )
