"""A preference job run for real (2 ranks, torchrun, gloo): DPO's figures in the records and the held-out pairs
before and after, and a run killed mid-way resumes to the same loss and adapter as the run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, Run, run_env, torchrun_cmd, write_job
from safetensors.torch import load_file

from train.metrics import read_eval, read_metrics
from ugro.model.card import render_card

STEPS = 12
DPO: dict[str, Any] = {
    "data": {"source": "data/preference/train.jsonl", "format": "preference", "packing": False, "seq_len": 96},
    "eval": {"source": "data/preference/eval.jsonl", "every": 6, "samples": 1, "max_new_tokens": 8},
    "train": {"method": "dpo", "max_steps": STEPS, "global_batch_size": 6},
    "preference": {"reference": "cached"},
    "checkpoint": {"every": 6},
    "lora": {"dropout": 0.0},
    "rank_local": {"micro_batch_size": 4},  # rows: two pairs per micro-batch
}


def _job(path: Path) -> Path:
    return write_job(path, **DPO)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, torchrun: Run) -> Path:
    base = tmp_path_factory.mktemp("dpo")
    run_dir = base / "run"
    result = torchrun(_job(base / "job.yaml"), run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_a_dpo_run_records_its_rewards_and_the_held_out_pairs_before_and_after(baseline: Path) -> None:
    rows = read_metrics(baseline)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert abs(rows[0]["loss"] - 0.6931) < 1e-3  # the adapter starts as the base: every reward 0, loss log 2
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"]
    assert all(key in rows[-1] for key in ("rewards_chosen", "rewards_rejected", "rewards_margin",
                                            "rewards_accuracy", "logps_chosen", "logps_rejected"))  # fmt: skip
    assert rows[-1]["rewards_margin"] > 0
    evals = read_eval(baseline)
    assert [(r["step"], r["model"]) for r in evals] == [(0, "base"), (6, "fine-tuned"), (12, "fine-tuned")]
    assert evals[0]["rewards_margin"] == 0 and evals[0]["tokens"] == 11  # the base is its own reference
    run = json.loads((baseline / "run.json").read_text())
    assert run["state"] == "finished" and run["job"]["train"]["method"] == "dpo"
    before, after = run["eval_preference_before"], run["eval_preference_after"]
    assert 0 <= before["preference_accuracy"] <= 1 and after["logp_margin"] != before["logp_margin"]
    samples = json.loads((baseline / "samples.json").read_text())
    assert len(samples) == 1 and samples[0]["reference"] and samples[0]["question"].endswith("?")
    assert (baseline / "adapter" / "adapter_model.safetensors").is_file()
    card = render_card(baseline, REPO, artifact="merged")  # what `make export` writes beside the merged model
    assert "| method | `dpo` (preference tuning on chosen and rejected answers: loss `sigmoid`, beta `0.1`" in card
    assert "| global batch | `6` pairs per step" in card and "data/preference/train.jsonl" in card
    assert f"| prefers the chosen answer (share of pairs) | {before['preference_accuracy']:.0%} |" in card
    assert "| reward accuracy | — |" in card  # the base is its own reference: it has none


def test_a_killed_dpo_run_resumes_to_the_same_loss_and_adapter(baseline: Path, tmp_path: Path, torchrun: Run) -> None:
    """The reference cache is not checkpointed: the resumed ranks compute it again, to the same figures."""
    job, run_dir = _job(tmp_path / "job.yaml"), tmp_path / "run"
    proc = subprocess.Popen(torchrun_cmd(job, run_dir), cwd=REPO, env=run_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step-000006" / "manifest.json").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert read_metrics(run_dir)[-1]["step"] < STEPS
    result = torchrun(job, run_dir, resume="auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from" in next((run_dir / "logs").glob("*-rank0.log")).read_text()
    last = {r["step"]: r for r in read_metrics(run_dir)}[STEPS]
    expected = {r["step"]: r for r in read_metrics(baseline)}[STEPS]
    assert (
        abs(last["loss"] - expected["loss"]) <= 1e-5
        and abs(last["rewards_margin"] - expected["rewards_margin"]) <= 1e-5
    )
    mine, theirs = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run_dir, baseline))
    worst = max(float((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp(min=1e-12)) for k in theirs)
    assert mine.keys() == theirs.keys() and worst <= 1e-5, worst
    assert torch.isfinite(torch.tensor(last["loss"]))


@pytest.mark.parametrize(
    ("method", "overrides"),
    [("orpo", {}), ("kto", {"preference": {"reference": "live", "undesirable_weight": 1.33}})],
)
def test_orpo_and_kto_train_through_the_whole_loop(tmp_path: Path, torchrun: Run, method: str,
                                                   overrides: dict[str, Any]) -> None:  # fmt: skip
    """Every method through the same loop: its step, its held-out pairs (kto: the pairs' desirable and undesirable
    examples, with their KL rows), its records."""
    job = {**DPO, "train": {**DPO["train"], "method": method, "max_steps": 4}, "eval": {**DPO["eval"], "every": 4},
           "checkpoint": {"every": 4}, "schedule": {"warmup_steps": 1}, **overrides}  # fmt: skip
    run_dir = tmp_path / "run"
    result = torchrun(write_job(tmp_path / "job.yaml", **job), run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert ("kl" in rows[-1]) == (method == "kto") and ("nll_loss" in rows[-1]) == (method == "orpo"), rows[-1]
    evals = read_eval(run_dir)
    assert [(r["step"], r["model"]) for r in evals] == [(0, "base"), (4, "fine-tuned")]
    assert evals[0]["tokens"] == (22 if method == "kto" else 11)  # kto: each held-out pair is two examples
    run = json.loads((run_dir / "run.json").read_text())
    assert run["state"] == "finished" and (run["eval_preference_after"]["preference_accuracy"] is None) == (
        method == "kto"
    )
