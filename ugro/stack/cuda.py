"""The GPU stack ugro runs, as one table in code: the driver a CUDA runtime needs, the cards torch's CUDA
build has kernels for, and the training backend a host really runs with what it has.

Three places read it: `make provision` refuses a driver pin older than the lock's CUDA runtime needs
(roles/nvidia_driver runs ``python -m ugro.stack.cuda check-driver`` on the controller before any host
changes), preflight judges every GPU host's real driver and compute capability (ugro/checks/preflight_stack.py),
and `make validate` / `make preflight` say which backend each host runs. docs/stack.md has the sources.

Rules, from NVIDIA's and PyTorch's own documents:

- A CUDA runtime needs at least the driver of its toolkit's GA release (CUDA toolkit release notes,
  "CUDA Toolkit and Corresponding Driver Versions": 13.0 GA -> 580.65.06); CUDA minor version
  compatibility then lets every 13.x run on that R580 driver (docs.nvidia.com/deploy/cuda-compatibility:
  13.x needs >= 580). Forward compatibility (an older driver with the cuda-compat package) is for
  data-center GPUs only, never GeForce cards: ugro does not count on it.
- A cubin built for compute capability X.y runs on X.z for every z >= y (same major); PTX for X.y is
  compiled at load time for any card of capability >= X.y. torch 2.13's CUDA 13.0 wheels for Linux
  x86-64 carry cubins for sm_75/80/86/90/100/120 and no PTX: torch/cuda/__init__.py lists
  {75, 80, 86, 90, 100, 120} for 13.0 x86_64 (PYTORCH_RELEASES_CODE_CC), and the registry's wheel was
  built with ``-gencode arch=compute_XX,code=sm_XX`` for exactly those, no ``code=compute_XX``
  (torch._C._cuda_getArchFlags() and the flags in libtorch_cuda.so, measured). CUDA 13 dropped
  Maxwell, Pascal and Volta (< 7.5): a GTX 1080 (6.1) or a V100 (7.0) has no kernel there.
- unsloth needs CUDA: on a host whose torch sees a usable GPU and which has unsloth installed,
  ``model.backend: auto`` is unsloth; anywhere else transformers + peft (+ bitsandbytes for 4-bit),
  on CPU with gloo where there is no usable GPU (train/model/load.py ``resolve_backend``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from ugro.stack import lockfile as locks

REPO = Path(__file__).resolve().parents[2]
# The driver `make provision` installs: role nvidia_driver's default (an inventory may set another).
DRIVER_DEFAULTS = REPO / "roles" / "nvidia_driver" / "defaults" / "main.yml"
# The node lock of every Python a node may run: they pin the same torch and the same CUDA runtime.
LOCK_FILE = "node.txt"

# CUDA runtime (major.minor) -> the oldest Linux x86-64 driver that runs it: the driver of that
# toolkit's GA release (CUDA toolkit release notes, Table 3). Only what NVIDIA's table says.
MIN_DRIVER: dict[str, str] = {
    "13.0": "580.65.06",
}
# The runtime's wheel in a lock (the CUDA 13 wheels dropped the -cuXX suffix).
RUNTIME_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12")


@dataclass(frozen=True)
class TorchBuild:
    """The GPU code in torch's wheels for one CUDA runtime: cubins (SASS) and PTX, by compute capability."""

    cuda: str
    sass: tuple[str, ...]
    ptx: tuple[str, ...]

    def arch_list(self) -> str:
        """As torch.cuda.get_arch_list() prints it: sm_75 ... sm_120 (and compute_XX for PTX)."""
        return " ".join(
            [f"sm_{cc.replace('.', '')}" for cc in self.sass] + [f"compute_{cc.replace('.', '')}" for cc in self.ptx]
        )


# torch's CUDA build (by its CUDA runtime) -> what its Linux x86-64 wheels were compiled for.
TORCH_BUILDS: dict[str, TorchBuild] = {
    "13.0": TorchBuild("13.0", sass=("7.5", "8.0", "8.6", "9.0", "10.0", "12.0"), ptx=()),
}

Support = Literal["native", "ptx", "none"]
BackendName = Literal["unsloth", "hf"]
# Why a host cannot run its backend: no GPU for unsloth, a driver too old for torch's CUDA, a card torch
# has no kernel for, or unsloth asked for and not installed.
Problem = Literal["no gpu", "driver", "arch", "no unsloth"]


class StackError(ValueError):
    """A version the table cannot judge (not a version, or a CUDA runtime it does not list), or a bad lock."""


def version_key(version: str) -> tuple[int, ...]:
    """'580.65.06' -> (580, 65, 6): driver and CUDA versions compare by their numbers, not as strings."""
    parts = str(version).strip().split(".")
    if not all(p.isdigit() for p in parts):
        raise StackError(f"'{version}' is not a version of dot-separated numbers (such as 580.173.02)")
    return tuple(int(p) for p in parts)


