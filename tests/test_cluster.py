"""One command launches a job across every host of a real (network-namespace) test cluster.

tb1..tb3 each have their own address, hostname, /etc/hosts, sshd and code directory (/opt/ugro);
Ansible reaches them over SSH, syncs the code, and torchrun joins them with c10d + gloo. tb2 and tb3
have interfaces named enp5s0 and ens3, so per-host interface detection is really exercised.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import (
    REPO,
    Run,
    cli,
    cluster_job,
    end_job_processes,
    job_processes,
    newest_run,
    remove_runs,
    run_env,
    runs_dir,
)

from train.metrics import read_metrics


def _job(jobs: Path, name: str, steps: int) -> Iterator[Path]:
    path = cluster_job(jobs, name, train={"max_steps": steps})
    yield path
    path.unlink()
    # A test that failed before its `make stop` leaves the job on the hosts; the endless one would run on.
    left = end_job_processes(f"{name}-")
    remove_runs(name)
    assert not left, f"the test left its job running on the test cluster (now ended): {left}"


# More steps than any machine runs while the test waits on it: the job can only end by `ugro stop`, so the
# stop always lands mid-run, whatever this machine's speed (a step takes ~0.1-0.3 s here).
ENDLESS = 1_000_000


@pytest.fixture()
def long_job_file(repo_jobs: Path) -> Iterator[Path]:
    yield from _job(repo_jobs, "cluster-stop-test", steps=ENDLESS)


def _running_step(status: str) -> int | None:
    """The job's step (the main host reports it) once every host's row says running; None before that."""
    rows = [line for line in status.splitlines() if re.search(r"\btb\d\b", line)]
    if len(rows) < 3 or not all("running" in line for line in rows):
        return None
    steps = [int(m[1]) for line in rows if (m := re.search(rf"(\d+)/{ENDLESS}\b", line))]
    return max(steps, default=None)


def _main_host_step(testbed: Any, name: str) -> int:
    """The newest step in the main host's (tb1's) metrics.jsonl of the job's newest run, read from its own disk."""
    runs = sorted(runs_dir().glob(f"{name}-*"))
    if not runs:
        return 0
    rows = read_metrics(testbed.dir / "tb1" / "opt" / "ugro" / "runs" / runs[-1].name)
    return int(rows[-1]["step"]) if rows else 0


