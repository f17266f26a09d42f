"""Real 2-process torchrun runs on CPU (gloo): the loss falls, a killed run resumes exactly, NaN stops."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import REPO, Run, run_env, write_job

from train.metrics import read_metrics


def _loss_at(run_dir: Path, step: int) -> float:
    return next(row["loss"] for row in read_metrics(run_dir) if row["step"] == step)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, torchrun: Run) -> Path:
    """One uninterrupted run of the small job; several tests read it."""
    base = tmp_path_factory.mktemp("baseline")
    job = write_job(base / "job.yaml", train={"max_steps": 40})
    run_dir = base / "run"
    result = torchrun(job, run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_loss_falls_and_the_run_leaves_everything(baseline: Path) -> None:
    rows = read_metrics(baseline)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.85 * first, f"loss went from {first} to {last}"
    assert (baseline / "adapter" / "adapter_config.json").is_file()
    assert (baseline / "adapter" / "adapter_model.safetensors").is_file()
    assert [p.name for p in sorted((baseline / "checkpoints").iterdir())] == [
        "step-000010", "step-000020", "step-000030", "step-000040",
    ]  # fmt: skip
    assert list((baseline / "tensorboard").glob("events.out.tfevents.*"))
    assert len(list((baseline / "logs").glob("*-rank*.log"))) == 2
    assert (baseline / "loss.png").stat().st_size > 1000
    run = json.loads((baseline / "run.json").read_text())
    assert run["state"] == "finished"
    # What the model card tells (ugro/model/card.py): the resolved job, the data by hash and record count.
    assert run["job"]["train"]["max_steps"] == 40 and run["job"]["lora"]["r"] == 16 and run["job_file"]
    train_data = (REPO / "data" / "sample" / "train.jsonl").read_bytes()
    assert run["data"]["train"] == {
        "source": "data/sample/train.jsonl",
        "sha256": hashlib.sha256(train_data).hexdigest(),
        "records": len(train_data.splitlines()),
    }
    # Every rank's share and speed in each row (the picture's lower panels); each rank's own figures on its host.
    ranks = rows[-1]["ranks"]
    assert len(ranks["share"]) == 2 and abs(sum(ranks["share"]) - 1) < 1e-6 and all(ranks["tokens_per_s"])
    statuses = sorted((baseline / "hosts").glob("*/rank*.json"))
    assert [p.name for p in statuses] == ["rank0.json", "rank1.json"]
    assert all(json.loads(p.read_text())["device"].startswith("cpu: ") for p in statuses)


def test_killed_run_resumes_to_the_same_loss(
    baseline: Path, tmp_path: Path, torchrun: Run, torchrun_cmd: Callable[..., list[str]]
) -> None:
    job = write_job(tmp_path / "job.yaml", train={"max_steps": 40})
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        torchrun_cmd(job, run_dir), cwd=REPO, env=run_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step-000010" / "manifest.json").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job: torchrun and both ranks
        proc.wait()
    assert json.loads((run_dir / "run.json").read_text())["state"] == "running"
    killed_at = read_metrics(run_dir)[-1]["step"]
    assert killed_at < 40

    result = torchrun(job, run_dir, resume="auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    main_log = next((run_dir / "logs").glob("*-rank0.log")).read_text()
    assert "resumed from" in main_log
    assert abs(_loss_at(run_dir, 40) - _loss_at(baseline, 40)) <= 1e-4


def test_non_finite_loss_stops_with_a_diagnosis_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, torchrun: Run
) -> None:
    job = write_job(
        tmp_path / "job.yaml", optim={"lr": 1e30, "grad_clip": 1e30}, schedule={"warmup_steps": 0},
        train={"max_steps": 6}, checkpoint={"every": 1},
    )  # fmt: skip
    run_dir = tmp_path / "run"
    result = torchrun(job, run_dir)
    assert result.returncode != 0
    status = json.loads((run_dir / "run.json").read_text())
    assert status["state"] == "failed"
    assert "non-finite" in status["error"] and "Lower optim.lr" in status["error"]
    kept = sorted((run_dir / "checkpoints").iterdir())
    assert kept, "the last good checkpoint must be kept"
    bad_step = int(status["error"].split("step ")[1].split(":")[0])
    assert int(kept[-1].name.split("-")[1]) == bad_step - 1