def cc_key(cc: str) -> tuple[int, int]:
    """'8.9' -> (8, 9): a compute capability as nvidia-smi --query-gpu=compute_cap prints it."""
    match = re.fullmatch(r"(\d+)\.(\d+)", str(cc).strip())
    if not match:
        raise StackError(f"'{cc}' is not a compute capability such as 8.6")
    return int(match[1]), int(match[2])


def major_minor(version: str) -> str:
    """'13.0.96' -> '13.0'."""
    parts = str(version).split(".")
    if len(parts) < 2:
        raise StackError(f"'{version}' has no minor version")
    return ".".join(parts[:2])


def min_driver(cuda: str) -> str:
    """The oldest driver that runs CUDA runtime ``cuda`` (major.minor)."""
    try:
        return MIN_DRIVER[major_minor(cuda)]
    except KeyError:
        known = ", ".join(sorted(MIN_DRIVER))
        raise StackError(
            f"CUDA {cuda} is not in ugro/stack/cuda.py's driver table (it knows {known}): add its minimum driver "
            "from NVIDIA's CUDA toolkit release notes"
        ) from None


def driver_ok(driver: str, cuda: str) -> bool:
    """Whether ``driver`` runs CUDA runtime ``cuda``: at least the table's minimum, compared numerically."""
    return version_key(driver) >= version_key(min_driver(cuda))


def _at_least(driver: str | None, floor: str) -> bool:
    """Whether a driver as nvidia-smi reported it is at least ``floor``; an unreadable one is not."""
    try:
        return driver is not None and version_key(driver) >= version_key(floor)
    except StackError:
        return False


def torch_build(cuda: str) -> TorchBuild:
    try:
        return TORCH_BUILDS[major_minor(cuda)]
    except KeyError:
        raise StackError(
            f"torch's CUDA {cuda} build is not in ugro/stack/cuda.py's architecture table: add its arch list "
            "(torch.cuda.get_arch_list() on that build)"
        ) from None


def support(cc: str, cuda: str) -> Support:
    """How torch's CUDA ``cuda`` build runs on a card of compute capability ``cc``.

    native: a cubin of the same major and a minor no higher; ptx: compiled at load time from PTX of a
    capability no higher (slow first start); none: no kernel for this card.
    """
    build, (major, minor) = torch_build(cuda), cc_key(cc)
    if any(m == major and n <= minor for m, n in map(cc_key, build.sass)):
        return "native"
    if any((m, n) <= (major, minor) for m, n in map(cc_key, build.ptx)):
        return "ptx"
    return "none"


def runs_natively(cc: str, cuda: str) -> bool:
    return support(cc, cuda) == "native"


def cubin_for(cc: str, cuda: str) -> str | None:
    """The cubin a card runs: sm_86 for an RTX 4070 (8.9) in torch's CUDA 13.0 build; None without one."""
    major, minor = cc_key(cc)
    fitting = [(m, n) for m, n in map(cc_key, torch_build(cuda).sass) if m == major and n <= minor]
    return f"sm_{max(fitting)[0]}{max(fitting)[1]}" if fitting else None


@dataclass(frozen=True)
class Backend:
    """What a host trains with: the library, the device, whether that works, and why in one line."""

    name: BackendName
    device: Literal["cuda", "cpu"]
    why: str
    problem: Problem | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def label(self) -> str:
        return f"{self.name} ({'CUDA, nccl' if self.device == 'cuda' else 'CPU, gloo'})"


def backend(
    ccs: Sequence[str | None],
    driver: str | None,
    cuda: str,
    unsloth_installed: bool,
    requested: str = "auto",
) -> Backend:
    """The backend a host really runs (train/model/load.py ``resolve_backend``), from its GPUs' compute
    capabilities (empty: no GPU; None: not reported), its driver, torch's CUDA runtime and the job's
    ``model.backend`` (auto, unsloth or hf)."""
    if not ccs:
        if requested == "unsloth":
            return Backend("hf", "cpu", "model.backend 'unsloth' needs CUDA, and this host has no NVIDIA GPU", "no gpu")
        return Backend("hf", "cpu", "no NVIDIA GPU: transformers + peft on CPU")
    floor = min_driver(cuda)  # an unknown CUDA runtime is an error, not a verdict
    if not _at_least(driver, floor):
        have = f"driver {driver}" if driver else "no driver"
        return Backend(
            "hf",
            "cpu",
            f"{have} is older than CUDA {cuda} needs (>= {floor}): torch sees no GPU and would train on CPU",
            "driver",
        )
    wanted: BackendName = "hf" if requested == "hf" or (requested == "auto" and not unsloth_installed) else "unsloth"
    dead = [cc for cc in ccs if cc is not None and support(cc, cuda) == "none"]
    if dead:
        return Backend(
            wanted,
            "cuda",
            f"torch's CUDA {cuda} build has no kernel for compute capability {', '.join(dead)} "
            f"(built for {torch_build(cuda).arch_list()})",
            "arch",
        )
    if requested == "unsloth" and not unsloth_installed:
        return Backend("unsloth", "cuda", "model.backend 'unsloth' but unsloth is not installed there", "no unsloth")
    if wanted == "unsloth":
        return Backend("unsloth", "cuda", "unsloth on CUDA")
    why = "model.backend 'hf'" if requested == "hf" else "unsloth is not installed"
    return Backend("hf", "cuda", f"transformers + peft on CUDA ({why})")


