"""The device checker fails a CPU run where NCCL would fail a GPU run, and lets through what NCCL carries."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import REPO

from train.dist import comm, devicecheck, distributed
from train.dist.health import GroupHealth


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except devicecheck.WrongDevice as exc:
        return str(exc)
    raise AssertionError("the checker let a tensor through that NCCL would refuse")


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    info, _ = distributed.init(timeout_s=60)
    assert devicecheck.installed() and info.device == devicecheck.RANK_DEVICE
    device = info.device
    made_on_host = _refused(lambda: dist.all_reduce(torch.tensor([1.0])))
    refusals = [
        made_on_host,
        _refused(lambda: dist.all_reduce(torch.ones(2, device=device).sum().cpu())),  # moved off the device
        _refused(lambda: dist.all_reduce(torch.tensor([torch.ones(2, device=device).sum().item()]))),
        _refused(lambda: dist.all_gather([torch.zeros(2, device=device)] * 2, torch.zeros(2))),
        _refused(lambda: dist.broadcast(torch.zeros(3, device="cpu"), src=0)),
        _refused(lambda: dist.gather(torch.zeros(2, device=device), [torch.zeros(2)] * 2)),  # the gather_list
        _refused(lambda: dist.broadcast_object_list([rank], src=0, device=torch.device("cpu"))),
        # the gloo control group beside NCCL carries CPU tensors only
        _refused(lambda: dist.all_reduce(torch.zeros(1, device=device), group=comm.control_group())),
    ]
    # What NCCL carries passes: made on the device, moved there, computed from it, a model's outputs.
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)
    moved = torch.tensor([1.0]).to(device) * 2
    dist.all_reduce(moved)
    linear = torch.nn.Linear(3, 2).to(device)
    dist.broadcast(linear(torch.ones(1, 3).to(device)).detach(), src=0)
    gathered = GroupHealth().gather_objects({"rank": rank}, comm.control_group())  # CPU tensors on gloo: right
    assert float(total) == 1.0 and float(moved) == 4.0 and [g["rank"] for g in gathered] == [0, 1]
    if rank == 0:
        Path(out).write_text("\n".join(refusals))
    distributed.wait_for_all("both ranks checked", 30)
    distributed.shutdown()


def test_a_collective_given_a_host_tensor_fails_on_cpu_naming_the_line(
    tmp_path: Path, spawn: Callable[..., None]
) -> None:
    out = tmp_path / "refusals.txt"
    spawn(_rank, 2, str(out))
    refusals = out.read_text().splitlines()
    assert len(refusals) == 8
    assert all("on a GPU host this fails" in r and "test_devicecheck.py:" in r for r in refusals)
    assert "made on the host (CPU)" in refusals[0] and "NCCL carries CUDA tensors only" in refusals[0]
    assert "gloo control group carries CPU" in refusals[-1]


def test_the_checker_stays_off_outside_a_distributed_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert not devicecheck.install() and not devicecheck.installed()


def test_train_makes_every_tensor_collective_through_comm() -> None:
    """The one place that decides a collective's device (train/dist/comm.py) is the only caller of torch's: a new
    collective elsewhere in train/ fails here before it fails on a GPU cluster."""
    around = []
    for path in sorted((REPO / "train").rglob("*.py")):
        if path.name in ("comm.py", "devicecheck.py", "nccl_like.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in (*devicecheck.TENSOR_CALLS, "batch_isend_irecv", "P2POp")
                and getattr(node.value, "id", "") == "dist"
            ):
                around.append(f"{path.relative_to(REPO)}:{node.lineno} dist.{node.attr}")
    assert not around, f"collectives that go around train/dist/comm.py: {around}"


def test_train_reads_collective_results_only_through_comm() -> None:
    """A collective's result is read in one way (train/dist/comm.py ``result``/``then``: after the work's wait). A
    future made by hand without its devices orders nothing on CUDA, and a work's future handed on elsewhere is
    complete on NCCL before the result is there."""
    found = []
    for path in sorted((REPO / "train").rglob("*.py")):
        if path.name in ("comm.py", "nccl_like.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "get_future":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} .get_future")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "Future"
                and not any(k.arg == "devices" for k in node.keywords)
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} a Future without its devices")
    assert not found, f"results read around train/dist/comm.py: {found}"
