"""A job survives lost hosts: real faults on the 3-host test cluster, mid-run, with and without its controller.

One run takes three faults in a row, each once the job has clearly moved on from the last recovery:
a worker process SIGKILLed on tb3 (the host stays up: the controller tells tb1 and tb2 to go on without it, tb3's
launcher starts its rank again and it rejoins them, nobody relaunched, nothing redone). Then the controller
dies (SIGKILL of its whole process group, as a laptop that lost power) and every job process on tb2 is SIGKILLed
between two checkpoints (a host that died): with no controller to name them, the ranks on tb1 and tb3 agree among
themselves and go on in the same processes, nothing redone, with identical weights. Then tb1's link is cut inside
its namespace (the main host, which keeps the run's records; tb1 and tb3 alone cannot tell which of
them was cut off, so they wait for a controller) and `ugro follow` takes the run up: it records tb2's fault from
the ranks' own record and names tb3 alone, whose rank goes on in the same process, nothing redone, and takes the
records up from the rows it kept itself. The run must finish every step, record each restart with its host and
cause, bring what the main rank wrote on tb3 (adapter, samples, TensorBoard events) to the controller, end within
noise of the same job run without faults, and leave no process behind once the cut-off tb1 gave up. A second job
with no restarts left ends failed with the cause and leaves nothing running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    PYTHON,
    REPO,
    cli,
    cluster_job,
    host_step,
    job_processes,
    newest_run,
    remove_runs,
    run_env,
    runs_dir,
    wait_for_step,
)

from testbed import cluster as tb
from train.metrics import read_metrics

# Every test follows a real `ugro train` (started with Popen in _follow).
pytestmark = pytest.mark.usefixtures("ugro_train")

HOSTS = ("tb1", "tb2", "tb3")


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
        start_new_session=True,  # the controller's process group, playbooks included, ends with one signal
    )  # fmt: skip


def _left_behind(testbed: Any, job_id: str) -> str:
    """What is left of the job on this machine, with where each process waits, and the end of tb1's logs; "" when
    nothing is."""
    lines: list[str] = []
    for pid, cmdline in job_processes(job_id).items():
        state = next((x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("State")), "")
        waits = sorted({(t / "wchan").read_text() for t in Path(f"/proc/{pid}/task").iterdir()})
        lines.append(f"{pid}: {cmdline} [{state}; threads wait in {', '.join(waits)}]")
    logs = testbed.dir / "tb1" / "opt" / "ugro" / "runs" / job_id / "hosts" / "tb1"
    for log in sorted(logs.glob("*.log")) if lines and logs.is_dir() else []:
        lines.append(f"--- {log.name}: " + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(lines)


@pytest.fixture()
def faults_job(repo_jobs: Path) -> Iterator[Path]:
    # How long the survivors look for who is left: tb1 and tb3 first wait out a controller that just died (three of
    # its 2-s polls and 10 s: train/recovery/consensus.py), then for `ugro follow` to start and name tb3 alone; the
    # cut-off tb1 gives up after it (its collective's timeout_s, then this).
    # One held-out answer before and after, written by whichever rank is the main one at the end.
    held_out = {"source": "data/sample/eval.jsonl", "every": 100, "samples": 1, "max_new_tokens": 8}
    path = cluster_job(repo_jobs, "cluster-faults", train={"max_restarts": 3}, distributed={"regroup_timeout_s": 45},
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
        job_id = wait_for_step(testbed, "cluster-faults", 7, follower)
        assert tb.kill_ranks(testbed.dir, "tb3"), "no rank on tb3"
        crashed = time.monotonic()
        wait_for_step(testbed, "cluster-faults", 14, follower)
        # The controller's record has the fault while the run goes on (a controller that re-attaches reads it). The
        # survivors go on as soon as the controller's word reaches their hosts, a moment before its playbook returns
        # and the controller writes the record: it may come a few steps later.
        record = runs_dir() / job_id / ".control" / "supervision.json"
        deadline = time.monotonic() + 60
        while not (so_far := json.loads(record.read_text()))["restarts"] and time.monotonic() < deadline:
            assert follower.poll() is None, "the controller ended"
            time.sleep(0.5)
        assert [r["cause"]["host"] for r in so_far["restarts"]][:1] == ["tb3"], so_far
        # tb3's rank came back: the group took it in again (generation 2, after tb1 and tb2 went on without it).
        while not all(_generation(testbed, job_id, h) == 2 for h in HOSTS):
            assert time.monotonic() < deadline + 120 and follower.poll() is None, "tb3's rank did not rejoin"
            time.sleep(0.2)
        rejoined = {h: _rank_record(testbed, job_id, h)["regrouped"] for h in HOSTS}
        print(f"tb3's rank back in the group {time.monotonic() - crashed:.1f} s after its kill, from step "
              f"{rejoined['tb3']['from_step']}")  # fmt: skip
        os.killpg(follower.pid, signal.SIGKILL)  # the controller, its polls and playbooks: gone without a word
        follower.wait()
        before = {h: tb.host_ranks(testbed.dir, h) for h in ("tb1", "tb3")}
        assert tb.kill_processes(testbed.dir, "tb2", f"/opt/ugro/runs/{job_id}"), "no job process on tb2"
        # The survivors wait for the controller while its last poll is recent (three polls and 10 s), then agree.
        killed = time.monotonic()
        while not all(_generation(testbed, job_id, h) == 3 for h in ("tb1", "tb3")):
            assert time.monotonic() < killed + 90, "tb1 and tb3 did not regroup without a controller"
            time.sleep(0.2)
        regrouped_after_s = time.monotonic() - killed
        survivors = {h: tb.host_ranks(testbed.dir, h) for h in ("tb1", "tb3")}
        step = host_step(testbed, job_id)
        wait_for_step(testbed, "cluster-faults", step + 2, None)  # on in the new group (its weights recorded)
        records = {h: _rank_record(testbed, job_id, h) for h in ("tb1", "tb3")}
        weights = [r["regrouped"].get("weights") for r in records.values()]
        # tb1's link cut: tb1 and tb3 alone cannot tell which of them is cut off, and wait for a controller.
        tb.set_link(testbed.dir, "tb1", up=False)
        cut = time.monotonic()
        follower = subprocess.Popen(
            [PYTHON, "-m", "ugro.cli", "follow", "--job-id", job_id], cwd=REPO, env=run_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        print(f"step {step}: regrouped {regrouped_after_s:.1f} s after tb2's kill; tb1 cut at step {step + 2}")
        deadline = time.monotonic() + 240
        while _generation(testbed, job_id, "tb3") < 4:
            assert time.monotonic() < deadline and follower.poll() is None, "tb3 did not regroup without tb1"
            time.sleep(0.5)
        alone = tb.host_ranks(testbed.dir, "tb3")
        out, _ = follower.communicate(timeout=600)
        ended = time.monotonic()
        # tb1, cut off, gives up on its own: its collective times out, then no membership reaches it.
        gives_up = cut + 20 + 45 + 150  # distributed.timeout_s, regroup_timeout_s, and slack for a loaded machine
        while job_processes(job_id) and time.monotonic() < gives_up:
            time.sleep(1)
        left = _left_behind(testbed, job_id)
        gone_s = time.monotonic() - cut
        print(f"the run ended {ended - cut:.0f} s after tb1's cut; the job's last processes {gone_s:.0f} s after it")
    finally:
        tb.set_link(testbed.dir, "tb1", up=True)
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
    assert follower.returncode == 0, out[-6000:]

    run_dir = runs_dir() / job_id
    record = json.loads((run_dir / "run.json").read_text())
    restarts = record["restarts"]
    assert [(r["cause"]["kind"], r["cause"]["host"]) for r in restarts] == [
        ("crashed", "tb3"),
        ("rejoined", "tb3"),
        ("lost", "tb2"),
        ("unreachable", "tb1"),
    ], json.dumps(restarts, indent=1)
    # tb1 and tb2 went on without tb3 until its rank was back, then tb2 was left out, then tb1 after its link
    # went: tb3 keeps the run. Nobody relaunched.
    assert [r["hosts_after"] for r in restarts] == [["tb1", "tb2"], ["tb1", "tb2", "tb3"], ["tb1", "tb3"], ["tb3"]]
    assert [r["main_host"] for r in restarts] == ["tb1", "tb1", "tb1", "tb3"]
    assert {r["how"] for r in restarts} == {"regroup"}
    assert [r["decided_by"] for r in restarts] == ["controller", "rejoin", "survivors", "controller"]
    # `ugro follow` shows the fault it did not see, from the ranks' record, and the one it handled.
    said = " ".join(out.split())
    assert "regrouped by the survivors themselves on tb1, tb3" in said and "restart 4: unreachable on tb1" in said
    # tb3's crashed rank cost nothing: the group went on and took it back in at the step it had reached, with the
    # same weights on every rank.
    assert restarts[0]["steps_redone"] == 0 and restarts[1]["steps_redone"] == 0, restarts
    assert rejoined["tb3"]["from_step"] == rejoined["tb1"]["from_step"] >= 7, rejoined
    assert len({json.dumps(r.get("weights"), sort_keys=True) for r in rejoined.values()}) == 1, rejoined
    # Without tb2, the ranks on tb1 and tb3 went on in the processes they had, from the step they had reached,
    # with the same weights.
    assert survivors == before and all(before.values()), (before, survivors)
    assert restarts[2]["steps_redone"] == 0 and restarts[2]["resumed_from_step"] >= 14, restarts[2]
    assert weights[0] == weights[1] and weights[0] is not None, weights
    # Without tb1, tb3's rank went on in its process from the step it had reached.
    assert alone == survivors["tb3"], (alone, survivors)
    assert restarts[3]["steps_redone"] == 0 and restarts[3]["resumed_from_step"] >= step + 2, restarts[3]
    assert record["state"] == "finished" and record["hosts"] == ["tb3"]

    rows = read_metrics(run_dir)
    assert sorted({r["step"] for r in rows}) == list(range(1, 31))  # every step done (once in the final record)
    # What the main rank wrote on tb3, the main host after tb1's cut, reached the controller's run directory.
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert "**Fine-tuned:**" in (run_dir / "samples.md").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")) and (run_dir / "loss.png").is_file()
    unbroken = read_metrics(unbroken_run[0])
    broken_end, unbroken_end = (sum(r["loss"] for r in x[-5:]) / 5 for x in (rows, unbroken))
    assert abs(broken_end - unbroken_end) < 0.05 * unbroken_end, (broken_end, unbroken_end)
    assert not left, f"left of the job after tb1 gave up:\n{left}"


def test_with_no_restarts_left_the_run_fails_with_its_cause_and_nothing_runs(
    testbed: Any, cluster: Path, doomed_job: Path
) -> None:
    follower = _follow(doomed_job, cluster)
    try:
        job_id = wait_for_step(testbed, "cluster-doomed", 3, follower)
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
