"""Plain helpers the tests share: the repository, small job files, the CLI, torchrun, Ansible.

Fixtures live in conftest.py; a helper that runs something real (ranks, Ansible, the test cluster) is also
offered there as a fixture of the same name, so that the test's tier follows from what it requests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from testbed import exporters
from testbed.net import free_port

__all__ = ["closed_port", "free_port", "unanswering_port"]  # re-exported: the tests take every helper from here


def closed_port() -> int:
    """A loopback port nothing listens on: a connect is refused (a host that is up, its job gone)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unanswering_port(held: list[socket.socket]) -> int:
    """A loopback port whose connects time out, as behind a cut link: a listener that never accepts, its queue
    filled (the kernel then drops SYNs). ``held`` keeps its sockets; the caller closes them."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    held.append(server)
    port = int(server.getsockname()[1])
    held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
    return port


REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent
# The session's test cluster has a subnet of its own, so `make test` runs beside `make testbed-up`.
SESSION_SUBNET = os.environ.get("UGRO_TEST_SUBNET", "10.213.8.0/24")  # another: two sessions side by side
# Set by CI (.ci/run): a test whose prerequisite is missing fails with the reason instead of skipping,
# so the multi-host tests cannot drop out of a green run unnoticed.
REQUIRE_ENV = "UGRO_REQUIRE_TESTBED"
# Where the controller puts runs (ugro/hosts/playbook.py); conftest.py points it at the session's temporary
# directory, so that no test writes into the repository's runs/.
RUNS_ENV = "UGRO_RUNS_DIR"
# What the fixtures that run a command hand over (cli, torchrun, ansible_playbook).
Run = Callable[..., subprocess.CompletedProcess[str]]


def unavailable(reason: str) -> NoReturn:
    """A test's prerequisite (test cluster, a tool) is missing: skip it here, fail it in CI."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this test must run here)", pytrace=False)
    pytest.skip(reason)