def _follow(job_file: Path, cluster: Path, *extra: str) -> subprocess.Popen[str]:
    """`make train JOB=... INVENTORY=... [RESUME=auto]` as the README shows it, in a process group of its own."""
    argv = ["make", "--no-print-directory", "train", f"JOB={job_file.relative_to(REPO)}", f"INVENTORY={cluster}"]
    return subprocess.Popen([*argv, *extra], cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def _end(follower: subprocess.Popen[str]) -> None:
    """Kill what is left of a follower (make and the controller under it): the test's own process group."""
    if follower.poll() is None:
        os.killpg(follower.pid, signal.SIGKILL)
        follower.wait()


def _wait_running(follower: subprocess.Popen[str], cluster: Path, testbed: Any, job_file: Path, step: int) -> None:
    """Until the job has reached ``step`` (the main host's metrics, read as they are written), then `ugro status`
    must show every host running it there; fails if the launch ends first."""
    deadline = time.monotonic() + 600
    while _main_host_step(testbed, job_file.stem) < step:
        assert follower.poll() is None, follower.stdout.read() if follower.stdout else ""
        assert time.monotonic() < deadline, f"the job never reached step {step}"
        time.sleep(0.2)
    # Asked up to three times: on a loaded machine one status poll may miss a host (a host that does not answer in
    # time shows as unreachable for that poll).
    for _ in range(3):
        status = cli("status", "--inventory", str(cluster), timeout=120).stdout
        reached = _running_step(status)
        if reached is not None and reached >= step:
            return
        time.sleep(2)
    raise AssertionError(f"not every host shows the job running at step {step} (three polls):\n{status}")


def _stop(follower: subprocess.Popen[str], cluster: Path, job_id: str, make: Run, status_after: bool = True) -> None:
    """`make stop` and `make status` with the JOB_ID= the README shows (make hands it to the environment too)."""
    stopped = make("stop", f"INVENTORY={cluster}", f"JOB_ID={job_id}", timeout=200)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"job {job_id}: no process of it is left on tb1, tb2, tb3" in " ".join(stopped.stdout.split())
    assert not job_processes(job_id), job_processes(job_id)
    follower.wait(timeout=120)  # the follower sees every host stopped, collects the logs and ends
    if not status_after:
        return
    status = make("status", f"INVENTORY={cluster}", f"JOB_ID={job_id}", timeout=120)
    assert status.returncode == 0 and "awx_display" not in status.stdout + status.stderr, status.stderr
    assert status.stdout.count("stopped") == 3, status.stdout


def test_stop_mid_run_leaves_no_process_and_resume_continues(
    cluster: Path, testbed: Any, long_job_file: Path, ugro_train: Run, make: Run
) -> None:
    follower = _follow(long_job_file, cluster)
    try:
        _wait_running(follower, cluster, testbed, long_job_file, 6)  # past the first periodic checkpoint (5)
        job_id = newest_run("cluster-stop-test").name
        assert len(job_processes(job_id)) >= 6  # 3 launch scripts + 3 torchruns, + workers

        second = ugro_train("train", "--job", str(long_job_file), "--inventory", str(cluster), timeout=200)
        assert second.returncode == 1
        for host in ("tb1", "tb2", "tb3"):
            assert f"{host} already runs job {job_id}" in " ".join(second.stderr.split()), second.stderr
        _stop(follower, cluster, job_id, make)
    finally:
        _end(follower)
    stopped_at = read_metrics(runs_dir() / job_id)[-1]["step"]
    assert stopped_at >= 6

    resumed = _follow(long_job_file, cluster, "RESUME=auto")
    try:
        _wait_running(resumed, cluster, testbed, long_job_file, stopped_at + 3)
        assert _latest() == job_id
        _stop(resumed, cluster, job_id, make, status_after=False)  # the first stop checked `make status`'s rows
    finally:
        _end(resumed)
    main_log = (runs_dir() / job_id / "logs" / "tb1-rank0.log").read_text()
    found = re.search(r"resumed from \S+/checkpoints/step-0*(\d+) at step (\d+)", main_log)
    assert found is not None, main_log[-2000:]
    # The second launch went on from the newest intact checkpoint: the one the stop wrote at the step it landed on,
    # or, had the stop cut that write short (the step's metrics row is written before its checkpoint), the last
    # periodic one before it (every 5 steps).
    periodic = (stopped_at - 1) // 5 * 5
    assert found[1] == found[2] and int(found[2]) in (stopped_at, periodic), (found[0], stopped_at)
    steps = [r["step"] for r in read_metrics(runs_dir() / job_id)]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= stopped_at + 3, steps


def _latest() -> str:
    return (runs_dir() / "latest").readlink().name


def test_three_hosts_train_and_the_controller_gets_every_log(unbroken_run: tuple[Path, Any], testbed: Any) -> None:
    run_dir, result = unbroken_run
    assert "restart" not in result.stdout, result.stdout[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["restarts"] == []
    rows = read_metrics(run_dir)  # fetched from the main host
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


def test_a_global_batch_smaller_than_the_ranks_is_refused_before_anything_starts(
    testbed: Any, repo_jobs: Path, ugro: Run
) -> None:
    """The default job's global batch (4) on the 3 test hosts with the default 2 CPU workers each (6 ranks):
    `make validate INVENTORY=...` and `make train` say so from the fast preflight, and nothing starts."""
    inventory = Path(testbed.inventory)  # no ugro_cpu_procs_per_node: the default, 2 per host
    job = cluster_job(repo_jobs, "ranks-test", train={"global_batch_size": 4})
    try:
        for command in ("validate", "train"):
            result = ugro(command, "--job", str(job), "--inventory", str(inventory), timeout=300)
            flat = " ".join(result.stderr.split())
            assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
            assert (
                f"train.global_batch_size is 4, but {inventory} will start 6 ranks (tb1: 2, tb2: 2, tb3: 2)" in flat
            ), flat
            assert "Raise train.global_batch_size to 6 or more" in flat and "ugro_cpu_procs_per_node" in flat
            assert "Traceback" not in result.stderr
        assert not list(runs_dir().glob("ranks-test-*")), "nothing may start"
    finally:
        job.unlink()


def test_an_inventory_with_an_unreachable_host_is_refused_naming_it_before_the_plan(
    cluster: Path, repo_jobs: Path, ugro: Run
) -> None:
    """A fourth host that does not answer (an address of the test subnet that no host holds): `make train` refuses
    the launch naming it and how to fix it, before the memory plan could count it as a card of 0 GiB; nothing
    starts."""
    data = yaml.safe_load(cluster.read_text())
    hosts = data["all"]["children"]["ugro_cluster"]["hosts"]
    nobody = str(ipaddress.IPv4Interface(f"{hosts['tb3']['ansible_host']}/24").network[250])
    hosts["tb4"] = hosts["tb3"] | {"ansible_host": nobody, "ugro_cluster_address": nobody}
    inventory = cluster.parent / "cluster-unreachable.yml"
    inventory.write_text(yaml.safe_dump(data))
    job = cluster_job(repo_jobs, "unreachable-test")
    try:
        result = ugro("train", "--job", str(job), "--inventory", str(inventory), timeout=300)
        flat = " ".join(result.stderr.split())
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
        assert "not launching: tb4 is unreachable" in flat, flat
        assert "`ssh tb4`" in flat and f"take tb4 out of ugro_cluster in {inventory}" in flat, flat
        assert "the cluster has" not in flat and "plan:" not in result.stdout, "refused before the memory plan"
        assert "Traceback" not in result.stderr
        assert not list(runs_dir().glob("unreachable-test-*/hosts")), "nothing may start"
    finally:
        job.unlink()
        remove_runs("unreachable-test")
