"""Regenerate the locks by role (`make lock`) with pip's own resolver, never installing anything.

    node.lock        what every node runs (the trainer); role python_env installs it on every node
    gpu.lock         what a host with an NVIDIA GPU adds on top of node.lock (unsloth and its needs)
    controller.lock  what the controller adds on top of node.lock (Ansible, the CLI, gguf)
    dev.lock         what the development machine and CI add on top of node.lock + controller.lock

Each lock lists exactly the packages its role needs beyond the locks below it, every one pinned.
They are consistent by construction: node.in + gpu.in are resolved together for a Linux x86-64
GPU host first, node.lock is then resolved for this machine under those versions, and the
controller and dev locks are resolved on top of the pinned node.lock (and controller.lock).
Every resolution is `pip install --dry-run --ignore-installed --report` (pip >= 23), so nothing
on this machine changes. tests/test_locks.py re-runs the resolver over the committed locks.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "requirements"
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"

# A Linux x86-64 GPU host with glibc >= 2.28 installs any of these wheel platforms.
GPU_HOST_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]

# Never part of node.lock: the nodes run the trainer, not the controller's or the tests' tools.
NOT_ON_NODES = re.compile(r"^(ansible.*|molecule.*|pytest.*|ruff|mypy.*|black|yamllint|types-.*)$")

HEADERS = {
    "node": "every node installs exactly these (role python_env).",
    "gpu": "hosts with an NVIDIA GPU install these on top of node.lock, resolved for Linux x86-64.",
    "controller": "the controller's .venv adds these to node.lock (make venv).",
    "dev": "the development machine and CI add these to node.lock + controller.lock (make venv).",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """torch's local build label (2.13.0+cpu) is dropped: the same pin takes the CUDA build on a GPU host."""
    return version.split("+", 1)[0]


def resolve(
    args: list[str], *, gpu_host: bool = False, python: str = PYTHON, timeout: float = 900
) -> dict[str, tuple[str, str]]:
    """Run pip's resolver over requirement arguments; return {canonical name: (name, version)}.

    gpu_host resolves for a Linux x86-64 host of Python `python` (CPython, binary wheels only)
    instead of this machine. Raises CalledProcessError with pip's message when the set does not
    resolve, TimeoutExpired past `timeout` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="ugro-lock-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--progress-bar",
            "off",
            "--disable-pip-version-check",
            "--no-input",
            "--report",
            str(report),
        ]
        if gpu_host:
            # pip < 24 wants --target with platform options; --dry-run writes nothing there.
            cmd += [
                "--target",
                str(Path(tmp) / "target"),
                "--implementation",
                "cp",
                "--python-version",
                python,
                "--only-binary=:all:",
            ]
            for tag in GPU_HOST_PLATFORMS:
                cmd += ["--platform", tag]
        cmd += args
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )
        if proc.returncode != 0:
            # pip's verdict is on stderr, the conflicting requirements ("The conflict is caused by") on stdout.
            errors = [line for line in proc.stderr.splitlines() if "is ignored: it is neither" not in line]
            cause = proc.stdout[proc.stdout.find("The conflict is caused by") :] if "conflict is" in proc.stdout else ""
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, "\n".join(errors) + "\n" + cause)
        installs = json.loads(report.read_text())["install"]
    return {
        canonical(i["metadata"]["name"]): (i["metadata"]["name"], public(i["metadata"]["version"])) for i in installs
    }


def read_lock(path: Path) -> dict[str, tuple[str, str]]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = (name.strip(), version.strip())
    return pins


def render(role: str, pins: dict[str, tuple[str, str]]) -> str:
    lines = [f"# Generated from requirements/{role}.in by 'make lock' on Python {PYTHON} — {HEADERS[role]}"]
    if role == "node":
        lines.append(
            "# torch resolves to the local CPU build on a machine without GPU and to the CUDA build on a GPU host."
        )
    lines += [f"{name}=={version}" for _, (name, version) in sorted(pins.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        print("make lock runs on Linux x86-64 (the nodes' platform)", file=sys.stderr)
        return 1
    locks: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ugro-locks-") as tmp:

        def req(role: str) -> list[str]:
            return ["-r", str(HERE / f"{role}.in")]

        def lock(role: str, pins: dict[str, tuple[str, str]]) -> list[str]:
            """Render a lock into the scratch directory (the real ones change only when all resolve)."""
            locks[role] = render(role, pins)
            (Path(tmp) / f"{role}.lock").write_text(locks[role])
            return ["-r", str(Path(tmp) / f"{role}.lock")]

        try:
            print("resolving node.in + gpu.in for a Linux x86-64 GPU host ...", flush=True)
            joint = resolve(req("node") + req("gpu"), gpu_host=True)
            constraints = Path(tmp) / "constraints.txt"
            constraints.write_text("".join(f"{name}=={version}\n" for name, version in joint.values()))
            print("resolving node.in for this machine under those versions ...", flush=True)
            node = resolve([*req("node"), "-c", str(constraints)])
            differ = [
                f"{n}: {node[n][1]} here, {joint[n][1]} on a GPU host"
                for n in node
                if n in joint and node[n] != joint[n]
            ]
            on_nodes = [f"{n} would be on every node" for n in node if NOT_ON_NODES.match(n)]
            if differ or on_nodes:
                print("node.lock would be inconsistent: " + "; ".join(differ + on_nodes), file=sys.stderr)
                return 1
            node_lock = lock("node", node)
            lock("gpu", {n: pin for n, pin in joint.items() if n not in node})
            print("resolving controller.in on top of node.lock ...", flush=True)
            controller = resolve(node_lock + req("controller"))
            controller_lock = lock("controller", {n: pin for n, pin in controller.items() if n not in node})
            print("resolving dev.in on top of node.lock + controller.lock ...", flush=True)
            dev = resolve(node_lock + controller_lock + req("dev"))
            lock("dev", {n: pin for n, pin in dev.items() if n not in controller})
        except subprocess.CalledProcessError as exc:
            print(exc.stderr, file=sys.stderr)
            return 1
    for role, text in locks.items():
        (HERE / f"{role}.lock").write_text(text)
        print(f"requirements/{role}.lock: {len(read_lock(HERE / f'{role}.lock'))} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
