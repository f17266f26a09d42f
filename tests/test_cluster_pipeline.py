"""A model that no test host may hold whole trains as a 3-stage pipeline across the 3 test hosts, and goes on in
two stages when one of them dies.

Each host's memory profile (rank-local ``memory_gib``) caps it just below what the planner estimates the whole
model needs, so ``parallel: auto`` cuts the model into three stages, one per host, with hidden states crossing
the hosts' links. (The tiny test model's need is mostly the interpreter's; the arithmetic is the same for a 14B.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO, cli, cluster_job, remove_runs, run_env, runs_dir

from testbed import cluster as testbed_cluster
from train.config import load_job
from train.layout import stageplan
from train.metrics import read_metrics

PROFILE = "/opt/ugro-profile-pipeline.yaml"  # on each test host (its own /opt)


@pytest.fixture()
def capped(testbed: Any, cluster: Path, repo_jobs: Path) -> Iterator[tuple[Path, Path, float]]:
    """(the job, an inventory whose hosts' profiles cap their memory just below the whole model's need, the cap)."""
    held_out = {"source": "data/sample/eval.jsonl", "every": 16, "samples": 1, "max_new_tokens": 8}
    # Micro-batches of one sequence: the planner would rather shrink a rank's micro-batch than cut the model, so
    # the cap must be below the whole model's need at the smallest micro-batch.
    job = cluster_job(repo_jobs, "pipeline-test", train={"max_steps": 16}, checkpoint={"every": 2}, eval=held_out,
                      rank_local={"micro_batch_size": 1})  # fmt: skip
    config = load_job(job)
    shape = stageplan.read_shape(config, REPO)
    whole = stageplan.estimate(shape, config, stageplan.Span(shape.layers), "cpu").total
    cap = round(whole - 0.002, 4)  # just below the whole model's need
    members = [stageplan.Member(f"tb{i}", cap, device="cpu", rank_local=config.rank_local) for i in (1, 2, 3)]
    assert len(stageplan.plan(config, shape, members).replicas[0].stages) == 3
    data = yaml.safe_load(cluster.read_text())
    for name, host in data["all"]["children"]["ugro_cluster"]["hosts"].items():
        (testbed.dir / name / "opt" / Path(PROFILE).name).write_text(yaml.safe_dump({"memory_gib": cap}))
        host["ugro_profile_file"] = PROFILE
    inventory = cluster.parent / "cluster-capped.yml"
    inventory.write_text(yaml.safe_dump(data))
    try:
        yield job, inventory, cap
    finally:
        job.unlink()
        inventory.unlink()
        remove_runs("pipeline-test")


def _main_rows(testbed: Any, job_id: str) -> list[dict[str, Any]]:
    """The metrics rows on the main host (tb1), while the run is on."""
    path = testbed.dir / "tb1" / "opt" / "ugro" / "runs" / job_id / "metrics.jsonl"
    return read_metrics(path.parent) if path.is_file() else []


def test_a_model_larger_than_every_host_trains_as_stages_and_re_plans_when_a_stage_host_dies(
    capped: tuple[Path, Path, float], testbed: Any, ugro_train: Callable[..., Any]
) -> None:
    """Three stages, one per host; tb3's job SIGKILLed mid-run: the controller relaunches on tb1 and tb2, whose
    ranks plan again and cut the model into two stages from the last checkpoint, and the run finishes."""
    job, inventory, cap = capped
    argv = [sys.executable, "-m", "ugro.cli", "train", "--job", str(job), "--inventory", str(inventory), "--poll", "2"]
    follower = subprocess.Popen(argv, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            assert follower.poll() is None, follower.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the pipeline never reached step 4"
            runs = sorted(runs_dir().glob("pipeline-test-*"))
            if runs and any(r["step"] >= 4 for r in _main_rows(testbed, runs[-1].name)):
                break
            time.sleep(0.5)
        job_id = runs[-1].name
        assert testbed_cluster.kill_processes(testbed.dir, "tb3", f"/opt/ugro/runs/{job_id}")
        output, _ = follower.communicate(timeout=900)
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
    assert follower.returncode == 0, output[-4000:]
    run_dir = runs_dir() / job_id
    status = json.loads((run_dir / "run.json").read_text())
    assert status["state"] == "finished" and len(status["restarts"]) == 1, status.get("restarts")
    # Before the fault: three stages, one per host (the main rank logs the layout of each launch).
    layouts = re.findall(r"INFO layout \(.*\): (replica .*)", (run_dir / "logs" / "tb1-rank0.log").read_text())
    assert len(layouts) == 2, layouts
    assert [re.findall(r"tb\d", line) for line in layouts] == [["tb1", "tb2", "tb3"], ["tb1", "tb2"]], layouts
    # After it: the model cut anew into two stages on the hosts left, each within the capped memory.
    (replica,) = status["layout"]["replicas"]
    stages = replica["stages"]
    assert [s["host"] for s in stages] == ["tb1", "tb2"] and stages[-1]["end"] == 4, stages
    assert all(s["peak_gib"] <= s["memory_gib"] and abs(s["memory_gib"] - cap) < 1e-3 for s in stages), stages
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 17)), steps
    assert status["eval_loss_after"] < status["eval_loss_before"]
    # One adapter for the whole base, put together from the stages, and the answers through them.
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "samples.json").read_text())[0]["after"] is not None
    # `make status` says what each host computed.
    shown = " ".join(cli("status", "--inventory", str(inventory), "--job-id", job_id, timeout=120).stdout.split())
    for stage in stages:
        assert f"layers {stage['start']}-{stage['end'] - 1}" in shown, shown
