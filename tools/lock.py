"""Regenerate the locks (`make lock`): what each kind of host installs, for each Python a node may run.

    requirements/locks/py3.X/node.txt        every node (the trainer): role python_env syncs it everywhere
    requirements/locks/py3.X/gpu.txt         a host with an NVIDIA GPU adds these to node.txt (unsloth)
    requirements/locks/py3.X/controller.txt  the controller's .venv adds these to node.txt (`make venv`:
                                             Ansible, the CLI, the lint and test tools)
    requirements/locks/py3.X/mlflow-server.txt  an MLflow tracking server of its own (`make mlflow-server`, the
                                             tracker tests): never installed beside the others
    requirements/locks/uv.txt                the pinned uv alone (`make venv` bootstraps with it)

One directory per CPython minor that a supported node OS ships (Debian 12: 3.11, Ubuntu 24.04: 3.12,
Debian 13: 3.13), all for Linux x86-64 (manylinux_2_28, binary wheels only), every pin with its hashes.
Files per (Python, role) rather than one universal lock with markers: a host syncs exactly the files
of its Python with no marker to evaluate, a wheelhouse is built from one directory, and a diff shows
which Python's set changed.

Every set is resolved from the registry alone by the uv that node.in pins, with `--no-config` (this
machine's pip configuration, its local wheels and constraints, cannot leak in), as a host of that
platform and Python would. The same package gets the same version everywhere it can: the oldest
Python's sets are resolved first and constrain every other Python's. node.txt is a subset of
node + gpu and of node + controller, same versions, which `check` asserts. A lock keeps the versions it
pins wherever they still resolve (uv's preferences, as pip-compile does): a new requirement adds its packages and
moves no other; `make lock UPGRADE=1` resolves everything anew.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ugro.stack.lockfile import LOCKS, PYTHONS, REQUIREMENTS, Pin, canonical, parse

PLATFORM = "x86_64-manylinux_2_28"
# What each role resolves: node alone, and node with each role's additions.
INPUTS = {
    "node": ("node",),
    "gpu": ("node", "gpu"),
    "controller": ("node", "controller", "dev"),
    "mlflow-server": ("mlflow-server",),
}
# Packages a role's requirement pulls in that the lock leaves out, with why. The hosts' completeness
# check (`uv pip check`) tolerates exactly these missing.
OMITTED = {
    "gpu": {
        "xformers": "the registry's newest xformers (0.0.35) is built for CUDA 12.8 and links libcudart.so.12, "
        "which torch's CUDA 13 stack lacks: it cannot load, and unsloth runs without it",
    }
}
# Packages a role's requirement names that the lock resolves without (uv's --excludes), with why: each is on the
# registry only as a source distribution, which the locks' rule (binary wheels only) refuses, and none is imported by
# what ugro uses of the package that names it. The completeness check tolerates exactly these missing.
EXCLUDED = {
    "controller": {
        "sqlitedict": "lm-eval's cache of model answers (use_cache), which make eval does not use",
        "rouge-score": "lm-eval's ROUGE metric, imported only by tasks that score with it",
        "word2number": "lm-eval's number parsing, imported only by the math tasks that use it",
    }
}
# Never part of node.txt: the nodes run the trainer, not the controller's or the tests' tools.
NOT_ON_NODES = re.compile(r"^(ansible.*|molecule.*|pytest.*|ruff|mypy.*|black|yamllint|types-.*)$")
DESCRIPTION = {
    "node": "every node installs exactly these (role python_env).",
    "gpu": "a host with an NVIDIA GPU installs these on top of node.txt (role python_env).",
    "controller": "the controller's .venv installs these on top of node.txt (make venv).",
    "mlflow-server": "an MLflow tracking server's own venv (make mlflow-server), never beside the others.",
}


class LockError(RuntimeError):
    """A set that does not resolve, or locks that disagree with each other."""


def uv() -> str:
    """The uv that node.in pins, installed beside this Python (make venv), else the one on PATH."""
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        raise LockError("uv not found: `make venv` installs the pinned one into .venv")
    return found


def compile_set(
    inputs: Iterable[Path],
    python: str,
    constraints: dict[str, Pin] | None = None,
    excludes: Iterable[str] = (),
    preferences: dict[str, Pin] | None = None,
) -> dict[str, Pin]:
    """Resolve requirement files from the registry alone, as a Linux x86-64 host of CPython `python` would, without
    the packages `excludes` names and keeping the versions `preferences` pins wherever they resolve."""
    with tempfile.TemporaryDirectory(prefix="ugro-lock-") as tmp:
        out = Path(tmp) / "resolved.txt"  # uv prefers what an existing output file pins
        out.write_text("".join(pin.text + "\n" for pin in (preferences or {}).values()))
        cmd = [uv(), "pip", "compile", "--no-config", "--python-platform", PLATFORM, "--python-version", python,
               "--only-binary", ":all:", "--generate-hashes", "--no-header", "--no-annotate", "--quiet",
               "--output-file", str(out), *map(str, inputs)]  # fmt: skip
        if constraints:
            path = Path(tmp) / "constraints.txt"
            path.write_text("".join(f"{pin.name}=={pin.version}\n" for pin in constraints.values()))
            cmd += ["--constraints", str(path)]
        excluded = sorted(excludes)
        if excluded:
            path = Path(tmp) / "excludes.txt"
            path.write_text("".join(f"{name}\n" for name in excluded))
            cmd += ["--excludes", str(path)]
        # Nor any UV_* / PIP_* setting of this machine's environment (an index, find-links, constraints).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
        if proc.returncode != 0:
            raise LockError(f"{' '.join(cmd)}\n{proc.stderr.strip()}")
        return parse(out.read_text())


def render(role: str, python: str, pins: dict[str, Pin]) -> str:
    lines = [
        f"# Generated by 'make lock' (tools/lock.py) from requirements/{'.in + '.join(INPUTS[role])}.in for CPython "
        f"{python} on Linux x86-64 ({PLATFORM}): {DESCRIPTION[role]}",
        "# Resolved from the registry alone: uv pip compile --no-config --only-binary :all: --generate-hashes.",
    ]
    for name, why in OMITTED.get(role, {}).items():
        lines.append(f"# ugro-omits: {name} ({why})")
    for name, why in EXCLUDED.get(role, {}).items():
        lines.append(f"# ugro-excludes: {name} ({why})")
    lines += [pins[name].text for name in sorted(pins)]
    return "\n".join(lines) + "\n"


def _drop(pins: dict[str, Pin], names: Iterable[str]) -> dict[str, Pin]:
    gone = {canonical(n) for n in names}
    return {n: p for n, p in pins.items() if n not in gone}


def _subset(node: dict[str, Pin], full: dict[str, Pin], role: str, python: str) -> dict[str, Pin]:
    """The pins of `full` beyond node's; node's must all be in `full` at the same version."""
    differ = [f"{n} {p.version} (node) vs {full[n].version if n in full else 'absent'} ({role})"
              for n, p in node.items() if n not in full or full[n].version != p.version]  # fmt: skip
    if differ:
        raise LockError(f"Python {python}: node.txt is not part of node + {role}: {'; '.join(differ)}")
    return {n: p for n, p in full.items() if n not in node}


def locked(python: str, role: str) -> dict[str, Pin]:
    """What the lock files of `role` (on top of node's, but for the MLflow server's) pin today: empty if none."""
    names = [role] if role == "mlflow-server" else ["node", *([role] if role != "node" else [])]
    paths = [LOCKS / f"py{python}" / f"{name}.txt" for name in names]
    return {name: pin for path in paths if path.is_file() for name, pin in parse(path.read_text()).items()}


def resolve_python(
    python: str, references: dict[str, dict[str, Pin]], upgrade: bool = False
) -> dict[str, dict[str, Pin]]:
    """node, gpu (beyond node), controller (beyond node) and the MLflow server (alone) for one Python, each under
    its own reference versions (what the oldest Python resolved for the same host, node included); with `upgrade`
    False each set keeps what its lock pins today wherever that still resolves.

    gpu.txt and controller.txt are never installed together, so neither constrains the other: the controller only
    prefers the GPU set's versions (importlib-metadata: unsloth's diffusers takes 10, mlflow-skinny wants <10)."""

    def req(role: str) -> list[Path]:
        return [REQUIREMENTS / f"{name}.in" for name in INPUTS[role]]

    def prefer(role: str) -> dict[str, Pin]:
        return {} if upgrade else locked(python, role)

    gpu = _drop(compile_set(req("gpu"), python, references["gpu"], preferences=prefer("gpu")), OMITTED["gpu"])
    node = compile_set(req("node"), python, gpu)
    on_nodes = sorted(n for n in node if NOT_ON_NODES.match(n))
    if on_nodes:
        raise LockError(f"Python {python}: node.txt would put {on_nodes} on every node")
    controller = compile_set(req("controller"), python, {**references["controller"], **node},
                             EXCLUDED["controller"], {**gpu, **prefer("controller")})  # fmt: skip
    server = compile_set(req("mlflow-server"), python, references["mlflow-server"], preferences=prefer("mlflow-server"))
    return {
        "node": node,
        "gpu": _subset(node, gpu, "gpu", python),
        "controller": _subset(node, controller, "controller", python),
        "mlflow-server": server,
    }


def generate(upgrade: bool = False) -> dict[Path, str]:
    """Every lock file's text, by path; nothing is written."""
    first, *others = PYTHONS
    gpu = compile_set([REQUIREMENTS / "node.in", REQUIREMENTS / "gpu.in"], first,
                      preferences={} if upgrade else locked(first, "gpu"))  # fmt: skip
    sets = {first: resolve_python(first, {"gpu": _drop(gpu, OMITTED["gpu"]), "controller": {}, "mlflow-server": {}},
                                  upgrade)}  # fmt: skip
    done = sets[first]
    references = {
        "gpu": {**done["node"], **done["gpu"]},
        "controller": {**done["node"], **done["controller"]},
        "mlflow-server": done["mlflow-server"],
    }
    with ThreadPoolExecutor(max_workers=len(others)) as pool:
        resolved = pool.map(lambda py: resolve_python(py, references, upgrade), others)
        sets |= dict(zip(others, resolved, strict=True))
    files = {
        LOCKS / f"py{python}" / f"{role}.txt": render(role, python, pins)
        for python, roles in sets.items()
        for role, pins in roles.items()
    }
    uv_pin = sets[PYTHONS[0]]["node"]["uv"]
    files[LOCKS / "uv.txt"] = (
        "# Generated by 'make lock': the uv that requirements/node.in pins (make venv bootstraps with it).\n"
        + uv_pin.text
        + "\n"
    )
    return files


def main() -> int:
    try:
        files = generate(upgrade=os.environ.get("UPGRADE", "") not in ("", "0"))
    except (LockError, subprocess.TimeoutExpired) as exc:
        print(f"make lock: {exc}", file=sys.stderr)
        return 1
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"{path.relative_to(REQUIREMENTS.parent)}: {len(parse(text))} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
