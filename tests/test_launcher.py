"""train/launcher.py, as the launch script starts it: torchrun's arguments and static rendezvous; on this machine
(no GPU) the ranks are forked from the launcher, and torchrun's ways of ending a job still hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import PYTHON, REPO, run_env, write_job

from testbed.net import free_port
from train import launcher

pytestmark = pytest.mark.usefixtures("torchrun")


def _launch(job: Path, run_dir: Path, nproc: int = 2) -> subprocess.Popen[str]:
    argv = [PYTHON, "-m", "train.launcher", "--nnodes=1", "--node-rank=0", f"--nproc-per-node={nproc}",
            "--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=launcher-test",
            "--max-restarts=0", "--module", "train.worker", "--job", str(job), "--run-dir", str(run_dir),
            "--code-dir", str(REPO)]  # fmt: skip
    env = {k: v for k, v in run_env().items() if k != "OMP_NUM_THREADS"}  # as the launch script leaves it by default
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _parent_and_name(pid: int) -> tuple[int, str]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1]), Path(f"/proc/{pid}/comm").read_text().strip()


def test_ranks_are_forked_from_the_launcher_and_a_stop_ends_them_as_under_torchrun(tmp_path: Path) -> None:
    assert not launcher.has_gpu(), "this test is about hosts without a GPU"
    job = write_job(tmp_path / "job.yaml", train={"max_steps": 500})
    run_dir = tmp_path / "run"
    proc = _launch(job, run_dir)
    try:
        pid_files = [run_dir / "hosts" / os.uname().nodename / f"worker-rank{r}.pid" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not (all(p.is_file() for p in pid_files) and (run_dir / "metrics.jsonl").is_file()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        ranks = [int(p.read_text().split()[0]) for p in pid_files]  # "pid start"
        assert [_parent_and_name(pid) for pid in ranks] == [(proc.pid, "ugro-rank0"), (proc.pid, "ugro-rank1")]
        # Forked: in the launch's own process group (torchrun starts each new interpreter in a session of its own),
        # with the launcher's command line.
        assert [os.getpgid(pid) for pid in ranks] == [proc.pid, proc.pid]
        assert {Path(f"/proc/{pid}/cmdline").read_bytes() for pid in ranks} == {
            Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        }
        # Two ranks on one host get one thread each from torchrun, although the launcher imported torch before.
        for rank in (0, 1):
            log = (run_dir / "logs" / f"{os.uname().nodename}-rank{rank}.log").read_text()
            assert "cpu_threads=1 " in log, log
        os.killpg(proc.pid, signal.SIGTERM)  # what make stop sends the launch's process group
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-3000:]
    failures = (run_dir / "hosts" / os.uname().nodename / "failures.jsonl").read_text().splitlines()
    assert {json.loads(line)["kind"] for line in failures} == {"stopped"}, failures
    assert json.loads((run_dir / "run.json").read_text())["state"] == "stopped"


def test_a_rank_that_fails_fails_the_launch_with_the_ranks_exit_code_in_its_log(tmp_path: Path) -> None:
    proc = _launch(tmp_path / "missing.yaml", tmp_path / "run", nproc=1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    assert "exitcode  : 2" in out, out[-3000:]  # train/worker.py: 2, a bad configuration
