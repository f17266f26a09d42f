"""The locks (requirements/locks/py3.X/*.txt) are what a user's host really installs.

Every check resolves with the pinned uv and `--no-config`, from the registry alone, as a Linux
x86-64 host of each supported Python would: this machine's pip configuration (its local CPU-only
torch wheel, which declares no dependencies) cannot make a lock look complete. A lock that misses a
package some pin needs (torch's CUDA libraries, say), pins a version that conflicts with another,
or records a hash the registry does not serve, fails here.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.version import Version

from tools import lock as locker
from ugro.stack import lockfile as locks

ROLES = ("node", "gpu", "controller", "mlflow-server")
# torch 2.13.0 for Linux x86-64 is the CUDA 13.0 build: these are among what it needs to import.
TORCH_NEEDS = ("triton", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cuda-runtime", "nvidia-cublas")


def _lock(python: str, role: str) -> Path:
    return locks.LOCKS / f"py{python}" / f"{role}.txt"


def _hashes(pin: locks.Pin) -> set[str]:
    return set(re.findall(r"--hash=(sha256:[0-9a-f]{64})", pin.text))


# gpu.txt and controller.txt each go on top of node.txt, never together (a GPU host syncs node + gpu, the controller's
# .venv node + controller): a package both need (trl: unsloth's, and the preference tests') is in both, pinned alike
# where one version serves both (importlib-metadata does not: unsloth's diffusers takes 10, mlflow-skinny <10).
APART = {"gpu", "controller"}
DIFFER = {"importlib-metadata"}
# The MLflow server's venv stands alone (no node.txt beneath it): its pins may be anything.
ALONE = {"mlflow-server"}


def test_every_python_has_every_role_and_each_pin_has_its_hashes() -> None:
    for python in locks.PYTHONS:
        seen: dict[str, tuple[str, str]] = {}
        for role in ROLES:
            path = _lock(python, role)
            assert path.is_file(), f"{path} is missing: run `make lock`"
            header = path.read_text().splitlines()[0]
            assert f"for CPython {python} on Linux x86-64" in header, header
            for name, pin in locks.read(path).items():
                assert re.fullmatch(r"[0-9][^\s;+]*", pin.version), f"{path}: {pin.text.splitlines()[0]}"
                assert _hashes(pin), f"{path}: {name} has no hash"
                if role in ALONE:
                    continue
                if name in seen:
                    other, version = seen[name]
                    assert {other, role} == APART, f"{name} is in both {other}.txt and {role}.txt of Python {python}"
                    same = version == pin.version or name in DIFFER
                    assert same, f"{name}: {version} in {other}.txt, {pin.version} in {role}.txt"
                seen[name] = (role, pin.version)


def test_every_python_gets_the_same_versions() -> None:
    first, *others = locks.PYTHONS
    for role in ROLES:
        reference = {n: p.version for n, p in locks.read(_lock(first, role)).items()}
        for python in others:
            versions = {n: p.version for n, p in locks.read(_lock(python, role)).items()}
            assert versions == reference, f"{role}.txt of Python {python} differs from Python {first}'s"


def test_node_lock_holds_torch_with_its_cuda_libraries_and_no_controller_tool() -> None:
    node = locks.read(_lock("3.12", "node"))
    assert node["torch"].version == "2.13.0"
    assert node["bitsandbytes"].version == "0.50.2"  # 4-bit QLoRA runs on CPU nodes too
    assert [name for name in TORCH_NEEDS if name not in node] == []
    tools = [name for name in node if locker.NOT_ON_NODES.match(name)]
    assert tools == [], f"node.txt installs {tools} on every node: they belong to controller.in or dev.in"
    gpu = locks.read(_lock("3.12", "gpu"))
    assert gpu["unsloth"].version == "2026.10.1"
    assert "xformers" not in gpu and locks.omitted(_lock("3.12", "gpu")) == ["xformers"]


def test_the_controller_reports_to_the_mlflow_server_version_it_is_tested_against() -> None:
    """The client (mlflow-skinny, controller.txt) and the server the tracker tests start (mlflow, its own venv) are
    one release; lm-eval's source-only requirements are left out of the controller lock, and nothing else is."""
    for python in locks.PYTHONS:
        controller, server = locks.read(_lock(python, "controller")), locks.read(_lock(python, "mlflow-server"))
        assert controller["mlflow-skinny"].version == server["mlflow"].version == server["mlflow-skinny"].version
        assert "mlflow" not in controller and "wandb" in controller and "lm-eval" in controller
        assert set(locks.excluded(_lock(python, "controller"))) == set(locker.EXCLUDED["controller"])
        assert not set(locker.EXCLUDED["controller"]) & set(controller)


