"""``ugro eval`` (``make eval``) for real: lm-evaluation-harness 0.4 on SmolLM2-135M, its base against a LoRA adapter
trained here on the held-out answers themselves (so that its held-out perplexity is surely lower), the run's
held-out set generated as lm-eval tasks and loaded through lm-eval's own TaskManager."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO, make, runs_dir

from train.config import ConfigError, JobConfig
from ugro.evaluation.heldout import held_out_set
from ugro.evaluation.runner import load_tasks
from ugro.evaluation.tasks import HELDOUT, HELDOUT_GEN, TaskDir, write_tasks
from ugro.model import basemodel

MODEL = "models/smollm2-135m-instruct"
JOB_ID = "eval-test-20250101-000000"
RECORDS = 3  # held-out records: few, for CI time
STEPS = 12


def job_dict(eval_source: Path) -> dict[str, Any]:
    return {
        "name": "eval-test",
        "model": {"source": MODEL, "init": "pretrained"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        "data": {"source": "data/sample/train.jsonl", "format": "instruction", "seq_len": 256},
        "eval": {"source": str(eval_source), "max_new_tokens": 8, "tasks": ["heldout"]},
    }


@pytest.fixture(scope="module")
def finished_run(registry: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """runs/<JOB_ID> as a finished run leaves what make eval reads: run.json with its job, the adapter (trained here
    for a few steps on the held-out answers, with the labels on the answers only) and its tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    basemodel.ensure(REPO / MODEL)
    data = tmp_path_factory.mktemp("eval-data") / "eval.jsonl"
    lines = (REPO / "data" / "sample" / "eval.jsonl").read_text().splitlines()[:RECORDS]
    data.write_text("\n".join(lines) + "\n")
    job = job_dict(data)
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / MODEL))
    docs = held_out_set(JobConfig.model_validate(job), tokenizer, REPO).docs
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(REPO / MODEL), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rows = []
    for doc in docs:
        prompt = tokenizer(doc.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(doc.answer, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([prompt + answer]), torch.tensor([[-100] * len(prompt) + answer])))
    model.train()
    for step in range(STEPS):
        ids, labels = rows[step % len(rows)]
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.peft_config["default"].base_model_name_or_path = MODEL
    run_dir = runs_dir() / JOB_ID
    model.save_pretrained(str(run_dir / "adapter"))
    tokenizer.save_pretrained(str(run_dir / "adapter"))
    (run_dir / "run.json").write_text(json.dumps({"job": JobConfig.model_validate(job).model_dump(mode="json")}))
    return run_dir


def test_generated_tasks_load_in_lm_eval_with_the_held_out_records(finished_run: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    job = JobConfig.model_validate(json.loads((finished_run / "run.json").read_text())["job"])
    tokenizer = AutoTokenizer.from_pretrained(str(finished_run / "adapter"))
    held_out = held_out_set(job, tokenizer, REPO)
    task_dir = write_tasks(held_out, tmp_path / "tasks", max_new_tokens=8)
    assert task_dir.names == (HELDOUT, HELDOUT_GEN)  # instruction data: a generation task too
    load_tasks([HELDOUT, HELDOUT_GEN], task_dir)
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict([HELDOUT, HELDOUT_GEN], TaskManager(include_path=str(task_dir.path)))  # name -> Task
    records = [json.loads(line) for line in (REPO / "data" / "sample" / "eval.jsonl").read_text().splitlines()]
    perplexity, generation = tasks[HELDOUT], tasks[HELDOUT_GEN]
    assert perplexity.VERSION == 1 and perplexity.OUTPUT_TYPE == "loglikelihood"
    assert generation.OUTPUT_TYPE == "generate_until" and generation.config.generation_kwargs["max_gen_toks"] == 8
    docs = list(perplexity.test_docs())
    assert len(docs) == RECORDS
    for doc, record in zip(docs, records, strict=False):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": record["instruction"]}],
                                               add_generation_prompt=True, tokenize=False)  # fmt: skip
        assert perplexity.doc_to_text(doc) == prompt  # as trained: the model's chat template
        assert perplexity.doc_to_target(doc).startswith(record["output"])  # the answer, then its end of turn
        assert generation.doc_to_target(doc) == record["output"]


def test_make_eval_prints_base_against_tuned_and_the_tuned_model_is_better(finished_run: Path) -> None:
    result = make("eval", f"JOB_ID={JOB_ID}", f"LIMIT={RECORDS}", timeout=300, env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stdout + result.stderr
    shown = " ".join(result.stdout.split())
    assert "base vs tuned" in shown and "token_perplexity" in shown and "chrf" in shown, result.stdout
    record = json.loads((finished_run / "eval" / "results.json").read_text())
    assert record["lm_eval_version"] == "0.4.13" and set(record["results"]) == {"base", "tuned"}
    rows = {(r["task"], r["metric"]): r for r in record["comparison"]}
    for metric in ("token_perplexity", "byte_perplexity", "bits_per_byte"):
        row = rows[(HELDOUT, metric)]
        assert row["tuned"] < row["base"], row  # trained on these very answers
        assert row["version"] == "1" and row["samples"] == RECORDS
    assert (HELDOUT_GEN, "chrf") in rows and (HELDOUT_GEN, "bleu") in rows
    assert "| heldout | 1 | token_perplexity |" in (finished_run / "eval" / "README.md").read_text()


def test_a_task_lm_eval_does_not_know_is_one_error_naming_it_before_any_model_loads(tmp_path: Path) -> None:
    """`make eval TASKS=...` checks every name before a model is loaded, and `make train` checks the job's eval.tasks
    with its other checks (prelaunch.eval_tasks, called by prelaunch.ready): lm-eval must know every task, and the
    base must be a pretrained model whose weights lm-eval can load."""
    from ugro.checks import prelaunch
    from ugro.run.launch import Refused

    with pytest.raises(ConfigError, match=r"lm-eval has no task 'no_such_task_xyz'"):
        load_tasks(["no_such_task_xyz"], TaskDir(tmp_path, ()))

    job_file = tmp_path / "job.yaml"
    eval_source = REPO / "data" / "sample" / "eval.jsonl"
    job = JobConfig.model_validate(job_dict(eval_source) | {"eval": {"source": str(eval_source), "tasks": ["heldout"]}})
    prelaunch.eval_tasks(job, job_file)  # heldout is the run's own: nothing to index, nothing refused
    assert job.eval is not None
    unknown = job.model_copy(update={"eval": job.eval.model_copy(update={"tasks": ["heldout", "no_such_task_xyz"]})})
    with pytest.raises(Refused, match=r"job.yaml: eval.tasks: lm-eval has no task 'no_such_task_xyz'"):
        prelaunch.eval_tasks(unknown, job_file)
    random = job.model_copy(update={"model": job.model.model_copy(update={"init": "random"})})
    with pytest.raises(Refused, match=r"eval.tasks needs model.init: pretrained"):
        prelaunch.eval_tasks(random, job_file)
