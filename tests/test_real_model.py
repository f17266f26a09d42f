"""The real pretrained model (SmolLM2-135M-Instruct from its PyPI wheel): a 2-rank 4-bit QLoRA run on CPU,
its adapter in a fresh process with only transformers + peft, and the merged export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, Run, run_env, write_job

from train.metrics import read_eval, read_metrics
from ugro.model import basemodel

MODEL = "models/smollm2-135m-instruct"


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory, torchrun: Run) -> Path:
    """Convert the model once (cached), then a short 2-rank 4-bit job of it through torchrun.

    The default job's recipe (its lr 0.001 and 3 warm-up steps, its seed) on shorter sequences and the
    attention projections only, for 8 steps. Measured here (README, "4-bit QLoRA"): the held-out loss falls
    11.8-13.4 % in 8 steps with seeds 1, 2, 3 and 1234; the full default job in 4-bit falls 27.6 % in 24 steps
    against 24.1 % unquantized (`make bench-4bit`)."""
    basemodel.ensure(REPO / MODEL)
    base = tmp_path_factory.mktemp("qlora")
    job = write_job(
        base / "job.yaml",
        model={"source": MODEL, "init": "pretrained", "quantization": "4bit"},
        lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        data={"seq_len": 128},
        eval={"source": "data/sample/eval.jsonl", "every": 100, "samples": 1, "max_new_tokens": 24},
        optim={"lr": 0.001},
        schedule={"warmup_steps": 3},
        train={"max_steps": 8, "global_batch_size": 4, "log_every": 4, "seed": 1234},
        checkpoint={"every": 8, "keep_last": 1},
    )
    run_dir = base / "run"
    result = torchrun(job, run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_4bit_run_learns_and_leaves_an_adapter(qlora_run: Path) -> None:
    log = next((qlora_run / "logs").glob("*-rank0.log")).read_text()
    assert "backend=hf" in log
    assert [r["step"] for r in read_metrics(qlora_run)] == list(range(1, 9))
    evals = read_eval(qlora_run)
    before, after = evals[0], evals[-1]
    assert before["model"] == "base" and after["step"] == 8
    # The 4-bit base with a trained adapter answers the held-out questions better than the base alone.
    assert after["eval_loss"] < 0.95 * before["eval_loss"], evals
    samples = json.loads((qlora_run / "samples.json").read_text())
    assert samples[0]["before"] and samples[0]["after"] and samples[0]["before"] != samples[0]["after"]
    assert "Base model" in (qlora_run / "samples.md").read_text()
    config = json.loads((qlora_run / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == MODEL


FRESH = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
adapter = sys.argv[1]
base_name = json.load(open(adapter + "/adapter_config.json"))["base_model_name_or_path"]
tok = AutoTokenizer.from_pretrained(adapter)
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32), adapter)
msgs = [{"role": "user", "content": "Which port does torchrun's rendezvous use?"}]
enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**enc, max_new_tokens=16, do_sample=False)
print(json.dumps({"modules": sorted(m for m in sys.modules if m.split(".")[0] == "train"),
                  "answer": tok.decode(out[0][enc["input_ids"].shape[1]:], skip_special_tokens=True)}))
"""


def test_adapter_loads_on_the_unquantized_base_in_a_fresh_process(qlora_run: Path) -> None:
    env = {k: v for k, v in run_env().items() if k != "PYTHONPATH"}  # no ugro code importable
    done = subprocess.run(
        [sys.executable, "-c", FRESH, str(qlora_run / "adapter")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["modules"] == []
    assert result["answer"].strip()


def test_export_merges_into_a_model_equal_to_base_plus_adapter(qlora_run: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ugro.model.merge import export

    out = tmp_path / "merged"
    export(qlora_run / "adapter", out, REPO)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    ids = torch.tensor([[1, 4093, 314, 260, 3575, 282, 4649, 47, 2]])
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(REPO / MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        tuned = PeftModel.from_pretrained(base, str(qlora_run / "adapter")).eval()
        tuned_logits = tuned(input_ids=ids).logits
        merged_logits = merged(input_ids=ids).logits
    assert float((merged_logits - tuned_logits).abs().max()) <= 1e-4
    assert float((merged_logits - base_logits).abs().max()) > 1e-3
