"""`make bench-ddp-init`: what DDP sends at start-up, with and without the frozen base, on the test cluster.

Plain ``DistributedDataParallel(model)`` broadcasts every parameter and buffer from rank 0 when it
is built, the frozen base included, although every rank loaded the same base from disk. ugro's
``train.dist.distributed.wrap`` builds DDP with ``init_sync=False`` and broadcasts only the trainable
(LoRA) parameters, once. This command brings up the 3-host test cluster (network namespaces, real
SSH, gloo over veth; needs root), builds the same seeded random Llama + LoRA on every host, and
times both constructions. The bytes are measured, not computed: each host reads its cluster
interface's counters (its own network namespace: nothing else talks on it) around each
construction. Before ugro's, every rank shifts its LoRA weights by its rank, and afterwards the
ranks compare checksums: they must start equal. Sizes default to a ~100M-parameter base so the
difference is visible on a CPU.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import psutil
import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from testbed import cluster as testbed_cluster
from train.dist import distributed

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.11.0/24"  # its own subnet: runs beside `make test` and `make testbed-up`
console = Console(soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


def _model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(LlamaForCausalLM(config), lora)


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _interface_bytes(ifname: str) -> tuple[int, int]:
    """(sent, received) so far on this host's cluster interface."""
    counters = psutil.net_io_counters(pernic=True).get(ifname)
    if counters is None:
        raise RuntimeError(f"no interface {ifname!r} here (GLOO_SOCKET_IFNAME)")
    return counters.bytes_sent, counters.bytes_recv


def _timed(build: Any, ifname: str) -> dict[str, float]:
    """Seconds to build, and the bytes this host sent and received meanwhile (barriers included)."""
    dist.barrier()
    sent, received = _interface_bytes(ifname)
    started = time.perf_counter()
    ddp = build()
    dist.barrier()
    elapsed = time.perf_counter() - started
    sent_after, received_after = _interface_bytes(ifname)
    del ddp
    gc.collect()
    return {"s": elapsed, "sent": sent_after - sent, "received": received_after - received}


