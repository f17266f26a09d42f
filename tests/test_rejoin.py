"""A rank that crashes on a host that stays up comes back into the running group: the other hosts never relaunch.

Three "hosts" on this machine, each a real launcher (train/launcher.py: torchrun with the static rendezvous, as the
launch script runs it) with one rank, told apart by UGRO_HOST, gloo over loopback, and no controller. h2's rank is
SIGKILLed with its gradient all-reduce of step 6 under way (tests/fixtures/faulty_worker.py). The others find its
store refused and go on without it; h2's launcher starts its rank again in join mode, which asks h1 to come back in,
and after one of their steps all three form the grown group, h2 taking the step, weights and optimizer state. The
multi-host version with the controller, SSH and network namespaces is tests/test_recovery.py.
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
from helpers import free_port, host_launcher, write_job

from train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("torchrun")

HOSTS = ("h1", "h2", "h3")
STEPS = 24


def _pids(run_dir: Path, host: str) -> list[int]:
    return [int(p.read_text().split()[0]) for p in (run_dir / "hosts" / host).glob("worker-rank*.pid")]


def _launch(host: str, port: int, job: Path, run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    return host_launcher(HOSTS, host, port, job, run_dir, log, {"UGRO_TEST_DIE": "h2:allreduce:6"})


# A preference job crashes and comes back the same way: its state is the adapter and optimizer as SFT's, each rank's
# reference cache its own (train/preference/reference.py).
PAIRS = {"data": {"source": "data/preference/train.jsonl", "format": "preference", "packing": False, "seq_len": 96},
         "rank_local": {"micro_batch_size": 4}}  # fmt: skip


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_a_crashed_rank_comes_back_and_the_others_never_stop(tmp_path: Path, method: str) -> None:
    extra = PAIRS if method == "dpo" else {}
    train = {"max_steps": STEPS, "global_batch_size": 6, "log_every": 1, "seed": 7, "method": method}
    job = write_job(tmp_path / "job.yaml", train=train, checkpoint={"every": 10, "keep_last": 1},
                    distributed={"timeout_s": 60}, eval=None, **extra)  # fmt: skip
    run_dir = tmp_path / "run"
    port = free_port()
    for host in HOSTS:
        (run_dir / "hosts" / host).mkdir(parents=True)
    agents = {h: _launch(h, port, job, run_dir, tmp_path / f"{h}.log") for h in HOSTS}
    try:
        deadline = time.monotonic() + 300
        while not all(_pids(run_dir, h) for h in HOSTS):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        first = {h: _pids(run_dir, h) for h in HOSTS}
        while agents["h2"].poll() is None:  # h2's launcher ends once its second rank finished the run
            assert time.monotonic() < deadline, (tmp_path / "h2.log").read_text()[-3000:]
            time.sleep(0.2)
        assert agents["h2"].returncode == 0, (tmp_path / "h2.log").read_text()[-3000:]
        record = json.loads((run_dir / "run.json").read_text())
        assert record["state"] == "finished", record
        # h1 and h3 ran every step in the processes they started with: no relaunch.
        assert {h: _pids(run_dir, h) for h in ("h1", "h3")} == {h: first[h] for h in ("h1", "h3")}
    finally:
        for agent in agents.values():
            if agent.poll() is None:  # the survivors' agents wait at torchrun's exit barrier for h2's first one
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for host in HOSTS:
            for pid in _pids(run_dir, host):
                if psutil.pid_exists(pid):
                    with contextlib.suppress(ProcessLookupError):  # gone between the look and the kill
                        os.kill(pid, signal.SIGKILL)

    history = [(r["generation"], r["hosts"], r["decided_by"]) for r in record["regroups"]]
    assert history == [(1, ["h1", "h3"], "survivors"), (2, ["h1", "h3", "h2"], "rejoin")], record["regroups"]
    back = record["regroups"][1]
    assert back["from_step"] >= 6 and back["cause"] == "h2 came back", back
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: nothing redone
    # h2 keeps the run's rows too (should it take the records up), the steps it missed while away included.
    assert [r["step"] for r in read_metrics(run_dir / "hosts" / "h2")] == list(range(1, STEPS + 1))
    ranks = {h: json.loads(next((run_dir / "hosts" / h).glob("rank*.json")).read_text()) for h in HOSTS}
    # The three ranks trained on the same weights after h2 came back; h2 was rank 1, it is rank 2 now.
    weights = {h: r["regrouped"]["weights"] for h, r in ranks.items()}
    assert weights["h1"] == weights["h2"] == weights["h3"], weights
    assert ranks["h2"]["rank"] == 2 and ranks["h2"]["regrouped"]["decided_by"] == "rejoin"
    # The last steps' shares count three ranks again.
    assert rows[-1]["ranks"]["host"] == ["h1", "h3", "h2"], rows[-1]
    h2_log = (tmp_path / "h2.log").read_text()
    assert "starting this host's ranks again to rejoin the run (1 of 2)" in h2_log, h2_log[-3000:]
    assert not (run_dir / "hosts" / "h2" / "rejoin.json").exists()  # the note is answered once it is back
