"""A job survives lost hosts: real faults on the 3-host test cluster, mid-run, and the controller recovers.

One run takes three faults in a row, each once the job has clearly moved on from the last recovery:
a worker process SIGKILLed on tb3 (the host stays up: restarted in place), every job process on tb2
SIGKILLed between two checkpoints (a host that died: the ranks on tb1 and tb3 go on in the same processes,
nothing redone, with identical weights), then tb1's link cut inside its namespace (the rendezvous and main
host, which keeps the run's records: tb3's rank goes on alone in the same process, nothing redone, and takes
the records up from the rows it kept itself). The run must finish every step, record each restart with its
host and cause, bring what the main rank wrote on tb3 (adapter, samples, TensorBoard events) to the controller,
and end within noise of the same job run without faults. A second job with no restarts
left ends failed with the cause and leaves nothing running.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import PYTHON, REPO, cli, cluster_job, job_processes, newest_run, remove_runs, run_env, runs_dir

from testbed import cluster as tb
from train.metrics import read_metrics

# Every test follows a real `ugro train` (started with Popen in _follow).
pytestmark = pytest.mark.usefixtures("ugro_train")

HOSTS = ("tb1", "tb2", "tb3")
EVERY = 5  # the cluster job's checkpoint interval


def _host_step(testbed: Any, job_id: str) -> int:
    """The newest step any host's metrics.jsonl records (read from the hosts' own disks)."""
    step = 0
    for host in HOSTS:
        path = testbed.dir / host / "opt" / "ugro" / "runs" / job_id / "metrics.jsonl"
        try:
            step = max(step, int(json.loads(path.read_text().splitlines()[-1])["step"]))
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return step


def _wait_for_step(testbed: Any, name: str, step: int, follower: subprocess.Popen[str], timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        assert follower.poll() is None, follower.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"the job never reached step {step}"
        runs = sorted(runs_dir().glob(f"{name}-*"))
        if runs and _host_step(testbed, runs[-1].name) >= step:
            return runs[-1].name
        time.sleep(0.2)


def _rank_record(testbed: Any, job_id: str, host: str) -> dict[str, Any]:
    """The newest rank status file on ``host``'s own disk."""
    folder = testbed.dir / host / "opt" / "ugro" / "runs" / job_id / "hosts" / host
    return dict(json.loads(max(folder.glob("rank*.json"), key=lambda p: p.stat().st_mtime).read_text()))


def _generation(testbed: Any, job_id: str, host: str) -> int:
    """The newest regroup the ranks on ``host`` went through (0: none yet, or no rank file right now: a regrouped
    rank whose number changed writes its new file at its next step)."""
    try:
        return int((_rank_record(testbed, job_id, host).get("regrouped") or {}).get("generation") or 0)
    except (ValueError, OSError):
        return 0


def _follow(job: Path, cluster: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "ugro.cli", "train", "--job", str(job), "--inventory", str(cluster), "--poll", "2",
         "--skip-preflight"],
        cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.fixture()
def faults_job(repo_jobs: Path) -> Iterator[Path]:
    # The cut-off tb1 waits this long for a membership that cannot reach it, after its collective timed out.
    # One held-out answer before and after, written by whichever rank is the main one at the end.
    held_out = {"source": "data/sample/eval.jsonl", "every": 100, "samples": 1, "max_new_tokens": 8}
    path = cluster_job(repo_jobs, "cluster-faults", train={"max_restarts": 3}, distributed={"regroup_timeout_s": 20},
                       eval=held_out)  # fmt: skip
    yield path
    path.unlink()
    remove_runs("cluster-faults")


@pytest.fixture()
def doomed_job(repo_jobs: Path) -> Iterator[Path]:
    path = cluster_job(repo_jobs, "cluster-doomed", train={"max_steps": 200, "max_restarts": 0})
    yield path
    path.unlink()
    remove_runs("cluster-doomed")