def test_the_cuda_stack_node_in_pins_is_the_one_every_node_lock_holds() -> None:
    """requirements/node.in names torch's CUDA stack as torch 2.13.0 declares it; every node lock pins the same."""
    found = re.findall(r"^([a-z0-9-]+)(?:\[[^\]]*\])?==([^;\s]+);", (locks.REQUIREMENTS / "node.in").read_text(), re.M)
    pinned = {name: Version(version) for name, version in found}
    assert {"cuda-toolkit", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"} <= set(pinned), pinned
    for python in locks.PYTHONS:
        node = locks.read(_lock(python, "node"))
        assert {name: Version(node[name].version) for name in pinned if name in node} == pinned, f"Python {python}"


def test_the_uv_every_node_syncs_with_is_the_one_make_venv_bootstraps() -> None:
    uv = locks.read(_lock("3.12", "node"))["uv"]
    assert locks.read(locks.LOCKS / "uv.txt")["uv"] == uv
    scenario = (locks.REQUIREMENTS.parent / "molecule" / "python_env" / "locks" / "py3.11" / "node.txt").read_text()
    assert f"uv=={uv.version}" in scenario, "molecule/python_env/locks/py3.11/node.txt must pin the uv of the node lock"


def _resolve(python: str, role: str) -> tuple[dict[str, locks.Pin], dict[str, locks.Pin]]:
    """(what the registry resolves from the lock files' own pins, what they lock) for one host's set."""
    files = ([] if role in ALONE else [_lock(python, "node")]) + ([_lock(python, role)] if role != "node" else [])
    locked = {name: pin for path in files for name, pin in locks.read(path).items()}
    excludes = locks.excluded(_lock(python, role))
    try:  # --no-config, no UV_* / PIP_* variable
        return locker.compile_set(files, python, excludes=excludes), locked
    except locker.LockError as exc:
        pytest.fail(f"Python {python}, {role}: the locks do not resolve:\n{str(exc)[-3000:]}")


@pytest.mark.usefixtures("registry")
def test_every_lock_resolves_complete_from_the_registry_alone_for_every_python() -> None:
    targets = [(python, role) for python in locks.PYTHONS for role in ROLES]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(targets, pool.map(lambda t: _resolve(*t), targets), strict=True))
    for (python, role), (resolved, locked) in results.items():
        allowed = set(locks.omitted(_lock(python, role))) if role != "node" else set()
        where = f"Python {python}, {role if role in ALONE else 'node' + (' + ' + role if role != 'node' else '')}"
        assert set(resolved) - set(locked) == allowed, f"{where}: needed but not locked"
        assert set(locked) - set(resolved) == set(), f"{where}: locked but needed by nothing"
        other = {n: (p.version, resolved[n].version) for n, p in locked.items() if resolved[n].version != p.version}
        assert other == {}, f"{where}: the registry resolves other versions"
        wrong = [n for n, p in locked.items() if _hashes(p) != _hashes(resolved[n])]
        assert wrong == [], f"{where}: hashes differ from the registry's for {wrong}"
        if role in ("node", "gpu"):
            assert [n for n in TORCH_NEEDS if n not in resolved] == [], f"{where}: torch's CUDA stack"
