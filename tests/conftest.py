"""Shared helpers: the repository, a small job file, and running torchrun for real."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


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
        "data": {"source": "data/sample/cluster-troubleshooting.jsonl", "seq_len": 128},
        "optim": {"lr": 0.003},
        "schedule": {"warmup_steps": 4},
        "train": {"max_steps": 30, "global_batch_size": 8, "log_every": 10, "seed": 7},
        "checkpoint": {"every": 10, "keep_last": 5},
        "rank_local": {"micro_batch_size": 2},
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


def torchrun_cmd(job: Path, run_dir: Path, nproc: int = 2, resume: str = "none") -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0",
        "--module", "train.worker", "--job", str(job), "--run-dir", str(run_dir),
        "--resume", resume, "--code-dir", str(REPO),
    ]  # fmt: skip


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def torchrun(job: Path, run_dir: Path, nproc: int = 2, resume: str = "none") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        torchrun_cmd(job, run_dir, nproc, resume), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300
    )


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