def _checksum(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@app.command("rank", hidden=True)
def rank(hidden: int = 1024, layers: int = 8, vocab: int = 32000) -> None:
    """Runs on every host under torchrun; rank 0 prints the figures as JSON."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    info, _ = distributed.init(timeout_s=300)
    model = _model(hidden, layers, vocab)
    everything = [*model.parameters(), *model.buffers()]
    trainable = [p for p in model.parameters() if p.requires_grad]
    plain = _timed(lambda: DistributedDataParallel(model), ifname)
    with torch.no_grad():  # every rank's own LoRA weights: the broadcast must make them rank 0's
        for param in trainable:
            param.add_(info.rank)
    ugro = _timed(lambda: distributed.wrap(model, info), ifname)
    mine = {"rank": info.rank, "plain": plain, "ugro": ugro, "trainable": _checksum(trainable)}
    everyone: list[dict[str, Any] | None] = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    if info.rank == 0:
        ranks = sorted((e for e in everyone if e is not None), key=lambda e: int(e["rank"]))
        figures: dict[str, Any] = {
            "world_size": info.world_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "plain_payload_bytes": _bytes(everything),
            "ugro_payload_bytes": _bytes(trainable),
            "trainable_equal_after_ugro": len({e["trainable"] for e in ranks}) == 1,
        }
        for key in ("plain", "ugro"):
            figures[f"{key}_s"] = max(e[key]["s"] for e in ranks)
            figures[f"{key}_bytes"] = sum(e[key]["sent"] for e in ranks)  # on the wire, every host's
            figures[f"{key}_received"] = [e[key]["received"] for e in ranks]  # by rank
        print("DDPINIT " + json.dumps(figures), flush=True)
    # Leave together: a rank that tore its group down while rank 0 was still at work once aborted in gloo
    # ("terminate called without an active exception"), as train/worker.py's ranks did before their barrier.
    dist.barrier()
    distributed.shutdown()


def measure_on_testbed(bed: Any, hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """torchrun on every test host over SSH (c10d rendezvous on the first); rank 0's figures."""
    main = bed.hosts[0]
    port = 29511

    def launch(host: Any) -> subprocess.CompletedProcess[str]:
        remote = (
            f"cd {shlex.quote(str(REPO))} && GLOO_SOCKET_IFNAME={host.interface} OMP_NUM_THREADS=1 "
            f"HF_HUB_OFFLINE=1 {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes={len(bed.hosts)} "
            f"--nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint={main.address}:{port} "
            f"--local-addr={host.address} --max-restarts=0 -m bench.ddp_init rank "
            f"--hidden {hidden} --layers {layers} --vocab {vocab}"
        )
        return subprocess.run(
            ["ssh", "-F", str(bed.ssh_config), host.name, remote], capture_output=True, text=True, timeout=600
        )

    with ThreadPoolExecutor(len(bed.hosts)) as pool:
        results = list(pool.map(launch, bed.hosts))
    for host, result in zip(bed.hosts, results, strict=True):
        if result.returncode != 0:
            raise RuntimeError(f"{host.name}: exit {result.returncode}\n{(result.stdout + result.stderr)[-2000:]}")
    for result in results:
        for line in result.stdout.splitlines():
            if line.startswith("DDPINIT "):
                return dict(json.loads(line.removeprefix("DDPINIT ")))
    raise RuntimeError("no rank printed its figures")


@app.command("run")
def run(
    hidden: Annotated[int, typer.Option(help="Hidden size of the random base model.")] = 1024,
    layers: Annotated[int, typer.Option(help="Decoder layers of the random base model.")] = 8,
    vocab: Annotated[int, typer.Option(help="Vocabulary size of the random base model.")] = 32000,
    hosts: Annotated[int, typer.Option(help="Test hosts.")] = 3,
) -> None:
    """Bring up the test cluster, measure both DDP constructions, print the table, tear it down."""
    testbed = testbed_cluster
    with tempfile.TemporaryDirectory(prefix="ugro-ddpinit-") as tmp:
        try:
            # The ranks' default group completes, orders and fails as NCCL does (train/dist/nccl_like.py), as in
            # every test: the start-up's broadcasts are read as NCCL hands them over.
            bed = testbed.up(Path(tmp), hosts=hosts, subnet=SUBNET, session_env={"UGRO_NCCL_LIKE": "1"})
        except testbed.TestbedError as exc:
            console.print(f"[red]bench-ddp-init: no test cluster: {exc}[/red]")
            raise typer.Exit(2) from None
        try:
            with console.status(f"DDP start-up on {hosts} test hosts, base {hidden}x{layers}, vocab {vocab}"):
                figures = measure_on_testbed(bed, hidden, layers, vocab)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            console.print(f"[red]bench-ddp-init failed: {exc}[/red]")
            raise typer.Exit(1) from None
        finally:
            testbed.down(Path(tmp))
    params = figures["parameters"]
    table = Table(title=f"DDP start-up broadcast, {hosts} test hosts (gloo over veth), {params:,} parameters")
    for column in ("construction", "payload", "sent by all hosts", "time", "projected at 1 Gb/s"):
        table.add_column(column, justify="right" if column != "construction" else "left")
    rows = (("plain DistributedDataParallel(model)", "plain"), ("ugro wrap (init_sync=False + LoRA broadcast)", "ugro"))
    for name, key in rows:
        size, payload = figures[f"{key}_bytes"], figures[f"{key}_payload_bytes"]
        table.add_row(
            name,
            f"{payload / 2**20:,.2f} MiB",
            f"{size / 2**20:,.2f} MiB",
            f"{figures[f'{key}_s']:.2f} s",
            f"{payload * 8 / 1e9:.2f} s",
        )
    console.print(table)
    if not figures["trainable_equal_after_ugro"]:
        console.print("[red]bench-ddp-init: the ranks' LoRA weights differ after ugro's wrap[/red]")
        raise typer.Exit(1)
    print(
        f"DDP init: plain {figures['plain_bytes'] / 2**20:.1f} MiB in {figures['plain_s']:.2f} s, "
        f"ugro {figures['ugro_bytes'] / 2**20:.2f} MiB in {figures['ugro_s']:.2f} s"
    )


if __name__ == "__main__":
    app()
