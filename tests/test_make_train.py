"""`make train`'s whole path on this machine: CLI -> ansible-runner -> playbook -> torchrun -> train/."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, REPO, free_port, run_env, small_job

pytestmark = pytest.mark.slow


@pytest.fixture()
def job_file() -> Iterator[Path]:
    """A short job inside the repository (jobs are synced from there) and a clean-up of its runs."""
    name = f"e2e-{free_port()}"
    path = REPO / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(name=name, train={"max_steps": 20}), sort_keys=False))
    yield path
    path.unlink()
    for run in (REPO / "runs").glob(f"{name}-*"):
        shutil.rmtree(run)


@pytest.fixture()
def inventory(tmp_path: Path) -> Path:
    """inventory/local.yml with a free rendezvous port, so parallel runs on this machine do not collide."""
    data = yaml.safe_load((REPO / "inventory" / "local.yml").read_text())
    host = data["all"]["children"]["ugro_cluster"]["hosts"]["localhost"]
    host["ugro_rendezvous_port"] = free_port()
    host["ugro_code_dir"] = str(REPO)
    path = tmp_path / "inventory" / "local.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "ugro.cli", *args], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600
    )


def test_train_runs_the_job_through_ansible_and_torchrun(job_file: Path, inventory: Path) -> None:
    result = _cli("train", "--job", str(job_file), "--inventory", str(inventory))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "run finished:" in result.stdout
    run_dir = Path(result.stdout.split("run finished:")[1].split()[0])
    assert run_dir.parent == REPO / "runs"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "hosts" / "localhost" / "exit_code").read_text().strip() == "0"
    assert len(list((run_dir / "logs").glob("*-rank*.log"))) == 2  # 2 CPU processes, gloo
    assert "step 20/20" in result.stdout or "step 20" in result.stdout


def test_a_bad_job_file_stops_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_job(lora={"r": 0})))
    result = _cli("train", "--job", str(bad))
    assert result.returncode == 2
    assert "lora.r" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_data_record_stops_before_anything_starts(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "answer": "d"}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_job(name="baddata", data={"source": str(data)})))
    result = _cli("train", "--job", str(bad))
    assert result.returncode == 2
    flat = " ".join(result.stderr.split())
    assert "data.jsonl:2: missing or empty 'output'" in flat, result.stderr
    assert "Traceback" not in result.stderr
    assert not list((REPO / "runs").glob("baddata-*")), "nothing may start"


def test_unsloth_where_it_cannot_run_is_named_before_launch(inventory: Path) -> None:
    name = f"unsloth-{free_port()}"
    path = REPO / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(name=name, model={"backend": "unsloth"}), sort_keys=False))
    try:
        result = _cli("train", "--job", str(path), "--inventory", str(inventory))
    finally:
        path.unlink()
    flat = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stdout[-2000:]
    assert "localhost: model.backend 'unsloth' needs CUDA, and this host has no NVIDIA GPU" in flat
    assert "Traceback" not in result.stderr
    assert not list((REPO / "runs").glob(f"{name}-*")), "nothing may start"


def test_a_missing_inventory_is_named(job_file: Path) -> None:
    result = _cli("train", "--job", str(job_file), "--inventory", "inventory/nope.yml")
    assert result.returncode == 2
    assert "inventory/nope.yml: inventory not found" in result.stderr
