"""What a real node installs works there: the registry's CUDA torch, from the locks, on hosts of their own Debian.

Two test hosts with a Debian root filesystem of their own (tb1 Debian 12 with Python 3.11, tb2 Debian 13
with Python 3.13, another Python than this controller's) are provisioned by the real playbook (`make
provision`) from the real locks: the controller downloads each Python's wheels from the registry by hash
(cached once per machine in ~/.cache/ugro/wheelhouse), the hosts sync them offline. tb1 is told it is a
GPU host (python_env_gpu=present) and also gets the GPU lock. Then one job trains across both on their
CPUs.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from helpers import REPO, Run, newest_run, remove_runs, write_job

from ugro.stack import lockfile as locks

DEBIAN = {"tb1": "12", "tb2": "13"}
GPU_HOST = "tb1"
PYTHON = {"12": "3.11", "13": "3.13"}
VENV = "/opt/ugro/.venv"
UV = "/opt/ugro/wheelhouse/base/uv"


def _ssh(bed: Any, host: str, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(bed.ssh_config), host, command], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def provisioned(
    netns: ModuleType, ansible_playbook: Run, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Path]]:
    """The two hosts after `make provision` (the playbook, every role), and their inventory."""
    tb = netns
    directory = tmp_path_factory.mktemp("stack")
    bed = tb.up(directory, hosts=2, subnet="auto", rootfs=True, debian=list(DEBIAN.values()))
    try:
        data = yaml.safe_load(Path(bed.inventory).read_text())
        for host in data["all"]["children"]["ugro_cluster"]["hosts"].values():
            host["ugro_cpu_procs_per_node"] = 1
            host["ugro_omp_num_threads"] = 1  # the hosts share this machine's cores
        inventory = directory / "cluster.yml"
        inventory.write_text(yaml.safe_dump(data))
        (directory / "host_vars").mkdir()
        (directory / "host_vars" / f"{GPU_HOST}.yml").write_text("python_env_gpu: present\n")
        env = {"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(Path.home())}
        proc = ansible_playbook(inventory, "playbooks/provision.yml", timeout=2400, env=env)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        yield bed, inventory
    finally:
        tb.down(directory)


def test_each_host_runs_its_own_python(provisioned: tuple[Any, Path]) -> None:
    bed, _ = provisioned
    for host, debian in DEBIAN.items():
        out = _ssh(bed, host, f"{VENV}/bin/python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'")
        assert out.stdout.strip() == PYTHON[debian], f"{host} (Debian {debian}): {out.stdout}{out.stderr}"


def test_every_host_imports_the_registry_torch_of_its_lock(provisioned: tuple[Any, Path]) -> None:
    bed, _ = provisioned
    probe = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))"
    for host, debian in DEBIAN.items():
        node = locks.read(locks.LOCKS / f"py{PYTHON[debian]}" / "node.txt")
        runtime = ".".join(node["nvidia-cuda-runtime"].version.split(".")[:2])
        out = _ssh(bed, host, f"{VENV}/bin/python -c '{probe}'")
        assert out.returncode == 0, f"{host}: import torch failed:\n{out.stderr[-3000:]}"
        version, cuda, available = json.loads(out.stdout)
        assert (version, cuda, available) == (f"{node['torch'].version}+cu{runtime.replace('.', '')}", runtime, False)


def test_every_host_holds_exactly_its_locks_and_each_package_has_what_it_needs(
    provisioned: tuple[Any, Path],
) -> None:
    bed, _ = provisioned
    for host, debian in DEBIAN.items():
        lock_dir = locks.LOCKS / f"py{PYTHON[debian]}"
        roles = ["node", "gpu"] if host == GPU_HOST else ["node"]
        expected = {name: pin.version for role in roles for name, pin in locks.read(lock_dir / f"{role}.txt").items()}
        freeze = _ssh(bed, host, f"{UV} pip freeze --no-config --offline --python {VENV}/bin/python")
        installed = {}
        for line in freeze.stdout.split():
            name, _, version = line.partition("==")
            installed[locks.canonical(name)] = version.split("+")[0]
        assert installed == expected, f"{host}: {set(installed) ^ set(expected)}"
        check = _ssh(bed, host, f"{UV} pip check --no-config --offline --python {VENV}/bin/python")
        report = check.stdout + check.stderr
        problems = [line for line in report.splitlines() if line.startswith("The package")]
        if host == GPU_HOST:  # unsloth requires xformers, which gpu.txt leaves out on purpose (it links CUDA 12)
            assert problems and all("requires `xformers" in line for line in problems), report
        else:
            assert check.returncode == 0 and problems == [], report


def test_unsloth_on_the_gpu_host_fails_only_for_want_of_a_gpu(provisioned: tuple[Any, Path]) -> None:
    bed, _ = provisioned
    out = _ssh(bed, GPU_HOST, f"{VENV}/bin/python -c 'import unsloth'")
    assert out.returncode != 0
    error = out.stderr.strip().splitlines()[-1]
    assert "ModuleNotFoundError" not in out.stderr and "cannot open shared object file" not in out.stderr, out.stderr
    assert "GPU" in error or "accelerator" in error, error
    absent = _ssh(bed, "tb2", f"{VENV}/bin/python -c 'import unsloth'")
    assert "No module named 'unsloth'" in absent.stderr  # not a GPU host: no GPU lock


def test_a_job_trains_across_debian_12_and_13_nodes(
    provisioned: tuple[Any, Path], repo_jobs: Path, ugro_train: Run
) -> None:
    _, inventory = provisioned
    name = "stack-test"
    path = write_job(repo_jobs / f"{name}.yaml", name=name, train={"max_steps": 6, "global_batch_size": 4})
    try:
        result = ugro_train("train", "--job", str(path), "--inventory", str(inventory), "--poll", "2", timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        run = newest_run(name)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, 7))
        logs = sorted(path.name for path in (run / "logs").iterdir())
        assert logs == ["tb1-rank0.log", "tb1-torchrun.log", "tb2-rank1.log", "tb2-torchrun.log"]
        assert "backend=hf device=cpu" in (run / "logs" / "tb2-rank1.log").read_text()  # rank 1: Debian 13's venv
    finally:
        path.unlink()
        remove_runs(name)
