"""The locks by role (requirements/*.lock) install together, checked with pip's real resolver.

Dry runs only (`pip install --dry-run --ignore-installed --report`, dependencies resolved, nothing
installed), through pip's configured index: node.lock + gpu.lock as a Linux x86-64 GPU host of the
locks' Python installs them (binary wheels only), and node + controller + dev as `make venv`
installs them on this machine. Each must succeed and install exactly the pinned versions: a lock
that conflicts with another, or misses a package some pin needs, fails here.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements"
ROLES = ("node", "gpu", "controller", "dev")
# pip's own resolution can take a while on a cold cache; a hung index fails the test, not CI.
RESOLVE_TIMEOUT = 600


def _lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ugro_lock", REQUIREMENTS.parent / "ugro" / "locks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _lock_module()


def _pins(role: str) -> dict[str, tuple[str, str]]:
    return lock.read_lock(REQUIREMENTS / f"{role}.lock")


def _lock_python() -> str:
    """The Python version in node.lock's header ("... on Python 3.11 ...")."""
    match = re.search(r"on Python (\d+\.\d+)", (REQUIREMENTS / "node.lock").read_text().splitlines()[0])
    assert match, "node.lock's first line names the Python version it was made on"
    return match.group(1)


def _args(*roles: str) -> list[str]:
    return [arg for role in roles for arg in ("-r", str(REQUIREMENTS / f"{role}.lock"))]


def _resolve(args: list[str], **kwargs: object) -> dict[str, tuple[str, str]]:
    try:
        return lock.resolve(args, timeout=RESOLVE_TIMEOUT, **kwargs)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"pip could not resolve {' '.join(args)}:\n{exc.stderr[-3000:]}")


def _versions(pins: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {name: version for name, (_, version) in pins.items()}


def test_every_lock_pins_each_package_once_and_no_package_twice() -> None:
    seen: dict[str, str] = {}
    for role in ROLES:
        lines = [line for line in (REQUIREMENTS / f"{role}.lock").read_text().splitlines() if line.strip()]
        assert lines[0].startswith(f"# Generated from requirements/{role}.in by 'make lock' on Python ")
        for line in lines:
            if not line.startswith("#"):
                assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][^\s;+]*", line), f"{role}.lock: {line}"
        for name in _pins(role):
            assert name not in seen, f"{name} is in both {seen[name]}.lock and {role}.lock"
            seen[name] = role


def test_node_lock_holds_no_ansible_lint_or_test_tool() -> None:
    node = _pins("node")
    tools = [name for name in node if lock.NOT_ON_NODES.match(name)]
    assert tools == [], f"node.lock installs {tools} on every node: they belong to controller.in or dev.in"
    for name in ("ansible-core", "ansible-runner", "ansible-lint", "molecule", "pytest", "ruff", "mypy"):
        assert name not in node
    # 4-bit QLoRA runs on CPU nodes too, so bitsandbytes is a node package, not a GPU one.
    assert node["bitsandbytes"][1] == "0.50.2"
    assert node["torch"][1] == "2.13.0"


def test_node_lock_pins_the_uv_that_syncs_every_node() -> None:
    """Role python_env runs the uv that node.lock pins (unpacked from its wheel); its Molecule scenario the same one."""
    uv = _pins("node")["uv"][1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", uv), uv
    scenario = lock.read_lock(REQUIREMENTS.parent / "molecule" / "python_env" / "node.lock")
    assert scenario["uv"][1] == uv, "molecule/python_env/node.lock must pin the uv of requirements/node.lock"


@pytest.mark.slow
def test_node_and_gpu_locks_resolve_together_on_a_linux_gpu_host() -> None:
    expected = _versions(_pins("node")) | _versions(_pins("gpu"))
    resolved = _versions(_resolve(_args("node", "gpu"), gpu_host=True, python=_lock_python()))
    assert resolved == expected, {
        "not locked": {n: v for n, v in resolved.items() if n not in expected},
        "locked, not installed": {n: v for n, v in expected.items() if n not in resolved},
        "other version": {n: (expected[n], v) for n, v in resolved.items() if n in expected and expected[n] != v},
    }
    assert resolved["unsloth"] == "2026.10.1"
    assert resolved["transformers"] == _versions(_pins("node"))["transformers"]


@pytest.mark.slow
def test_node_controller_and_dev_locks_resolve_together_here() -> None:
    expected = _versions(_pins("node")) | _versions(_pins("controller")) | _versions(_pins("dev"))
    resolved = _versions(_resolve(_args("node", "controller", "dev")))
    assert resolved == expected, {
        "not locked": {n: v for n, v in resolved.items() if n not in expected},
        "locked, not installed": {n: v for n, v in expected.items() if n not in resolved},
    }
