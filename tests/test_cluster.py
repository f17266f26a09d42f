"""One command launches a job across every host of a real (network-namespace) test cluster.

tb1..tb3 each have their own address, hostname, /etc/hosts, sshd and code directory (/opt/ugro);
Ansible reaches them over SSH, syncs the code, and torchrun joins them with c10d + gloo. tb2 and tb3
have interfaces named enp5s0 and ens3, so per-host interface detection is really exercised.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PYTHON, REPO, cli, cluster_job, job_processes, newest_run, remove_job, run_env

from train.metrics import read_metrics

pytestmark = pytest.mark.slow


def _job(name: str, steps: int) -> Iterator[Path]:
    path = cluster_job(name, train={"max_steps": steps})
    yield path
    remove_job(path)


@pytest.fixture()
def long_job_file() -> Iterator[Path]:
    """Long enough that `make stop` surely lands mid-run (a step takes ~0.1-0.3 s here)."""
    yield from _job("cluster-stop-test", steps=150)


def _latest() -> str:
    return (REPO / "runs" / "latest").readlink().name


def test_three_hosts_train_and_the_controller_gets_every_log(unbroken_run: tuple[Path, Any], testbed: Any) -> None:
    run_dir, result = unbroken_run
    assert "restart" not in result.stdout, result.stdout[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["restarts"] == []
    rows = read_metrics(run_dir)  # fetched from the rendezvous host
    assert rows[-1]["step"] == 30
    assert sum(r["loss"] for r in rows[-5:]) / 5 < 0.9 * rows[0]["loss"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == sorted(
        [f"tb{i}-torchrun.log" for i in (1, 2, 3)] + [f"tb{i}-rank{r}.log" for i, r in ((1, 0), (2, 1), (3, 2))]
    ), logs
    # tb2's cluster interface is enp5s0, not eth0: gloo was pointed at it, and tb2 trained.
    assert "GLOO_SOCKET_IFNAME=enp5s0" in (run_dir / "logs" / "tb2-torchrun.log").read_text()
    assert "step" in (run_dir / "logs" / "tb1-rank0.log").read_text()
    assert testbed.host("tb2").interface == "enp5s0"
    assert not job_processes(run_dir.name)


def test_stop_mid_run_leaves_no_process_and_resume_continues(cluster: Path, long_job_file: Path) -> None:
    follower = subprocess.Popen(
        [PYTHON, "-m", "ugro.cli", "train", "--job", str(long_job_file), "--inventory", str(cluster), "--poll", "3"],
        cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while True:
            assert follower.poll() is None, follower.stdout.read() if follower.stdout else ""
            assert time.monotonic() < deadline, "the job never reached step 11 while running"
            status = cli("status", "--inventory", str(cluster), timeout=120)
            if "running" in status.stdout and any(f"{s}/150" in status.stdout for s in range(11, 100)):
                break
            time.sleep(2)
        job_id = newest_run("cluster-stop-test").name
        assert len(job_processes(job_id)) >= 6  # 3 launch scripts + 3 torchruns, + workers

        second = cli("train", "--job", str(long_job_file), "--inventory", str(cluster), timeout=200)
        assert second.returncode == 1
        for host in ("tb1", "tb2", "tb3"):
            assert f"{host} already runs job {job_id}" in " ".join(second.stderr.split()), second.stderr

        stopped = cli("stop", "--inventory", str(cluster), timeout=200)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not job_processes(job_id), job_processes(job_id)
        follower.wait(timeout=60)  # the follower sees every host stopped and ends
    finally:
        if follower.poll() is None:
            follower.kill()
    status = cli("status", "--inventory", str(cluster), timeout=120)
    assert status.stdout.count("stopped") == 3, status.stdout

    resumed = cli("train", "--job", str(long_job_file), "--inventory", str(cluster), "--resume", "auto", "--poll", "3")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert _latest() == job_id
    main_log = (REPO / "runs" / job_id / "logs" / "tb1-rank0.log").read_text()
    found = re.search(r"resumed from \S+/checkpoints/step-0*(\d+) at step (\d+)", main_log)
    assert found is not None, main_log[-2000:]
    assert found[1] == found[2] and 5 <= int(found[2]) < 150
    assert read_metrics(REPO / "runs" / job_id)[-1]["step"] == 150
