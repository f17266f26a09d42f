"""Collectives and point-to-point calls, and the one rule of which device their tensors live on.

A group's backend decides: NCCL (the default group on GPU hosts, and every group made beside it without a
backend) carries CUDA tensors of the rank's device only; gloo (the default group on CPU, the control group made
beside NCCL for barriers and Python objects) carries CPU tensors. ``carrier(group)`` says which device that is,
``tensor``/``zeros`` make a tensor there, and every call below refuses, with one line naming the caller, a tensor
the group's backend would not carry: NCCL's own error ("No backend type associated with device type cpu") names
neither. Code in ``train/`` makes its collectives here (tests/test_devicecheck.py reads train/ for calls that go
around it); under ``UGRO_CHECK_DEVICES=1`` the same refusal happens on CPU, where NCCL would (train/dist/devicecheck.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from train.dist import devicecheck

_CONTROL: list[dist.ProcessGroup] = []


def _nccl(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_backend(group) == dist.Backend.NCCL


def control_group() -> dist.ProcessGroup | None:
    """The gloo group for monitored barriers and gathers of Python objects: the default group (None) on CPU, a gloo
    group beside NCCL on GPUs (and under the device checker, whose default group stands for NCCL). Every rank
    calls it at the same point the first time (making a group is collective)."""
    if not _nccl(None) and not devicecheck.installed():
        return None
    if not _CONTROL:
        _CONTROL.append(dist.new_group(backend="gloo"))
    return _CONTROL[0]


def control_groups() -> tuple[dist.ProcessGroup, ...]:
    """The control groups made beside the default group (none on CPU)."""
    return tuple(_CONTROL)


def forget_control_group() -> None:
    """The default group was replaced (a regroup): the next ``control_group()`` makes one in the new group."""
    _CONTROL.clear()


def carrier(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group`` (None: the default group) carries."""
    if group is not None and group in _CONTROL:
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


def all_reduce(
    value: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    check("all_reduce", value, group)
    return dist.all_reduce(value, op=op, group=group, async_op=async_op)


def all_gather(
    out: list[torch.Tensor], value: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    check("all_gather", [value, *out], group)
    return dist.all_gather(out, value, group=group, async_op=async_op)


def broadcast(value: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    check("broadcast", value, group)
    dist.broadcast(value, src=src, group=group)


def send(value: torch.Tensor, dst: int) -> None:
    check("send", value, None)
    dist.send(value, dst=dst)


def isend(value: torch.Tensor, dst: int) -> dist.Work | None:
    check("isend", value, None)
    return dist.isend(value, dst=dst)


def recv(buffer: torch.Tensor, src: int) -> None:
    check("recv", buffer, None)
    dist.recv(buffer, src=src)
