"""On CPU, fail where NCCL would: a rank run with ``UGRO_CHECK_DEVICES=1`` refuses a host tensor in a collective.

On GPUs the default group is NCCL, which carries CUDA tensors only; on CPU every test runs gloo, where every
tensor is a CPU tensor and a collective given one made on the host (``torch.tensor(x)`` without ``device=``,
``.cpu()``, ``.item()`` turned back into a tensor) works. The checker makes that mistake visible on CPU:

- the rank's device becomes ``cpu:0`` (``train.dist.distributed.init``): it computes as the CPU does, but a tensor
  created with ``device=info.device`` can be told apart from one created on the host, and ``t.device`` of a
  tensor on the rank's device answers ``cpu:0`` as a GPU host answers ``cuda:N``;
- a torch-function mode follows where each tensor would live on a GPU host: ``host`` when a factory ran without
  ``device=`` or with the plain CPU, after ``.cpu()`` or ``.to("cpu")``; ``rank`` when made on or moved to the
  rank's device; an operation's result lives where its inputs do (any on the rank's device: there). Tensors that
  no Python call made (gradients from autograd) carry no mark and pass;
- the default group stands for NCCL: ``train.dist.comm`` (and every ``torch.distributed`` collective and
  point-to-point call, patched here for code that goes around it) refuses a host tensor on it, and a rank tensor
  on the gloo control group, naming the call and the line that made the call.

It costs every torch call a Python hop; tests turn it on for the runs that exercise collectives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "UGRO_CHECK_DEVICES"
LOG_ENV = "UGRO_CHECK_DEVICES_LOG"  # a file: every refusal is appended to it and the call goes on (a survey)
RANK_DEVICE = torch.device("cpu", 0)  # stands for the rank's CUDA device
HOST, RANK = "host", "rank"
_MARK = "_ugro_lives_on"
_DEVICE_PROPERTY = torch._C.TensorBase.__dict__["device"]
_OURS = (Path(__file__), Path(__file__).with_name("comm.py"))  # not the caller a refusal names

# Every tensor-carrying collective and point-to-point call of torch.distributed; and the object collectives, whose
# only device is the one they are told to use (by default the one torch picks for the group's backend).
TENSOR_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
                "gather", "scatter")  # fmt: skip
OBJECT_CALLS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
CHECKED = TENSOR_CALLS + OBJECT_CALLS
# The arguments that carry tensors, by keyword (positionally: the first two).
TENSOR_KEYWORDS = ("tensor", "tensor_list", "output_tensor_list", "input_tensor_list", "output_tensor", "input_tensor",
                   "output", "input", "gather_list", "scatter_list")  # fmt: skip


class WrongDevice(RuntimeError):
    """A collective was handed a tensor its backend cannot carry (NCCL: a CPU tensor)."""


def requested() -> bool:
    return os.environ.get(ENV, "") == "1"


def lives_on(tensor: torch.Tensor) -> str | None:
    """Where ``tensor`` would live on a GPU host: ``host``, ``rank``, or None when no Python call made it."""
    return getattr(tensor, _MARK, None)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _named_device(value: Any) -> str | None:
    """``host`` or ``rank`` for a device argument (a device, a string, an int index), None when it is not one."""
    if isinstance(value, torch.device | str):
        try:
            device = torch.device(value)
        except RuntimeError:
            return None  # a string that is not a device (a dtype-less .to("...") never passes one)
        return RANK if device == RANK_DEVICE or device.type != "cpu" else HOST
    return None


def _explicit(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Where the call explicitly puts its result, if it does."""
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return HOST
    if "device" in kwargs and kwargs["device"] is not None:
        return _named_device(kwargs["device"])
    if name == "to":
        for arg in args[1:]:
            named = _named_device(arg)
            if named is not None:
                return named
            if isinstance(arg, torch.Tensor):  # .to(other): where other lives
                return lives_on(arg)
    return None