def policy(requested: str, cuda: str) -> str:
    """In one sentence, which backend a job with ``model.backend: requested`` runs where (``make validate``)."""
    build = torch_build(cuda)
    usable = (
        f"a GPU the driver runs (>= {min_driver(cuda)} for CUDA {cuda}) and torch's build has kernels for "
        f"(discrete cards from compute capability {build.sass[0]} on: {build.arch_list()})"
    )
    if requested == "hf":
        return f"model.backend 'hf': transformers + peft on every host, on CUDA where it has {usable}, else on CPU"
    if requested == "unsloth":
        return f"model.backend 'unsloth': every host needs unsloth and {usable}; preflight refuses any other host"
    return (
        f"model.backend 'auto': unsloth on a host with unsloth installed and {usable}; transformers + peft (hf) "
        "elsewhere, on CPU with gloo where there is no usable GPU (make preflight names each host's)"
    )


# ------------------------------------------------------------------------------------------------ locks


def _lock_files(lock: Path) -> list[Path]:
    """A lock file, or every py3.X/node.txt under a locks directory (requirements/locks)."""
    if lock.is_dir():
        found = sorted(lock.glob(f"py*/{LOCK_FILE}"))
        if not found:
            raise StackError(f"{lock}: no py3.X/{LOCK_FILE} under it (make lock writes them)")
        return found
    if not lock.is_file():
        raise StackError(f"{lock}: no such lock file (make lock writes requirements/locks/py3.X/{LOCK_FILE})")
    return [lock]


def lock_pins(lock: Path) -> dict[str, str]:
    """canonical name -> version of a lock file, or of every node lock under a directory (which must agree)."""
    merged: dict[str, str] = {}
    where: dict[str, Path] = {}
    for path in _lock_files(lock):
        for name, pin in locks.read(path).items():
            if name in merged and merged[name] != pin.version and name in ("torch", *RUNTIME_WHEELS):
                raise StackError(f"{name} {merged[name]} in {where[name]} but {pin.version} in {path}: run make lock")
            merged.setdefault(name, pin.version)
            where.setdefault(name, path)
    return merged


def _runtime_pin(pins: dict[str, str], lock: Path) -> str:
    """The version of the CUDA runtime wheel among a lock's pins (13.0.96)."""
    for name in RUNTIME_WHEELS:
        if name in pins:
            return pins[name]
    raise StackError(
        f"{lock}: no {RUNTIME_WHEELS[0]} pin, so no CUDA runtime to check a driver against (a CPU-only torch lock?)"
    )


def lock_cuda_runtime(lock: Path) -> str:
    """The CUDA runtime (major.minor) torch runs with on the nodes: the lock's nvidia-cuda-runtime wheel."""
    return major_minor(_runtime_pin(lock_pins(lock), lock))


def pinned_driver() -> str:
    """The driver role nvidia_driver installs unless an inventory says otherwise."""
    return str(yaml.safe_load(DRIVER_DEFAULTS.read_text())["nvidia_driver_version"])


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str


def check_driver(driver: str, lock: Path) -> Verdict:
    """Whether driver ``driver`` runs the CUDA runtime of ``lock``; the message names both versions and the fix."""
    pins = lock_pins(lock)
    runtime = _runtime_pin(pins, lock)
    cuda = major_minor(runtime)
    lock = lock.resolve()
    shown = lock.relative_to(REPO) if lock.is_relative_to(REPO) else lock
    floor = min_driver(cuda)
    torch = pins.get("torch", "?")
    if driver_ok(driver, cuda):
        return Verdict(True, f"driver {driver} runs CUDA {cuda} (torch {torch}, cudart {runtime}; needs >= {floor})")
    suggestion = pinned_driver()
    if not driver_ok(suggestion, cuda):  # the role's own default is too old: say what the table wants
        suggestion = floor
    return Verdict(
        False,
        f"nvidia_driver_version {driver} is older than the {floor} that CUDA {cuda} needs: the Python lock ({shown}) "
        f"installs torch {torch} with the CUDA runtime {runtime} (nvidia-cuda-runtime), which this driver cannot "
        f'run (torch would see no GPU). Fix: set nvidia_driver_version: "{suggestion}" (an R{floor.split(".")[0]} '
        "release, the same on every node) in your inventory's group vars, or remove your override to get the "
        "role's default.",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ugro.stack.cuda", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-driver", help="exit 1, naming both versions, when DRIVER cannot run the lock's CUDA")
    check.add_argument("--driver", required=True, help="an upstream driver version such as 580.173.02")
    check.add_argument("--lock", type=Path, default=locks.LOCKS, help="a node lock, or the locks directory (default)")
    args = parser.parse_args(argv)
    try:
        verdict = check_driver(args.driver, args.lock)
    except StackError as exc:
        print(f"ugro.stack.cuda: {exc}", file=sys.stderr)
        return 2
    print(verdict.message)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
