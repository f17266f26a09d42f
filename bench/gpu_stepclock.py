"""`python -m bench.gpu_stepclock [--steps 20]`: on a CUDA machine, does the step clock report the GPU's compute time?

A rank's compute time (train/balance/step.py ``StepClock``) feeds the balancer. On CUDA kernels run asynchronously, so
host timestamps only say when the work was queued; the clock records CUDA events instead (``StepClock.for_device``) and
reads them at the next step. This runs a small model (an MLP stack between an embedding and a vocabulary head, torch
only) through the trainer's own ``train.balance.step.backward`` for ``--steps`` steps of ``--micro-batches``
micro-batches, twice: ``ddp`` (one-rank NCCL DDP with the trainer's communication hook, so the last lap comes from
autograd's thread, as in training) and ``plain`` (every lap from the main thread). Per step it prints the clock's device
compute time, the host-lap compute time (the clock's host timestamps) and the wall step time (synchronized before and
after), with their ratios; the last line is a JSON summary (medians, the first step of each mode left out as warm-up).
Expected: device/wall near 1 (the rest is the step's own host sync and bookkeeping), host/wall below it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.balance.step import StepClock, backward
from train.dist.distributed import _HookState, _timed_allreduce
from train.dist.health import GroupHealth


class Stack(nn.Module):
    """Embedding, residual MLP blocks, vocabulary head: called like a causal LM (``.logits``), as backward() does."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return SimpleNamespace(logits=self.head(x))


def run(mode: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model: nn.Module = Stack(args.vocab, args.hidden, args.layers).to(device)
    clock = StepClock.for_device(device)
    if mode == "ddp":
        model = DistributedDataParallel(model, device_ids=[device.index])
        model.register_comm_hook(_HookState(clock, compress=False, health=GroupHealth()), _timed_allreduce)
    shape = (args.batch, args.seq)
    micro_batches = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, args.vocab, shape, device=device)
        micro_batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    rows = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        backward(model, micro_batches, device, clock)  # ends with loss.item(), a host sync, as in training
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        device_s, host_s = clock.last_compute_s, clock.last_host_s  # in training: at the next step's exchange()
        row = {"step": step, "device_s": device_s, "host_s": host_s, "wall_s": wall}
        rows.append(row | {"device/wall": device_s / wall, "host/wall": host_s / wall})
        print(
            f"{mode:5} step {step:3d}  device {device_s:.4f} s  host {host_s:.4f} s  wall {wall:.4f} s  "
            f"device/wall {device_s / wall:.3f}  host/wall {host_s / wall:.3f}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_stepclock", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--modes", nargs="+", choices=("ddp", "plain"), default=["ddp", "plain"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_stepclock: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = Path(tempfile.mkdtemp(prefix="ugro-stepclock-")) / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
    try:
        summary: dict[str, object] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
        for mode in args.modes:
            rows = run(mode, args, device)[1:]  # the first step warms up (allocations, kernel choice)
            for key in ("device_s", "host_s", "wall_s", "device/wall", "host/wall"):
                summary[f"{mode} {key}"] = round(statistics.median(r[key] for r in rows), 4)
        print(json.dumps(summary))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
