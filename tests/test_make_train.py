"""`make train`'s whole path on this machine: CLI -> ansible-runner -> playbook -> torchrun -> train/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import PYTHON, RUNS_ENV, Run, cli, copy_checkout, free_port, run_env, runs_dir, small_job


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout to run `make train` in: the default inventory's host runs the checkout itself and
    keeps its runs in the checkout's runs/ (and its jobs in jobs/), so the test's are the copy's, not this one's."""
    return copy_checkout(tmp_path_factory.mktemp("checkout"))


def _in(checkout: Path) -> dict[str, Any]:
    """The CLI's options for a run in ``checkout``: its directory, and its runs/ as the runs directory."""
    return {"cwd": checkout, "env": {RUNS_ENV: str(checkout / "runs")}}


@pytest.fixture()
def job_file(checkout: Path) -> Path:
    """A short job in the checkout's jobs/ (jobs are synced from there)."""
    name = f"e2e-{free_port()}"
    path = checkout / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(name=name, train={"max_steps": 20}), sort_keys=False))
    return path


@pytest.fixture()
def inventory(checkout: Path, tmp_path: Path) -> Path:
    """inventory/local.yml with a free rendezvous port, so parallel runs on this machine do not collide."""
    data = yaml.safe_load((checkout / "inventory" / "local.yml").read_text())
    host = data["all"]["children"]["ugro_cluster"]["hosts"]["localhost"]
    host["ugro_rendezvous_port"] = free_port()
    host["ugro_code_dir"] = str(checkout)
    path = tmp_path / "inventory" / "local.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_documented_make_lines_work_as_typed_on_a_real_run(
    checkout: Path, job_file: Path, inventory: Path, make: Run
) -> None:
    """The README's and docs' `make` lines, typed as they are shown (JOB=, INVENTORY=, JOB_ID=), on one real run:
    make puts its command-line variables in the environment, where Ansible's event callback once read JOB_ID as
    an AWX job number and every playbook of status, logs and stop broke."""
    job, inv = f"JOB={job_file.relative_to(checkout)}", f"INVENTORY={inventory}"
    check = make("validate", job, **_in(checkout))
    assert check.returncode == 0 and ": ok (job " in check.stdout, check.stdout + check.stderr

    # A token in the user's shell, as many have one: it must not end up in the run's files (docs/security.md).
    secret = f"hf_{free_port()}NotForTheRunDirectory"
    at = _in(checkout)
    # Two settings over the job file, typed as the README shows (the job file itself says lr 3e-3, r 16).
    setting = "SET=optim.lr=2e-3 lora.r=4"
    result = make("train", job, inv, setting, cwd=at["cwd"], env=at["env"] | {"HF_TOKEN": secret})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "run finished:" in result.stdout
    run_dir = Path(result.stdout.split("run finished:")[1].split()[0])
    assert run_dir.parent == checkout / "runs"
    trained = json.loads((run_dir / "run.json").read_text())["job"]  # the job as the main rank ran it
    assert (trained["optim"]["lr"], trained["lora"]["r"]) == (2e-3, 4), trained
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "hosts" / "localhost" / "exit_code").read_text().strip() == "0"
    assert len(list((run_dir / "logs").glob("*-rank*.log"))) == 2  # 2 CPU processes, gloo
    # Where the seconds to the first step went, printed and recorded: the controller's, the launch playbook's
    # and the ranks' own phases add up to the total.
    phases = json.loads((run_dir / "run.json").read_text())["launch_phases"]
    assert {"controller start", "launch", "ranks' start (imports, model, data)", "first step"} <= set(phases)
    total = phases.pop("total: make train -> first step")
    assert all(v >= 0 for v in phases.values()) and abs(sum(phases.values()) - total) < 0.1, phases
    assert "to the first step: controller start" in " ".join(result.stdout.split())

    # status, stop and RESUME=auto are typed through make on the test cluster (tests/test_cluster.py).
    job_id = f"JOB_ID={run_dir.name}"
    logs = make("logs", inv, job_id, **_in(checkout))
    assert logs.returncode == 0 and f"logs of localhost in {run_dir / 'logs'}" in " ".join(logs.stdout.split())
    doctor = make("doctor", job_id, **_in(checkout))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    # The tiny job's base is built from its config with random weights: export says why it cannot merge
    # (tests/test_real_model.py merges a pretrained base's adapter).
    export = make("export", job_id, **_in(checkout))
    assert export.returncode == 2 and "Traceback" not in export.stderr, export.stderr
    assert "model.init: random" in " ".join(export.stderr.split())

    holding = [p for p in (checkout / "runs").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not holding, f"the controller's environment was recorded in {holding}"


def test_a_bad_job_file_stops_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_job(lora={"r": 0})))
    result = cli("train", "--job", str(bad))
    assert result.returncode == 2
    assert "lora.r" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_data_record_stops_before_anything_starts(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "answer": "d"}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(small_job(name="baddata", data={"source": str(data)})))
    result = cli("train", "--job", str(bad))
    assert result.returncode == 2
    flat = " ".join(result.stderr.split())
    assert "data.jsonl:2: missing or empty 'output'" in flat, result.stderr
    assert "Traceback" not in result.stderr
    assert not list(runs_dir().glob("baddata-*")), "nothing may start"


