"""A real torchrun job in pipeline stages: it trains, checkpoints, resumes re-cut, and leaves one whole adapter."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch
from helpers import REPO, Run, run_env, torchrun_cmd, write_job

from train.config import load_job
from train.data import evaluate
from train.dist.distributed import RankInfo
from train.metrics import read_metrics
from train.model.load import load_base_hf, load_tokenizer

EVAL = {"source": "data/sample/eval.jsonl", "every": 3, "samples": 2, "max_new_tokens": 8}


def _job(path: Path, stages: int) -> Path:
    return write_job(
        path,
        train={"max_steps": 6, "global_batch_size": 6, "log_every": 1},
        schedule={"warmup_steps": 1},
        checkpoint={"every": 3, "keep_last": 2},
        eval=EVAL,
        parallel={"stages": stages},
        lora={"dropout": 0.0},
    )


def _whole_model(job_file: Path, adapter: Path) -> tuple[float, list[str], list[str]]:
    """The whole base in one process with the run's adapter loaded by peft: held-out loss, answers before/after."""
    from peft import PeftModel

    job = load_job(job_file)
    base = load_base_hf(job.model, REPO, torch.device("cpu"), job.train.seed)
    model = PeftModel.from_pretrained(base, str(adapter))
    tokenizer = load_tokenizer(job.model, REPO)
    held_out = evaluate.load(job, tokenizer, REPO)
    assert held_out is not None and job.eval is not None
    value, _ = evaluate.loss(model, held_out, RankInfo(0, 0, 1, "test", torch.device("cpu")), 8)
    asked = held_out.records[: job.eval.samples]
    with evaluate.base_model(model):
        before = evaluate.answers(model, tokenizer, job, asked, torch.device("cpu"))
    return value, before, evaluate.answers(model, tokenizer, job, asked, torch.device("cpu"))


def test_three_stages_train_resume_as_two_and_leave_one_adapter_for_the_whole_base(
    tmp_path: Path, torchrun: Run
) -> None:
    job3 = _job(tmp_path / "three.yaml", 3)
    run = tmp_path / "run"
    result = torchrun(job3, run, nproc=3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = json.loads((run / "run.json").read_text())
    assert status["state"] == "finished"
    assert [len(r["stages"]) for r in status["layout"]["replicas"]] == [3]
    assert status["eval_loss_after"] < status["eval_loss_before"]
    losses = {row["step"]: row["loss"] for row in read_metrics(run)}

    # The stages' LoRA weights, put together, are one adapter for the whole base: peft loads it onto the
    # base in one process, and that model has the held-out loss the stages measured.
    # The answers the stages generated together are the whole model's (transformers' generate, greedy).
    loss, before, after = _whole_model(job3, run / "adapter")
    assert abs(loss - status["eval_loss_after"]) < 1e-4
    samples = json.loads((run / "samples.json").read_text())
    assert [s["before"] for s in samples] == before
    assert [s["after"] for s in samples] == after

    # Resume from step 3 with two stages instead of three: the checkpoint is cut anew, and with dropout off
    # the steps after it match the uninterrupted run's.
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    job2 = _job(tmp_path / "two.yaml", 2)
    result = torchrun(job2, resumed, nproc=2, resume="auto")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((resumed / "run.json").read_text())["resumed"]["from_step"] == 3
    again = {row["step"]: row["loss"] for row in read_metrics(resumed)}
    for step in (4, 5, 6):
        assert abs(again[step] - losses[step]) <= 1e-4 * abs(losses[step]), (step, again[step], losses[step])


def test_a_stage_host_that_loads_for_longer_than_the_collective_timeout_still_starts(
    tmp_path: Path, torchrun: Run
) -> None:
    """Each host loads in its own time (``distributed.startup_timeout_s``); only after that do collectives wait at most
    ``distributed.timeout_s``. The stages' gradient groups are made after the "loaded" wait: made while the model
    loaded, a stage that loaded 8 s longer than the 3 s timeout ended the run at start-up."""
    job = write_job(tmp_path / "job.yaml", train={"max_steps": 1, "global_batch_size": 2}, eval=None,
                    schedule={"warmup_steps": 0}, parallel={"stages": 2}, distributed={"timeout_s": 3})  # fmt: skip
    argv = [
        "tests.fixtures.faulty_worker" if arg == "train.worker" else arg for arg in torchrun_cmd(job, tmp_path / "run")
    ]
    result = subprocess.run(argv, cwd=REPO, env=run_env() | {"UGRO_TEST_SLOW_LOAD": "1:8"}, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["state"] == "finished"


def test_a_stage_of_the_real_model_reads_only_its_layers_and_computes_what_the_whole_model_does(
    tmp_path: Path,
) -> None:
    """SmolLM2's first 10 decoder layers loaded alone from its safetensors give the whole model's hidden
    state after layer 10; the last stage, fed that state, gives the whole model's logits."""
    from train.layout import stagemodel
    from train.layout.topology import Stage
    from ugro.model import basemodel

    basemodel.ensure(REPO / "models" / "smollm2-135m-instruct")
    job = load_job(REPO / "jobs" / "default.yaml")
    whole = load_base_hf(job.model, REPO, torch.device("cpu"), job.train.seed)
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1789, 30, 2]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = whole(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    first, _ = stagemodel.load_stage(job, REPO, Stage(0, "a", 0, 10), True, False, torch.device("cpu"), tmp_path)
    last, _ = stagemodel.load_stage(job, REPO, Stage(1, "b", 10, 30), False, True, torch.device("cpu"), tmp_path)
    assert not list(tmp_path.iterdir()), "a stage's scratch directory is removed once it is loaded"
    held = {n for n, _ in first.named_parameters() if ".layers." in n}
    assert {stagemodel.layer_of(n) for n in held} == set(range(10))
    with torch.no_grad():
        rows = {"input_ids": ids, "attention_mask": mask}
        hidden = stagemodel.forward(first, ids, rows, True, False)
        logits = stagemodel.forward(last, hidden, rows, False, True)
    torch.testing.assert_close(hidden, out.hidden_states[10], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