class _Follow(TorchFunctionMode):
    """Marks each tensor a torch call returns with where it would live on a GPU host."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_PROPERTY and lives_on(args[0]) == RANK:
            return RANK_DEVICE  # t.device of a tensor on the rank's device: what a GPU host would answer (cuda:N)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__set__" and len(args) == 2 and isinstance(args[1], torch.Tensor):  # param.data = moved
            _mark(args[0], lives_on(args[1]))
            return out
        where = _explicit(func, args, kwargs)
        if args and out is args[0]:
            if where is None or where == lives_on(out):
                return out  # in place: a tensor never moves by being written to
            out = out.clone()  # .cpu() of a CPU tensor is itself; on a GPU host it is a copy elsewhere
        if where is None:
            inputs = [lives_on(t) for t in _tensors((args, kwargs))]
            if RANK in inputs:
                where = RANK
            elif HOST in inputs or not inputs:
                where = HOST  # a factory without device= makes a CPU tensor on a GPU host too
        for tensor in _tensors(out):
            _mark(tensor, where)
        return out


def _mark(tensor: Any, where: str | None) -> None:
    if where is not None and isinstance(tensor, torch.Tensor):
        with contextlib.suppress(AttributeError, RuntimeError):  # a tensor that takes no attributes stays unmarked
            setattr(tensor, _MARK, where)


def caller() -> str:
    """The first frame outside torch and this module: the line that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and Path(frame.filename) not in _OURS:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "unknown caller"


def carries(group: Any) -> str:
    """``rank`` for the default group and the groups made beside it without a backend (NCCL on GPUs), ``host`` for
    a gloo group made for control traffic (``train.dist.comm.control_group``)."""
    from train.dist import comm  # comm refuses through this module: imported when a check runs

    return HOST if group is not None and group in comm.control_groups() else RANK


def check(call: str, tensors: Any, group: Any) -> None:
    """Refuse a tensor the group's backend would not carry on a GPU host."""
    wanted = carries(group)
    for tensor in _tensors(tensors):
        _judge(call, lives_on(tensor), wanted)


def _judge(call: str, where: str | None, wanted: str) -> None:
    """Refuse what lives ``where`` (``host``, ``rank``; None: unknown, passes) given to a group that carries
    ``wanted``: raised, or with ``UGRO_CHECK_DEVICES_LOG`` appended to that file (the call goes on)."""
    if where is None or where == wanted:
        return
    made = "on the host (CPU)" if where == HOST else "on the rank's device"
    backend = "NCCL carries CUDA tensors only" if wanted == RANK else "the gloo control group carries CPU"
    refusal = WrongDevice(
        f"{call} at {caller()} was given a tensor made {made}: on a GPU host this fails ({backend}). "
        "Make it with train.dist.comm (comm.tensor / comm.zeros) or on the rank's device."
    )
    log = os.environ.get(LOG_ENV)
    if not log:
        raise refusal
    with open(log, "a") as out:  # a survey: every refusal of a run, which goes on
        out.write(f"{refusal}\n")


def _checked(call: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if call.endswith(("_object", "_object_list")):  # Python objects: only an explicit device can be wrong
            where = _named_device(kwargs["device"]) if kwargs.get("device") is not None else None
            _judge(f"torch.distributed.{call}", where, carries(kwargs.get("group")))
            return original(*args, **kwargs)
        tensors = [a for a in args[:3] if isinstance(a, torch.Tensor | list)]  # gather/scatter: (tensor, list, ...)
        tensors += [kwargs[k] for k in TENSOR_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor | list)]
        check(f"torch.distributed.{call}", tensors, kwargs.get("group"))
        return original(*args, **kwargs)

    return wrapper


MODE = "ugro_device_mode"  # the attribute of the checked torch.distributed calls that holds the checker's mode


def _mode() -> _Follow | None:
    """The checker's torch-function mode, kept on the calls it wraps in torch.distributed (the process's, as the
    wrapping is): None where it is not installed."""
    return getattr(dist.all_reduce, MODE, None)


def install() -> bool:
    """Turn the checker on in this process when ``UGRO_CHECK_DEVICES=1``; whether it is on."""
    if _mode() is not None:
        return True
    if not requested() or "MASTER_ADDR" not in os.environ:  # only a rank of a distributed run
        return False
    mode = _Follow()
    mode.__enter__()
    for call in CHECKED:
        checked = _checked(call, getattr(dist, call))
        setattr(checked, MODE, mode)
        setattr(dist, call, checked)
    return True


def installed() -> bool:
    return _mode() is not None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Torch calls in here are not followed: transformers' loading marks and re-initialises tensors itself, and
    under a torch-function mode it left the rotary tables uninitialised. What it loads is moved to the rank's
    device afterwards (train/model/load.py), which marks it."""
    mode = _mode()
    if mode is None:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()