def test_unsloth_where_it_cannot_run_is_named_before_launch(checkout: Path, inventory: Path, ugro: Run) -> None:
    name = f"unsloth-{free_port()}"
    path = checkout / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(small_job(name=name, model={"backend": "unsloth"}), sort_keys=False))
    result = ugro("train", "--job", str(path), "--inventory", str(inventory), timeout=600, **_in(checkout))
    flat = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stdout[-2000:]
    assert "localhost: model.backend 'unsloth' needs CUDA, and this host has no NVIDIA GPU" in flat
    assert "Traceback" not in result.stderr
    assert not list((checkout / "runs").glob(f"{name}-*")), "nothing may start"


def test_a_missing_inventory_is_named(job_file: Path) -> None:
    result = cli("train", "--job", str(job_file), "--inventory", "inventory/nope.yml")
    assert result.returncode == 2
    assert "inventory/nope.yml: inventory not found" in result.stderr


def test_ctrl_c_detaches_the_run_goes_on_and_make_follow_takes_it_up_to_its_end(
    checkout: Path, job_file: Path, inventory: Path
) -> None:
    """Ctrl-C while `make train` follows (SIGINT to its process group, as a terminal sends it) leaves the job
    running on its host; `make status` says no controller follows it, and `make follow` follows it to its end and
    collects its results. (ansible-runner once took SIGINT for itself: Ctrl-C then only cancelled the playbook in
    flight and the controller kept following.)"""
    # Epochs instead of a step count: the tiny job packs 266 rows of 128, 33.25 steps an epoch at 8 a step, so 2
    # epochs are 67 steps (an unloaded machine runs a few a second: enough to press Ctrl-C before the end).
    job = small_job(name=job_file.stem)
    del job["train"]["max_steps"]
    job["train"]["epochs"] = 2
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    at = _in(checkout)
    env = run_env() | {"PYTHONPATH": str(checkout), "SKIP_PREFLIGHT": "1"} | at["env"]
    log = checkout / f"{job_file.stem}.follow.log"
    with open(log, "w") as out:
        follower = subprocess.Popen(
            [PYTHON, "-m", "ugro.cli", "train", "--job", str(job_file.relative_to(checkout)), "--inventory",
             str(inventory)], cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_as_in_a_terminal,
        )  # fmt: skip
    try:
        run_dir = _wait_for_steps(checkout / "runs", job_file.stem, 1, follower)
        assert (run_dir / ".control" / "follower.json").is_file()
        os.killpg(follower.pid, signal.SIGINT)
        assert follower.wait(timeout=60) == 130, log.read_text()
        said = " ".join(log.read_text().split())
        assert "detached" in said and f"make follow JOB_ID={run_dir.name}" in said, said
        step = _step(run_dir)
        status = cli("status", "--inventory", str(inventory), "--job-id", run_dir.name, timeout=120, **at)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "no controller follows this run" in " ".join(status.stdout.split()), status.stdout
        # The ranks go on without it (a step may take seconds on a loaded machine).
        deadline = time.monotonic() + 120
        while _step(run_dir) <= step and json.loads((run_dir / "run.json").read_text())["state"] != "finished":
            assert time.monotonic() < deadline, f"no step after step {step} in 120 s without a controller"
            time.sleep(0.5)

        followed = cli("follow", "--job-id", run_dir.name, timeout=400, **at)
        assert followed.returncode == 0, followed.stdout + followed.stderr
        assert f"following job {run_dir.name}" in " ".join(followed.stdout.split()), followed.stdout
        record = json.loads((run_dir / "run.json").read_text())
        assert record["state"] == "finished" and record["step"] == record["total_steps"] == 67, record
        assert (run_dir / "logs").is_dir() and not (run_dir / ".control" / "follower.json").exists()
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
        cli("stop", "--inventory", str(inventory), timeout=120, **at)


def _as_in_a_terminal() -> None:
    """SIGINT as a terminal's foreground process has it: a shell that starts the tests in the background without
    job control (CI scripts do) makes every descendant ignore SIGINT, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "run.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def _wait_for_steps(runs: Path, name: str, steps: int, follower: subprocess.Popen[str]) -> Path:
    """The run of job ``name`` in ``runs`` once its ranks are past ``steps`` steps (while ``follower`` follows)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert follower.poll() is None, f"the follower ended with {follower.returncode} before step {steps}"
        found = sorted(runs.glob(f"{name}-*"))
        if found and _step(found[-1]) >= steps:
            return found[-1]
        time.sleep(0.5)
    raise AssertionError(f"no run of {name} reached step {steps} in 300 s")
