"""``make export JOB_ID=...``: the run's LoRA adapter merged into its base, as an ordinary transformers model.

Runs on the controller over a collected run (runs/<job-id>/adapter). The merged model is checked before it
is kept: on a fixed probe its logits must equal base + adapter (fp32) and differ from the base's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.config import ConfigError

TOLERANCE = 1e-4
PROBE = "What should I check when torchrun hangs at the rendezvous?"


# What a merged directory holds, for its model card.
FILES_DESCRIBED = {
    "model.safetensors": "the weights: the base with the LoRA update added (float32)",
    "config.json": "the architecture (transformers)",
    "generation_config.json": "generation defaults",
    "tokenizer.json": "the tokenizer",
    "tokenizer_config.json": "the tokenizer's settings and special tokens",
    "chat_template.jinja": "the chat template the run trained with",
}


def listing(out: Path) -> list[tuple[str, str]]:
    """The merged directory's files with what each is (the model card's table)."""
    return [(name, what) for name, what in FILES_DESCRIBED.items() if (out / name).is_file()]


@dataclass(frozen=True)
class Exported:
    out: Path
    max_diff_vs_adapter: float
    max_diff_vs_base: float


def base_of(adapter: Path, repo: Path) -> Path:
    """The base model the adapter was trained on (adapter_config.json), relative to the repository if so."""
    config = adapter / "adapter_config.json"
    if not config.is_file():
        raise ConfigError(f"{adapter}: no adapter_config.json (did the run finish? `make logs` collects it)")
    name = str(json.loads(config.read_text()).get("base_model_name_or_path") or "")
    path = Path(name) if Path(name).is_absolute() else repo / name
    if not path.is_dir():
        raise ConfigError(
            f"{config}: its base model '{name}' is not a directory here; run `make train` once to convert it"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(
            f"{path}: only the base model's config is here, no weights: the run built its base from the config with "
            "random weights (model.init: random), so there is no base to merge the adapter into. Export a run "
            "whose job loads pretrained weights (model.init: pretrained)"
        )
    return path


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def load_tuned(adapter: Path, base_dir: Path) -> tuple[Any, Any]:
    """The adapter on its fp32 base (peft, in eval mode) and the tokenizer the run saved with it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval(), tokenizer


def export(adapter: Path, out: Path, repo: Path) -> Exported:
    base_dir = base_of(adapter, repo)  # before the slow imports: a refusal comes at once
    model, tokenizer = load_tuned(adapter, base_dir)
    ids = tokenizer(PROBE, return_tensors="pt")["input_ids"]
    with_adapter = _logits(model, ids)
    with model.disable_adapter():
        base = _logits(model, ids)
    merged = model.merge_and_unload()
    merged_logits = _logits(merged, ids)
    result = Exported(
        out,
        float((merged_logits - with_adapter).abs().max()),
        float((merged_logits - base).abs().max()),
    )
    if result.max_diff_vs_adapter > TOLERANCE or result.max_diff_vs_base <= TOLERANCE:
        raise ConfigError(
            f"the merged model does not reproduce base + adapter (max logit difference "
            f"{result.max_diff_vs_adapter:.2e}, vs the base {result.max_diff_vs_base:.2e}); nothing was written"
        )
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return result
