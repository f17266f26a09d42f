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


def test_a_4bit_layer_still_passes_gradients_after_an_evaluation_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out loss before step 1 runs the 4-bit layers in eval mode without grad. On a CPU with AVX-512 BF16
    bitsandbytes would then repack them for an inference kernel that autograd cannot go through, and the
    training steps after it would get no gradient from below them (train/model/load.py keep_4bit_trainable_on_cpu)."""
    if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:  # an unquantized model loaded earlier
        monkeypatch.delitem(sys.modules, "bitsandbytes")  # in this process kept it out (train/model/load.py)
    import bitsandbytes as bnb

    from train.model.load import keep_4bit_trainable_on_cpu

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.load_state_dict({"weight": torch.randn(32, 64)})
    layer = layer.to("cpu")  # quantizes
    keep_4bit_trainable_on_cpu(layer)
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(3, 64))
    layer.train()
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert x.grad is not None
    assert torch.allclose(x.grad, weight.sum(0).expand(3, -1), atol=1e-5)


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


def test_export_merges_into_a_model_equal_to_base_plus_adapter(qlora_run: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ugro.model.merge import export

    out = qlora_run / "merged"  # where `make export` puts it: the GGUF export below starts from it
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


def test_the_converted_base_keeps_the_gguf_tokenizer() -> None:
    """The base's tokenizer is the one its GGUF defines: byte-level BPE, <|im_end|> ends a turn and a sequence."""
    from transformers import AutoTokenizer, GenerationConfig

    basemodel.ensure(REPO / MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / MODEL))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == GenerationConfig.from_pretrained(str(REPO / MODEL)).eos_token_id
    text = "Port 29500 on node4070: naïve café, ¿qué? 数据"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode([i]) for i in tokenizer("29500", add_special_tokens=False)["input_ids"]] == list("29500")


def test_gguf_export_loads_in_llama_cpp_and_answers_like_the_merged_model(qlora_run: Path, registry: None) -> None:
    """make export FORMAT=gguf on a real run: llama.cpp (built from the registry's source distribution, cached)
    loads every file; f16 answers the held-out questions token for token like transformers on the merged model."""
    import yaml
    from helpers import cli

    done = cli("export", "--job-id", qlora_run.name, "--format", "gguf", "--quant", "f16,q8_0", "--questions", "2",
               env={"UGRO_RUNS_DIR": str(qlora_run.parent)}, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = qlora_run / "gguf"
    check = json.loads((out / "check.json").read_text())
    by_kind = {r["kind"]: r for r in check["files"]}
    assert set(by_kind) == {"f16", "q8_0"} and all(r["passed"] for r in by_kind.values())
    f16, q8 = by_kind["f16"], by_kind["q8_0"]
    # f16 holds the merged weights rounded to f16, tensor for tensor, as transformers' GGUF loader reads them.
    assert f16["tensors"]["other"] == 0 and not f16["tensors"]["missing"]
    assert f16["tensors"]["exact"] + f16["tensors"]["rounded"] == f16["tensors"]["tensors"]
    # llama.cpp tokenizes the prompts as transformers does, keeps the chat template, and answers alike.
    assert f16["answers"]["prompt_tokens_agree"] and f16["chat_template_kept"]
    assert f16["answers"]["questions"] == 2  # two suffice to compare the answers; each costs both models' decoding
    assert f16["answers"]["same_tokens_min"] >= 16 or all(d["margin"] < 0.05 for d in f16["answers"]["divergences"])
    assert abs(f16["loss_rel_diff"]) <= 0.002 and abs(q8["loss_rel_diff"]) <= 0.01
    modelfile = (out / "Modelfile").read_text()
    assert f"FROM ./{qlora_run.name}-q8_0.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert "PARAMETER temperature 0\n" in modelfile  # greedy, as the run judged its samples
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    assert "## GGUF checks" in card and (qlora_run / "merged" / "README.md").is_file()


def test_gguf_export_refuses_an_architecture_llama_cpp_cannot_convert(tmp_path: Path, registry: None) -> None:
    from train.config import ConfigError
    from ugro.model import gguf_export, llamacpp

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ConfigError, match="does not support the architecture NoSuchModelForCausalLM"):
        gguf_export.check_architecture(tmp_path, llamacpp.ensure())