def test_three_faults_in_one_run_and_the_job_finishes_every_step(
    testbed: Any, cluster: Path, faults_job: Path, unbroken_run: tuple[Path, Any]
) -> None:
    follower = _follow(faults_job, cluster)
    try:
        job_id = _wait_for_step(testbed, "cluster-faults", 7, follower)
        assert tb.kill_ranks(testbed.dir, "tb3"), "no rank on tb3"
        _wait_for_step(testbed, "cluster-faults", 14, follower)
        before = {h: tb.host_ranks(testbed.dir, h) for h in ("tb1", "tb3")}
        assert tb.kill_processes(testbed.dir, "tb2", f"/opt/ugro/runs/{job_id}"), "no job process on tb2"
        _wait_for_step(testbed, "cluster-faults", 21, follower)
        survivors = {h: tb.host_ranks(testbed.dir, h) for h in ("tb1", "tb3")}
        records = {h: _rank_record(testbed, job_id, h) for h in ("tb1", "tb3")}
        if not all(r.get("regrouped") for r in records.values()):  # say what the controller did instead
            follower.kill()
            raise AssertionError(f"tb1 and tb3 did not regroup: {records}\n{follower.communicate()[0][-5000:]}")
        weights = [r["regrouped"]["weights"] for r in records.values()]
        # The controller's record has both restarts while the run goes on (a controller that re-attaches reads it).
        supervision = runs_dir() / job_id / ".control" / "supervision.json"
        deadline = time.monotonic() + 30
        while len(json.loads(supervision.read_text())["restarts"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        so_far = json.loads(supervision.read_text())
        assert [r["cause"]["host"] for r in so_far["restarts"]] == ["tb3", "tb2"], so_far
        assert so_far["hosts"] == ["tb1", "tb3"] and so_far["rendezvous"] == "tb1", so_far
        tb.set_link(testbed.dir, "tb1", up=False)
        deadline = time.monotonic() + 240
        while _generation(testbed, job_id, "tb3") < 2:
            assert time.monotonic() < deadline and follower.poll() is None, "tb3 did not regroup without tb1"
            time.sleep(0.5)
        alone = tb.host_ranks(testbed.dir, "tb3")
        out, _ = follower.communicate(timeout=600)
    finally:
        tb.set_link(testbed.dir, "tb1", up=True)
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, out[-6000:]

    run_dir = runs_dir() / job_id
    record = json.loads((run_dir / "run.json").read_text())
    restarts = record["restarts"]
    assert [(r["cause"]["kind"], r["cause"]["host"]) for r in restarts] == [
        ("vanished", "tb3"),
        ("lost", "tb2"),
        ("unreachable", "tb1"),
    ], json.dumps(restarts, indent=1)
    # tb3 stayed in (restarted in place), tb2 was left out, then tb1 after its link went: tb3 keeps the run.
    assert [r["hosts_after"] for r in restarts] == [["tb1", "tb2", "tb3"], ["tb1", "tb3"], ["tb3"]]
    assert [r["rendezvous"] for r in restarts] == ["tb1", "tb1", "tb3"]
    assert [r["how"] for r in restarts] == ["relaunch", "regroup", "regroup"]
    assert [r["decided_by"] for r in restarts] == ["controller", "controller", "controller"]  # it followed throughout
    assert restarts[0]["steps_redone"] <= EVERY, restarts
    # Without tb2, the ranks on tb1 and tb3 went on in the processes they had, from the step they had reached,
    # with the same weights.
    assert survivors == before and all(before.values()), (before, survivors)
    assert restarts[1]["steps_redone"] == 0 and restarts[1]["resumed_from_step"] >= 14, restarts[1]
    assert weights[0] == weights[1] and weights[0] is not None, weights
    # Without tb1, tb3's rank went on in its process from the step it had reached.
    assert alone == survivors["tb3"], (alone, survivors)
    assert restarts[2]["steps_redone"] == 0 and restarts[2]["resumed_from_step"] >= 21, restarts[2]
    assert record["state"] == "finished" and record["hosts"] == ["tb3"]
    assert "restart 3: unreachable on tb1" in " ".join(out.split())

    rows = read_metrics(run_dir)
    assert sorted({r["step"] for r in rows}) == list(range(1, 31))  # every step done (once in the final record)
    # What the main rank wrote on tb3, the main host after tb1's cut, reached the controller's run directory.
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert "**Fine-tuned:**" in (run_dir / "samples.md").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")) and (run_dir / "loss.png").is_file()
    unbroken = read_metrics(unbroken_run[0])
    broken_end, unbroken_end = (sum(r["loss"] for r in x[-5:]) / 5 for x in (rows, unbroken))
    assert abs(broken_end - unbroken_end) < 0.05 * unbroken_end, (broken_end, unbroken_end)

    # tb1, cut off, gave up on its own (collective timeout, then no membership); nothing of the job is left.
    deadline = time.monotonic() + 90
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert not job_processes(job_id), job_processes(job_id)


def test_with_no_restarts_left_the_run_fails_with_its_cause_and_nothing_runs(
    testbed: Any, cluster: Path, doomed_job: Path
) -> None:
    follower = _follow(doomed_job, cluster)
    try:
        job_id = _wait_for_step(testbed, "cluster-doomed", 3, follower)
        assert tb.kill_ranks(testbed.dir, "tb2")
        out, _ = follower.communicate(timeout=300)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 1, out[-4000:]
    text = " ".join(out.split())
    assert "cause: vanished on tb2 rank" in text, out[-3000:]
    assert "restarts exhausted (0 of train.max_restarts=0)" in text, out[-3000:]
    record = json.loads((newest_run("cluster-doomed") / "run.json").read_text())
    assert record["state"] == "failed" and record["cause"]["host"] == "tb2", record
    assert not job_processes(job_id), job_processes(job_id)
    status = cli("status", "--inventory", str(cluster), "--job-id", job_id, timeout=120)
    assert "running" not in status.stdout, status.stdout
