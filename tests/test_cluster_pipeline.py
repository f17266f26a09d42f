"""A model that no test host may hold whole trains as a 3-stage pipeline across the 3 test hosts.

Each host's memory profile (rank-local ``memory_gib``) caps it just below what the planner estimates the whole
model needs, so ``parallel: auto`` cuts the model into three stages, one per host, with hidden states crossing
the hosts' links. (The tiny test model's need is mostly the interpreter's; the arithmetic is the same for a 14B.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO, cli, cluster_job, newest_run, remove_runs

from train import stageplan
from train.config import load_job
from train.metrics import read_metrics

PROFILE = "/opt/ugro-profile-pipeline.yaml"  # on each test host (its own /opt)


@pytest.fixture()
def capped(testbed: Any, cluster: Path, repo_jobs: Path) -> Iterator[tuple[Path, Path, float]]:
    """(the job, an inventory whose hosts' profiles cap their memory just below the whole model's need, the cap)."""
    job = cluster_job(repo_jobs, "pipeline-test", train={"max_steps": 8}, eval={"source": "data/sample/eval.jsonl",
                      "every": 4, "samples": 1, "max_new_tokens": 8})  # fmt: skip
    config = load_job(job)
    shape = stageplan.read_shape(config, REPO)
    whole = stageplan.estimate(shape, config, shape.layers, True, True, 1, "cpu").total
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


def test_a_model_larger_than_every_hosts_memory_trains_as_stages_across_the_hosts(
    capped: tuple[Path, Path, float], ugro_train: Callable[..., Any]
) -> None:
    job, inventory, cap = capped
    result = ugro_train("train", "--job", str(job), "--inventory", str(inventory), "--poll", "2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = newest_run("pipeline-test")
    status = json.loads((run_dir / "run.json").read_text())
    assert status["state"] == "finished"
    (replica,) = status["layout"]["replicas"]
    stages = replica["stages"]
    assert sorted(s["host"] for s in stages) == ["tb1", "tb2", "tb3"], stages
    assert [(s["start"], s["end"]) for s in stages][0][0] == 0 and stages[-1]["end"] == 4
    assert all(s["peak_gib"] <= s["memory_gib"] and abs(s["memory_gib"] - cap) < 1e-3 for s in stages), stages
    assert status["eval_loss_after"] < status["eval_loss_before"]
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == 8
    # One adapter for the whole base, put together from the three hosts' stages, and the answers.
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((run_dir / "samples.json").read_text())[0]["after"] is not None
    # Hidden states crossed the hosts: every stage logged what it sent.
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("tb*-rank*.log"))
    assert logs.count("per step this stage sent") == 3, logs[-3000:]
    # `make status` says what each host computes.
    shown = cli("status", "--inventory", str(inventory), "--job-id", run_dir.name, timeout=120).stdout
    for stage in stages:
        assert f"layers {stage['start']}-{stage['end'] - 1}" in " ".join(shown.split()), shown
