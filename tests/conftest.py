"""Shared helpers: the repository, a small job file, and running torchrun for real."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The session's test cluster has a subnet of its own, so `make test` runs beside `make testbed-up`.
SESSION_SUBNET = os.environ.get("UGRO_TEST_SUBNET", "10.213.8.0/24")  # another: two sessions side by side
# Set by CI (.ci/run): a test whose prerequisite is missing fails with the reason instead of skipping,
# so the multi-host tests cannot drop out of a green run unnoticed.
REQUIRE_ENV = "UGRO_REQUIRE_TESTBED"


def unavailable(reason: str) -> NoReturn:
    """A test's prerequisite (test cluster, a tool) is missing: skip it here, fail it in CI."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this test must run here)", pytrace=False)
    pytest.skip(reason)


def _why_no_testbed() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, bridges, bind mounts)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        return "`ip netns` does not work here"
    return None


WHY_NOT = _why_no_testbed()


def load_molecule_module(name: str) -> ModuleType:
    """molecule/<name>.py by path: `molecule` is also the name of the Molecule package."""
    full = f"ugro_{name}"
    if full in sys.modules:
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, REPO / "molecule" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_testbed_module() -> ModuleType:
    return load_molecule_module("testbed")


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 3-host test cluster (tb1..tb3 on eth0/enp5s0/ens3), up for the session and down afterwards."""
    if WHY_NOT is not None:
        unavailable(WHY_NOT)
    tb = load_testbed_module()
    directory = tmp_path_factory.mktemp("testbed")
    bed = tb.up(directory, hosts=3, subnet=SESSION_SUBNET)
    try:
        yield bed
    finally:
        tb.down(directory)


@pytest.fixture(scope="session")
def cluster(testbed: Any) -> Path:
    """The test cluster's inventory, one CPU process per host (3 ranks on this 2-core machine)."""
    data = yaml.safe_load(Path(testbed.inventory).read_text())
    for host in data["all"]["children"]["ugro_cluster"]["hosts"].values():
        host["ugro_cpu_procs_per_node"] = 1
        host["ugro_omp_num_threads"] = 1  # the three hosts share this machine's two cores
    path = Path(testbed.inventory).parent / "cluster.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """`python -m ugro.cli ...` in the repository, as `make` runs it."""
    return subprocess.run([PYTHON, "-m", "ugro.cli", *args], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def job_processes(job_id: str) -> list[str]:
    """Every process on this machine (all test hosts included) whose command line names the hosts' run."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/opt/ugro/runs/{job_id}" in cmdline:  # the hosts' run dir (not the controller's)
                found.append(f"{proc.name}: {cmdline[:120]}")
    return found


# The test cluster's job: 30 steps of 6 sequences over 3 ranks, a checkpoint every 5 steps, collectives that
# give up on a lost peer after 20 s. The recovery tests run it with faults and compare with one unbroken run.
CLUSTER_JOB: dict[str, Any] = {
    "train": {"max_steps": 30, "global_batch_size": 6},
    "checkpoint": {"every": 5},
    "distributed": {"timeout_s": 20},
}


def cluster_job(name: str, **overrides: dict[str, Any]) -> Path:
    """Write jobs/<name>.yaml (jobs are synced from the repository): the cluster job with ``overrides``."""
    sections = {k: {**v, **overrides.get(k, {})} for k, v in CLUSTER_JOB.items()}
    job = small_job(name=name, **(overrides | sections))
    path = REPO / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def remove_job(path: Path) -> None:
    """The job file and every run of it on the controller."""
    path.unlink(missing_ok=True)
    for run in (REPO / "runs").glob(f"{path.stem}-*"):
        shutil.rmtree(run)


def newest_run(name: str) -> Path:
    runs = sorted((REPO / "runs").glob(f"{name}-*"))
    assert runs, f"no run of {name} in runs/"
    return runs[-1]


@pytest.fixture(scope="session")
def unbroken_run(cluster: Path) -> Iterator[tuple[Path, subprocess.CompletedProcess[str]]]:
    """The cluster job once across the 3 test hosts, without faults: (its run directory, the CLI's result)."""
    path = cluster_job("cluster-test")
    try:
        result = cli("train", "--job", str(path), "--inventory", str(cluster), "--poll", "2")
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        yield newest_run("cluster-test"), result
    finally:
        remove_job(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small_job(**overrides: Any) -> dict[str, Any]:
    """The default job's model and data, shortened for tests."""
    job: dict[str, Any] = {
        "name": "test",
        "model": {"source": "models/tiny-llama", "init": "random"},
        "lora": {
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        },
        "data": {"source": "data/sample/train.jsonl", "seq_len": 128},
        "optim": {"lr": 0.003},
        "schedule": {"warmup_steps": 4},
        "train": {"max_steps": 30, "global_batch_size": 8, "log_every": 10, "seed": 7},
        "checkpoint": {"every": 10, "keep_last": 5},
        "rank_local": {"micro_batch_size": 2},
        # Fixed shares: measured plans depend on timing, and the resume tests compare runs bit for bit.
        "balance": "equal",
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            job[section] = {**job.get(section, {}), **values}
        else:
            job[section] = values
    return job


def write_job(path: Path, **overrides: Any) -> Path:
    path.write_text(yaml.safe_dump(small_job(**overrides), sort_keys=False))
    return path


def torchrun_cmd(
    job: Path, run_dir: Path, nproc: int = 2, resume: str = "none", extra: tuple[str, ...] = ()
) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "--module", "train.worker", "--job", str(job), "--run-dir", str(run_dir),
        "--resume", resume, "--code-dir", str(REPO), *extra,
    ]  # fmt: skip


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_module(name: str, args: dict[str, Any], python: str = sys.executable, check: bool = False) -> dict[str, Any]:
    """Run a host module of library/ on localhost (local connection) with real `ansible` and ansible.cfg; its
    result, with ``failed`` set where the module failed."""
    env = run_env() | {
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal",  # "localhost | SUCCESS => {json}"
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    argv = [str(Path(sys.executable).parent / "ansible"), "localhost", "-c", "local"]
    argv += ["-e", f"ansible_python_interpreter={python}", "-m", name, "-a", json.dumps(args)]
    out = subprocess.run(
        argv + (["--check"] if check else []), cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    # "localhost | SUCCESS => {...}" or "localhost | FAILED! => {...}", after the [ERROR] lines of a failure.
    status, _, body = ("\n" + out.stdout).partition("\nlocalhost | ")[2].partition(" => ")
    try:
        result = dict(json.JSONDecoder().raw_decode(body)[0])
    except ValueError:
        raise AssertionError(f"no result from ansible: {out.stdout}\n{out.stderr}") from None
    return {**result, "failed": status.startswith("FAILED")}


def torchrun(
    job: Path, run_dir: Path, nproc: int = 2, resume: str = "none", extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        torchrun_cmd(job, run_dir, nproc, resume, extra),
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def _keep_latest_run_link() -> Iterator[None]:
    """Tests launch (and delete) jobs through the CLI; afterwards runs/latest points where it did before."""
    link = REPO / "runs" / "latest"
    before = os.readlink(link) if link.is_symlink() else None
    yield
    if link.is_symlink() or link.exists():
        link.unlink()
    if before is not None:
        link.symlink_to(before)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
