"""`python -m bench.gpu OUT multirank`: the multi-rank semantics of train/dist, for whoever is lent a GPU.

NCCL refuses two ranks on one GPU, and no machine here has two: what several ranks do on NCCL is shown on CPU by the
NCCL-like test backend (train/dist/nccl_like.py). With one GPU this bench shows what one GPU can:

- ``stream``: an NCCL group of one rank. A collective queued behind a long kernel on the current stream: whether its
  work's future is already complete when queued (NCCL's is), whether ``comm.result`` reads the value NCCL wrote, the
  group's recorded error (``comm.failure``: ``get_error()``), and how long ``comm.abort_all`` takes over the default
  group and a subgroup, in one NCCL group call;
- ``hook``: ugro's DDP communication hook (train/dist/distributed.py ``wrap``) on that NCCL group over a CUDA model:
  the gradients DDP hands back equal the local backward's (one rank: the average is itself), and the step's commit
  point (``GroupHealth.committable``) passes on a healthy group;
- ``ranks``: three ranks on the one device, gloo over CUDA tensors (torch stages them through the host): each rank's
  all-reduce result, read after the work's wait, is the sum of all three.

Without CUDA it runs dry: ``ranks`` on CPU over the NCCL-like backend (three ranks: the step's exchange, a hook's
average, a collective the watchdog ends read as NaN and refused by ``comm.result``), and the record says what the
GPU parts would show and that they did not run. One JSON line per part in OUT/gpu.jsonl.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORLD = 3
GPU_PARTS = {
    "stream": "a result read after an NCCL work's wait holds what NCCL wrote behind a long kernel; the work's future "
    "is complete when queued; get_error() is SUCCESS on a healthy group; abort_all over two communicators returns",
    "hook": "ugro's DDP hook on NCCL with a CUDA model hands back the local gradients (one rank) and the commit point "
    "passes",
    "ranks": "three ranks on one GPU, gloo over CUDA tensors: each all-reduce result read after its wait is the sum",
}


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init(rank: int, world: int, port: int, backend: str, timeout_s: float = 30) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")  # fmt: skip
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _stream(out: str) -> None:
    """One rank, NCCL: the stream order, the recorded error and a grouped abort (``GPU_PARTS['stream']``)."""
    import torch
    import torch.distributed as dist

    from train.dist import comm

    _init(0, 1, _port(), "nccl")
    a = torch.randn(4096, 4096, device="cuda")
    x = torch.zeros(1, device="cuda")
    for _ in range(20):  # a long kernel chain on the current stream, then x written behind it
        a = a @ a / a.norm()
    x.copy_(a[0, :1] * 0 + 7.0)
    work = dist.all_reduce(x, async_op=True)
    queued_done = bool(work.get_future().done())
    value = comm.result(work, lambda: float(x.item()))
    healthy = comm.failure()
    subgroup = dist.new_group([0])
    dist.all_reduce(torch.ones(1, device="cuda"), group=subgroup)
    started = time.monotonic()
    comm.abort_all()
    record = {"future_done_when_queued": queued_done, "read": value, "expected": 7.0, "failure": healthy,
              "abort_all_s": round(time.monotonic() - started, 3)}  # fmt: skip
    Path(out).write_text(json.dumps(record))


def _hook(out: str) -> None:
    """One rank, NCCL: ugro's DDP hook over a CUDA model, and the commit point (``GPU_PARTS['hook']``)."""
    import torch

    from train.dist import distributed
    from train.dist.distributed import RankInfo
    from train.dist.health import GroupHealth

    _init(0, 1, _port(), "nccl")
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    batch = torch.randn(32, 64, device=device)
    model(batch).square().sum().backward()
    local = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    info = RankInfo(0, 0, 1, "gpu", device, 0, ("gpu",), 0, ())
    health = GroupHealth()
    wrapped = distributed.wrap(model, info, health=health)
    wrapped(batch).square().sum().backward()
    hooked = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    health.committable(device)
    diff = max(float((a - b).abs().max()) for a, b in zip(local, hooked, strict=True))
    Path(out).write_text(json.dumps({"max_abs_diff": diff, "committed": True}))


def _ranks(rank: int, port: int, out: str, device_kind: str) -> None:
    """``WORLD`` ranks on one device: gloo over CUDA tensors on a GPU; on CPU the NCCL-like backend, with the step's
    exchange, a hook's average and a collective the watchdog ends."""
    import torch
    import torch.distributed as dist

    from train.dist import comm, nccl_like

    seen: dict[str, Any] = {}
    if device_kind == "cuda":
        _init(rank, WORLD, port, "gloo")
        value = torch.full((1024,), float(rank + 1), device="cuda")
        work = dist.all_reduce(value, async_op=True)
        work.wait()
        seen["all_reduce"] = float(value[0].item())
    else:
        os.environ[nccl_like.ENV] = "1"
        _init(rank, WORLD, port, str(nccl_like.install()), timeout_s=3)
        from train.balance.step import StepClock, exchange

        clock = StepClock()
        clock.last_tokens = 10 * (rank + 1)
        seen["exchange_tokens"] = exchange(rank + 1, clock)
        value = torch.full((4,), float(rank + 1))
        averaged = comm.then(comm.all_reduce(value.div_(WORLD), async_op=True), lambda: value.tolist())
        seen["hook_average"] = averaged.wait()[0]
        if rank == WORLD - 1:
            time.sleep(6)  # alive, never joins the next collective
            os._exit(0)
        stalled = torch.ones(2)
        try:
            comm.result(comm.all_reduce(stalled, async_op=True), lambda: stalled.tolist())
            seen["watchdog"] = "read as a result"
        except comm.CollectiveFailed as exc:
            seen["watchdog"] = f"refused, buffer {stalled.tolist()}: {str(exc)[:120]}"
    Path(out).with_suffix(f".{rank}").write_text(json.dumps(seen))
    os._exit(0)


def _spawn(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    mp.spawn(fn, args=args, nprocs=nprocs, join=True)


def multirank(out: Path, emit: Callable[[Path, dict[str, Any]], None]) -> None:
    """The parts above; on a machine without CUDA, the dry form."""
    import torch

    cuda = torch.cuda.is_available()
    scratch = Path(tempfile.mkdtemp(prefix="ugro-multirank-"))
    results: dict[str, Any] = {}
    if cuda:
        for name, fn in (("stream", _stream), ("hook", _hook)):
            path = scratch / name
            _spawn(_single, 1, fn.__name__, str(path))
            results[name] = json.loads(path.read_text())
    path = scratch / "ranks"
    _spawn(_ranks, WORLD, _port(), str(path), "cuda" if cuda else "cpu")
    ranks = [json.loads(path.with_suffix(f".{r}").read_text()) for r in range(WORLD)
             if path.with_suffix(f".{r}").is_file()]  # fmt: skip
    results["ranks"] = ranks
    record: dict[str, Any] = {"what": "multirank", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                              "dry": not cuda, "results": results}  # fmt: skip
    if not cuda:
        record["not_run"] = {name: f"would show: {what}" for name, what in GPU_PARTS.items()}
    emit(out, record)


def _single(_rank: int, name: str, path: str) -> None:
    {"_stream": _stream, "_hook": _hook}[name](path)
