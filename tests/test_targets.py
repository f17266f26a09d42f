"""LoRA target modules that fit any causal LM: every linear layer but the head by default, misspelt names refused.

The resolution runs on models built on the meta device from tiny configs (no weights); the controller's check
through `ugro validate`; and two real torchrun runs of a GPT-2- and a Qwen2-shaped base whose job names no module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, Run, cli, small_job
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, PretrainedConfig, Qwen2Config

from train.config import ConfigError, JobConfig
from train.metrics import read_metrics
from train.model import targets
from ugro.checks import jobcheck

LLAMA_NAMES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
# The vocabulary of models/tiny-llama's tokenizer, and random weights at 10x the usual scale: at the usual 0.02 the
# random head's logits are nearly uniform whatever the layers below say, and all-linear leaves the head alone.
CONFIG: dict[str, int | float] = {"vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
                            "initializer_range": 0.2}  # fmt: skip


def _gpt2() -> PretrainedConfig:
    return GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=128, **CONFIG)


def _qwen2() -> PretrainedConfig:
    return Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=128, tie_word_embeddings=False, **CONFIG,
    )  # fmt: skip


def _llama() -> PretrainedConfig:
    return AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")


def _meta(config: PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _job(source: str | Path, **lora: object) -> dict[str, object]:
    """The small job on the base ``source``; without ``lora`` it names no target modules."""
    job = small_job(model={"source": str(source), "tokenizer": "models/tiny-llama"})
    job["lora"] = dict(lora)
    return job


@pytest.mark.parametrize(
    ("config", "expected"),
    [(_llama, LLAMA_NAMES), (_qwen2, LLAMA_NAMES), (_gpt2, ["c_attn", "c_fc", "c_proj"])],
    ids=["llama", "qwen2", "gpt2"],
)
def test_all_linear_is_every_linear_layer_but_the_head(
    config: Callable[[], PretrainedConfig], expected: list[str]
) -> None:
    model = _meta(config())
    assert targets.resolve(model, "all-linear", "base") == expected
    assert "lm_head" not in targets.resolve(model, "all-linear", "base")
    assert JobConfig.model_validate(_job("base")).lora.target_modules == "all-linear"  # the default


def test_a_short_name_that_would_also_hit_another_module_stays_a_full_name() -> None:
    block = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 4)}), "attn": torch.nn.Module()})
    block["attn"].add_module("fc", torch.nn.Dropout())  # also called fc, and LoRA cannot wrap it
    block.add_module("out", torch.nn.Linear(4, 4))
    assert targets.resolve(block, "all-linear", "toy") == ["mlp.fc", "out"]
    assert targets.resolve(block, ["mlp.fc", "out"], "toy") == ["mlp.fc", "out"]


def test_misspelt_names_are_refused_naming_each_and_listing_the_layers() -> None:
    with pytest.raises(ConfigError) as err:
        targets.resolve(_meta(_qwen2()), ["q_proj", "v_prog", "k_prog"], "models/my-qwen")
    message = str(err.value)
    assert message.startswith("lora.target_modules: 'v_prog', 'k_prog' are not modules of models/my-qwen")
    assert "(model_type qwen2)" in message and "'q_proj'" not in message
    assert "its linear layers are: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in message
    assert "leave lora.target_modules out" in message


def test_a_module_lora_cannot_wrap_is_refused_and_the_head_may_be_named() -> None:
    model = _meta(_gpt2())
    with pytest.raises(ConfigError, match=r"'ln_1' is a LayerNorm in base \(model_type gpt2\), not a layer LoRA"):
        targets.resolve(model, ["c_attn", "ln_1"], "base")
    with pytest.raises(ConfigError, match="'attn' is a GPT2Attention"):
        targets.resolve(model, ["attn"], "base")
    assert targets.resolve(_meta(_llama()), [*LLAMA_NAMES, "lm_head"], "base") == sorted([*LLAMA_NAMES, "lm_head"])


def test_a_single_name_instead_of_a_list_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="must be a list of module names"):
        JobConfig.model_validate(_job("base", target_modules="q_proj"))


def test_the_controller_checks_from_the_config_alone_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    _gpt2().save_pretrained(tmp_path / "gpt2")
    job = JobConfig.model_validate(_job(tmp_path / "gpt2"))
    assert jobcheck.check_targets(job, REPO) == ["c_attn", "c_fc", "c_proj"]
    with pytest.raises(ConfigError, match="'q_proj' is not a module"):
        jobcheck.check_targets(JobConfig.model_validate(_job(tmp_path / "gpt2", target_modules=["q_proj"])), REPO)
    hub = JobConfig.model_validate(_job("someone/not-here", target_modules=["v_prog"]))
    assert jobcheck.check_targets(hub, REPO) is None  # a hub name: the ranks check it


def test_a_resolution_that_passed_is_kept_and_the_next_check_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpt2().save_pretrained(tmp_path / "gpt2")
    job = JobConfig.model_validate(_job(tmp_path / "gpt2"))
    cache = tmp_path / "cache"
    assert jobcheck.check_targets(job, REPO, cache) == ["c_attn", "c_fc", "c_proj"]

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the model again")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_build)
    assert jobcheck.check_targets(job, REPO, cache) == ["c_attn", "c_fc", "c_proj"]
    other = JobConfig.model_validate(_job(tmp_path / "gpt2", target_modules=["c_attn"]))
    with pytest.raises(AssertionError, match="built the model again"):  # other names: a new key, checked anew
        jobcheck.check_targets(other, REPO, cache)


def test_validate_refuses_a_misspelt_target_module_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job("models/tiny-llama", target_modules=["q_proj", "v_prog"])))
    result = cli("validate", "--job", str(path), timeout=120, env={"COLUMNS": "400"})
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    assert "error: lora.target_modules: 'v_prog' is not a module of models/tiny-llama (model_type llama)" in said
    assert "its linear layers are: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in said
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(("config", "expected"), [(_gpt2, ["c_attn", "c_fc", "c_proj"]), (_qwen2, LLAMA_NAMES)],
                         ids=["gpt2", "qwen2"])  # fmt: skip
def test_a_job_naming_no_modules_trains_any_architecture(
    config: Callable[[], PretrainedConfig], expected: list[str], tmp_path: Path, torchrun: Run
) -> None:
    config().save_pretrained(tmp_path / "base")
    job = _job(tmp_path / "base")
    job.update(
        data={"source": "data/sample/train.jsonl", "seq_len": 64}, optim={"lr": 0.02}, schedule={"warmup_steps": 2}
    )
    job.update(train={"max_steps": 16, "global_batch_size": 8, "log_every": 4, "seed": 7}, checkpoint={"every": 16})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = torchrun(path, tmp_path / "run", nproc=1)  # one rank: the architecture is the point here
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(tmp_path / "run")]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < 0.93 * losses[0], losses
    saved = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == expected
