"""The DPO example across the 3-host test cluster with unequal shares (host weights 1 : 2 : 3): every rank trains its
share of the pairs, the held-out pairs are judged before and after, and `make train`'s summary says so.

The example's own model (SmolLM2-135M) is copied to each host and loaded three times on this 2-core machine; here
the job runs on the tiny random Llama instead, with everything else of jobs/dpo.example.yaml. The example itself on
the test cluster: docs/results.md ("Preference tuning")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO, Run, newest_run, remove_runs

from train.metrics import read_eval, read_metrics

NAME = "cluster-dpo"
STEPS = 6


@pytest.fixture()
def dpo_job(repo_jobs: Path) -> Any:
    job = yaml.safe_load((REPO / "jobs" / "dpo.example.yaml").read_text())
    job |= {"name": NAME, "balance": {"tb1": 1, "tb2": 2, "tb3": 3}}
    job["model"] |= {"source": "models/tiny-llama", "init": "random"}
    job["lora"]["target_modules"] = [*job["lora"]["target_modules"], "lm_head"]  # a random head needs adapting too
    job["data"]["seq_len"] = 96
    job["train"] |= {"max_steps": STEPS, "global_batch_size": 6}
    job["eval"] |= {"every": STEPS, "samples": 1, "max_new_tokens": 8}
    job["checkpoint"] |= {"every": STEPS}
    path = repo_jobs / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    yield path
    path.unlink()
    remove_runs(NAME)


def test_the_dpo_example_trains_across_the_test_cluster_with_unequal_shares(
    cluster: Path, dpo_job: Path, ugro_train: Run
) -> None:
    result = ugro_train("train", "--job", str(dpo_job), "--inventory", str(cluster), "--poll", "2", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = newest_run(NAME)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ranks = rows[-1]["ranks"]
    assert ranks["host"] == ["tb1", "tb2", "tb3"] and [round(s * 6) for s in ranks["share"]] == [1, 2, 3], ranks
    assert all(key in rows[-1] for key in ("rewards_margin", "rewards_accuracy")), rows[-1]
    evals = read_eval(run_dir)
    assert [(r["step"], r["model"]) for r in evals] == [(0, "base"), (STEPS, "fine-tuned")], evals
    assert all(r["tokens"] == 11 for r in evals)  # every held-out pair once, over the three ranks
    run = json.loads((run_dir / "run.json").read_text())
    assert run["state"] == "finished" and run["eval_preference_after"]["preference_accuracy"] is not None
    flat = " ".join(result.stdout.split())
    assert "held-out preference accuracy" in flat and "held-out log-prob margin" in flat, flat[-3000:]
    assert (run_dir / "samples.md").is_file() and (run_dir / "adapter" / "adapter_model.safetensors").is_file()
