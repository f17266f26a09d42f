"""The preflight all-reduce: one rank per host, the job's backend, latency and bus bandwidth per host.

Run by the preflight role under torchrun (static rendezvous, node rank 0 on the main host):

    python -m torch.distributed.run ... --module train.tools.allreduce --env-file F --interface IF

Each rank prints one line ``UGRO_ALLREDUCE {json}``: latency (median of small all-reduces) and, for
a tensor of --bytes, algbw = bytes / time and busbw = algbw * 2 (n - 1) / n, as nccl-tests defines
it for all-reduce (the bandwidth each link must carry, comparable across cluster sizes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from train.dist import comm

MARK = "UGRO_ALLREDUCE"


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s of one all-reduce of nbytes over world ranks that took seconds."""
    algbw = nbytes / seconds if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (optionally `export KEY=...`, quoted values) as the launch script sources them;
    comments and blanks skipped."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip().removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            values[key.strip()] = value.strip().strip("'\"")
    return values


def socket_env(env_file: Path, interface: str) -> dict[str, str]:
    """What the launch script exports: the env file's variables, else the interface that holds the host's
    cluster address (found by the host facts module, ugro_host_facts, and passed in by the preflight role)."""
    env = read_env_file(env_file) if env_file.is_file() else {}
    if interface:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


def _timed(tensor: torch.Tensor, iters: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        comm.all_reduce(tensor)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env-file", type=Path, required=True)
    parser.add_argument("--interface", default="", help="the interface holding the cluster address")
    parser.add_argument("--bytes", type=int, default=8 << 20)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout-s", type=int, default=60)
    args = parser.parse_args(argv)
    os.environ.update(socket_env(args.env_file, args.interface))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        world = dist.get_world_size()
        check = torch.full((1,), float(dist.get_rank() + 1), device=device)
        comm.all_reduce(check)
        ok = int(check.item()) == world * (world + 1) // 2  # every rank's value arrived, once
        small = torch.ones(1, device=device)
        _timed(small, 3, cuda)  # warm-up: connections, NCCL rings
        latency = statistics.median(_timed(small, 20, cuda))
        big = torch.ones(max(1, args.bytes // 4), dtype=torch.float32, device=device)
        _timed(big, 1, cuda)
        seconds = statistics.median(_timed(big, args.iters, cuda))
        algbw, busbw = bus_bandwidth(big.numel() * 4, seconds, world)
        result = {
            "host": os.environ.get("UGRO_HOST", os.uname().nodename),
            "rank": dist.get_rank(),
            "world": world,
            "backend": backend,
            "ifname": os.environ.get("NCCL_SOCKET_IFNAME" if cuda else "GLOO_SOCKET_IFNAME", ""),
            "latency_s": latency,
            "bytes": big.numel() * 4,
            "seconds": seconds,
            "algbw_Bps": algbw,
            "busbw_Bps": busbw,
            "sum_ok": ok,
        }
        print(f"{MARK} {json.dumps(result)}", flush=True)
        dist.barrier()  # leave together: the main host's store must outlive every rank's last call
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