def why_no_testbed() -> str | None:
    """Why the test cluster cannot be built here (root, `ip netns`), or None."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, bridges, bind mounts)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode != 0:
        return "`ip netns` does not work here"
    return None


# --------------------------------------------------------------------------------------------------
# Job files and runs.


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


# The test cluster's job: 30 steps of 6 sequences over 3 ranks, a checkpoint every 5 steps, collectives that
# give up on a lost peer after 20 s. The recovery tests run it with faults and compare with one unbroken run.
CLUSTER_JOB: dict[str, Any] = {
    "train": {"max_steps": 30, "global_batch_size": 6},
    "checkpoint": {"every": 5},
    "distributed": {"timeout_s": 20},
}


def cluster_job(jobs: Path, name: str, **overrides: dict[str, Any]) -> Path:
    """``jobs/<name>.yaml``: the cluster job with ``overrides``, in ``jobs`` (the session's ``repo_jobs``)."""
    sections = {k: {**v, **overrides.get(k, {})} for k, v in CLUSTER_JOB.items()}
    return write_job(jobs / f"{name}.yaml", name=name, **(overrides | sections))


def runs_dir() -> Path:
    """The controller's runs directory the CLI uses in this session."""
    return Path(os.environ[RUNS_ENV]) if os.environ.get(RUNS_ENV) else REPO / "runs"


def newest_run(name: str) -> Path:
    runs = sorted(runs_dir().glob(f"{name}-*"))
    assert runs, f"no run of {name} in {runs_dir()}"
    return runs[-1]


def remove_runs(name: str) -> None:
    """Every run of the job ``name`` on the controller."""
    for run in runs_dir().glob(f"{name}-*"):
        shutil.rmtree(run)


def host_step(testbed: Any, job_id: str) -> int:
    """The newest step any host's metrics.jsonl records (read from the hosts' own disks)."""
    step = 0
    for host in ("tb1", "tb2", "tb3"):  # the test cluster's hosts
        path = testbed.dir / host / "opt" / "ugro" / "runs" / job_id / "metrics.jsonl"
        try:
            step = max(step, int(json.loads(path.read_text().splitlines()[-1])["step"]))
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return step


def wait_for_step(
    testbed: Any, name: str, step: int, follower: subprocess.Popen[str] | None, timeout_s: float = 300
) -> str:
    """The id of job ``name``'s newest run once a host's records reach ``step`` (a controller that ends fails it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert follower is None or follower.poll() is None, follower.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"the job never reached step {step}"
        runs = sorted(runs_dir().glob(f"{name}-*"))
        if runs and host_step(testbed, runs[-1].name) >= step:
            return runs[-1].name
        time.sleep(0.2)


def job_processes(job_id: str) -> dict[int, str]:
    """Every process on this machine (all test hosts included) whose command line names the hosts' run: its pid
    -> the command line's start."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if f"/opt/ugro/runs/{job_id}" in cmdline:  # the hosts' run dir (not the controller's)
                found[int(proc.name)] = cmdline[:120]
    return found


def end_job_processes(job_id: str, grace_s: float = 10.0) -> dict[int, str]:
    """End what is left of the hosts' runs whose id starts with ``job_id`` (a test that failed before its `make
    stop`): SIGTERM to each process group, SIGKILL to what is left after ``grace_s``. What was found, for the
    test's message; {} when nothing was. A job left running would hold the test cluster's cores and hosts for
    every later test."""
    found = job_processes(job_id)
    groups = set()
    for pid in found:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, sig)
        deadline = time.monotonic() + wait_s
        while job_processes(job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
    return found


# --------------------------------------------------------------------------------------------------
# Running things: the CLI, torchrun, Ansible.


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def cli(
    *args: str, timeout: float = 400, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m ugro.cli ...`` as ``make`` runs it, in the checkout ``cwd`` (this repository by default) and
    with its code, ``env`` added to the environment."""
    full = run_env() | {"PYTHONPATH": str(cwd)} | (env or {})
    return subprocess.run([PYTHON, "-m", "ugro.cli", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def make(
    *args: str, timeout: float = 600, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``make <args>`` as a user types it, in the checkout ``cwd`` and with its code, ``env`` added to the
    environment (make hands its command-line variables, JOB_ID=... among them, to the environment as well)."""
    full = run_env() | {"PYTHONPATH": str(cwd)} | (env or {})
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


def host_launcher(hosts: tuple[str, ...], host: str, port: int, job: Path, run_dir: Path, log: Path,
                  env: dict[str, str], extra: tuple[str, ...] = (),
                  nproc: int = 1) -> subprocess.Popen[bytes]:  # fmt: skip
    """One "host" of a multi-host run on this machine: a real launcher (train/launcher.py, torchrun with the static
    rendezvous, as the launch script runs it) with ``nproc`` ranks of tests/fixtures/faulty_worker.py, told apart by
    UGRO_HOST, the first of ``hosts`` the main one, over loopback; ``env`` added (the fixture's faults), ``extra`` the
    worker's further arguments (``--resume auto``)."""
    full = run_env() | {"UGRO_HOST": host, "UGRO_MAIN_HOST": "1" if host == hosts[0] else "0", "OMP_NUM_THREADS": "1",
                        "UGRO_CLUSTER_ADDRESS": "127.0.0.1"} | env  # fmt: skip
    argv = [PYTHON, "-m", "train.launcher", f"--nnodes={len(hosts)}", f"--node-rank={hosts.index(host)}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_dir.name}", "--local-addr=127.0.0.1", "--max-restarts=0", "--module",
            "tests.fixtures.faulty_worker", "--job", str(job), "--run-dir", str(run_dir),
            "--code-dir", str(REPO), *extra]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, env=full, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def torchrun_cmd(
    job: Path, run_dir: Path, nproc: int = 2, resume: str = "none", extra: tuple[str, ...] = ()
) -> list[str]:
    """torchrun on this machine as the launch script runs it on a host: train/launcher.py, which forks the CPU ranks
    from one process that has imported torch, transformers and peft (`make bench-rank-start` compares it with
    ``python -m torch.distributed.run``, which starts each rank as a new interpreter: ~3 CPU-s more per launch)."""
    return [
        PYTHON, "-m", "train.launcher",
        f"--nproc-per-node={nproc}", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "--module", "train.worker", "--job", str(job), "--run-dir", str(run_dir),
        "--resume", resume, "--code-dir", str(REPO), *extra,
    ]  # fmt: skip


def torchrun(
    job: Path, run_dir: Path, nproc: int = 2, resume: str = "none", extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        torchrun_cmd(job, run_dir, nproc, resume, extra),
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def spawn(fn: Any, nprocs: int, *args: Any) -> None:
    """``fn(rank, port, *args)`` in ``nprocs`` processes (torch.multiprocessing), a free rendezvous port for all."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(free_port(), *args), nprocs=nprocs, join=True)


def ansible_playbook(
    inventory: Path, playbook: str | Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real ``ansible-playbook`` of the venv with ansible.cfg, in the repository."""
    full = run_env() | {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"} | (env or {})
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(playbook), *args]
    return subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout, check=False)


def start_exporters(inventory: Path) -> None:
    """Each host's node exporter, as `make provision` leaves a cluster (playbooks/provision.yml, tag exporter,
    ``exporter_state: started``): started where it does not run, left alone where it does."""
    exporters.set_state(inventory, "started")


def run_module(name: str, args: dict[str, Any], python: str = sys.executable, check: bool = False) -> dict[str, Any]:
    """Run a host module of library/ on localhost (local connection) with real `ansible` and ansible.cfg; its
    result, with ``failed`` set where the module failed."""
    env = run_env() | {
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal",  # "localhost | SUCCESS => {json}"
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }
    argv = [str(VENV_BIN / "ansible"), "localhost", "-c", "local"]
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


def copy_checkout(dest: Path) -> Path:
    """This checkout's files (tracked and not ignored) copied to ``dest``, its .venv linked: a clone as a user
    has it, for the tests of the default inventory, whose host runs the checkout itself and writes its runs/."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:
        unavailable(f"no git checkout to copy: {listed.stderr.decode(errors='replace').strip()}")
    for rel in listed.stdout.decode().split("\0"):
        source = REPO / rel
        if rel and source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest
