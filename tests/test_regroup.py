"""Survivors of a lost rank go on in their own processes, nothing redone, with identical weights.

Five "hosts" on this machine (five torchrun agents, one rank each, told apart by UGRO_HOST, gloo over
loopback) run a real job that no controller follows. The faults are real signals at exact points of a step
(tests/fixtures/faulty_worker.py): h2 dies with its gradient all-reduce under way, h4 in the middle of its
optimizer step: the survivors find their stores refused and agree among themselves who is left
(train/recovery/consensus.py). Then h5 freezes (SIGSTOP: its store still accepts connects, so no survivor can tell it
from a slow one) after its step, while the others gather every rank's RNG state for a checkpoint; the test then
plays the controller and writes the survivors' membership file, as playbooks/regroup.yml does, and they leave
that gather at once, not at the collective timeout. The multi-host version with the real controller, SSH and
network namespaces is tests/test_recovery.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import PYTHON, REPO, free_port, run_env, write_job

from train.metrics import read_metrics

# Real torchrun and ranks (the `torchrun` marker: not in the fast tier).
pytestmark = pytest.mark.usefixtures("torchrun")

HOSTS = ("h1", "h2", "h3", "h4", "h5")
STEPS = 24


def _pid(run_dir: Path, host: str) -> int | None:
    files = list((run_dir / "hosts" / host).glob("worker-rank*.pid"))
    return int(files[0].read_text().split()[0]) if files else None  # "pid start"


def _tell(run_dir: Path, generation: int, hosts: list[str]) -> None:
    for host in hosts:
        path = run_dir / "hosts" / host / "membership.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"generation": generation, "hosts": hosts, "main": "h1"}))
        os.replace(tmp, path)


def _running(pid: int) -> bool:
    """Whether rank ``pid`` still runs: not gone (also between the two looks), not a zombie, not frozen (SIGSTOP)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED)
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pid: int, agents: dict[str, subprocess.Popen[bytes]], deadline: float) -> None:
    """Until the rank ``pid`` died, or froze itself (SIGSTOP)."""
    while _running(pid):
        assert time.monotonic() < deadline, f"rank {pid} did not die or stop"
        assert all(a.poll() in (None, 0, 1) for a in agents.values())
        time.sleep(0.05)


def test_survivors_of_kills_in_the_all_reduce_the_optimizer_and_a_checkpoint_go_on_identical(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", train={"max_steps": STEPS, "global_batch_size": 8, "log_every": 1,
                                                   "seed": 7}, checkpoint={"every": 8, "keep_last": 1},
                    distributed={"timeout_s": 60}, eval=None)  # fmt: skip
    run_dir = tmp_path / "run"
    port = free_port()
    agents: dict[str, subprocess.Popen[bytes]] = {}
    for host in HOSTS:
        (run_dir / "hosts" / host).mkdir(parents=True)
        env = run_env() | {
            "UGRO_HOST": host,
            "UGRO_MAIN_HOST": "1" if host == "h1" else "0",
            "OMP_NUM_THREADS": "1",
            "UGRO_CLUSTER_ADDRESS": "127.0.0.1",
            "UGRO_TEST_DIE": "h2:allreduce:6,h4:optimizer:12,h5:checkpoint:16",
        }
        argv = [PYTHON, "-m", "torch.distributed.run", f"--nnodes={len(HOSTS)}", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=regroup", "--max-restarts=0",
                f"--rdzv-conf=is_host={int(host == 'h1')}",  # h1's agent holds the store, as on a cluster
                "--module", "tests.fixtures.faulty_worker", "--job", str(job), "--run-dir", str(run_dir),
                "--code-dir", str(REPO)]  # fmt: skip
        log = (tmp_path / f"{host}.log").open("wb")
        agents[host] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
    pids: dict[str, int | None] = {}
    try:
        deadline = time.monotonic() + 240
        while any(_pid(run_dir, h) is None for h in HOSTS):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pids = {h: _pid(run_dir, h) for h in HOSTS}
        left = list(HOSTS)
        for generation, lost in enumerate(("h2", "h4", "h5"), start=1):
            _wait_gone(pids[lost] or 0, agents, deadline)
            left.remove(lost)
            if lost == "h5":  # frozen: only a controller can tell
                _tell(run_dir, generation, left)
        while agents["h1"].poll() is None and json.loads((run_dir / "run.json").read_text()).get("state") != "finished":
            assert time.monotonic() < deadline, (tmp_path / "h1.log").read_text()[-3000:]
            time.sleep(0.2)
        # The frozen h5 ends now, so that the survivors' abandoned gather fails and they exit without waiting for its
        # timeout (``Watcher.settle``).
        os.kill(pids["h5"] or 0, signal.SIGKILL)
        # The survivors ran every step in the processes they started with; torchrun's agents then wait at their
        # exit barrier for the lost hosts' agents (the controller ends them), so the test ends them too.
        assert {h: _pid(run_dir, h) for h in left} == {h: pids[h] for h in left}
        while any(psutil.pid_exists(pids[h] or 0) for h in left):
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        if psutil.pid_exists(pids.get("h5") or 0):
            with contextlib.suppress(ProcessLookupError):  # frozen: its session is not its agent's
                os.kill(pids["h5"] or 0, signal.SIGKILL)
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()

    record = json.loads((run_dir / "run.json").read_text())
    assert record["state"] == "finished", record
    assert record["regrouped"]["generation"] == 3 and record["regrouped"]["hosts"] == ["h1", "h3"]
    # The main rank's history of the launch: who was left after each fault, and who said so.
    history = [(r["generation"], r["hosts"], r["decided_by"]) for r in record["regroups"]]
    assert history == [(1, ["h1", "h3", "h4", "h5"], "survivors"), (2, ["h1", "h3", "h5"], "survivors"),
                       (3, ["h1", "h3"], "controller")], record["regroups"]  # fmt: skip
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: nothing redone
    assert all(r["loss"] == r["loss"] for r in rows)
    records = {h: json.loads(next((run_dir / "hosts" / h).glob("rank*.json")).read_text()) for h in left}
    weights = {h: record["regrouped"]["weights"] for h, record in records.items()}
    assert weights["h1"] == weights["h3"] and weights["h1"]["step"] > 16, weights
    logs = {h: (run_dir / "logs").glob(f"{h}-rank*.log") for h in left}
    text = "\n".join(p.read_text() for paths in logs.values() for p in paths)
    decided = ("survivors", "survivors", "controller")
    assert all(f"regroup {g} ({by} decided): rank" in text for g, by in enumerate(decided, 1)), text[-3000:]
    # The frozen h5 sends nothing: the gather ended because the controller named who is left, not at its timeout.
    assert "step 17: the group lost a member (GroupLost: the controller named a new membership (generation 3" in text
