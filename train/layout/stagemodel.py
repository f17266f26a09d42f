"""One pipeline stage's part of the base model: its decoder layers, plus the embedding or the head.

A stage is built as a model of its own: a copy of the base's config with the stage's number of layers,
and a safetensors file holding only the stage's tensors (layer ``start + i`` of the base becomes layer
``i`` of the stage). That directory then loads through the same path as a whole model (transformers,
dtype, 4-bit quantization, LoRA with peft), and the stage never holds another stage's weights, not even
while loading: tensors are read one by one from the base's safetensors files.

* the first stage keeps the embedding (its head is tied to it, so it costs nothing and is never used);
* a middle stage gets a one-row embedding stub (it is fed hidden states, never token ids);
* the last stage keeps the final norm and the head (and the embedding only where the head is tied to it);
* every stage but the last replaces the final norm with the identity: the norm applies once, at the end.

Names inside a stage are local (``layers.0`` is the stage's first layer); ``global_name`` and
``local_name`` translate, so checkpoints and the adapter use the base's own layer numbers whatever the cut.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from train.config import ConfigError, JobConfig
from train.data import templates
from train.data.blocks import model_inputs
from train.layout.topology import PIPELINE_TYPES, Stage
from train.model import load

LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_name(name: str, start: int) -> str:
    """The base's name of a stage's parameter: ``...layers.2.q_proj`` of a stage starting at 14 -> ``layers.16``."""
    return LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + start}.", name, count=1)


def local_name(name: str, start: int) -> str:
    return LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) - start}.", name, count=1)


def layer_of(name: str) -> int | None:
    match = LAYER.search(name)
    return int(match.group(2)) if match else None


def _stage_config(config: dict[str, Any], stage: Stage, first: bool, last: bool) -> dict[str, Any]:
    count = stage.end - stage.start
    out = dict(config, num_hidden_layers=count)
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = config["layer_types"][stage.start : stage.end]
    if "max_window_layers" in config and config["max_window_layers"] is not None:
        out["max_window_layers"] = max(0, int(config["max_window_layers"]) - stage.start)
    if not last:
        out["tie_word_embeddings"] = True  # the head is never used here: let it share the embedding's memory
    if not first and not last:
        out |= {"vocab_size": 1, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                "tie_word_embeddings": True}  # fmt: skip
    return out


def _base_tensors(source: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read it) for every tensor of a model directory's safetensors files, reading none until asked."""
    from safetensors import safe_open

    index = source / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
    for file in files or ["model.safetensors"]:
        with safe_open(str(source / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, functools.partial(handle.get_tensor, name)


def _wanted(name: str, stage: Stage, first: bool, last: bool, tied: bool) -> str | None:
    """The stage's name for a base tensor it needs, or None. Everything outside the decoder layers but the
    embedding and the head (the final norm: tiny) is loaded everywhere, so nothing is left uninitialized."""
    layer = layer_of(name)
    if layer is not None:
        return local_name(name, stage.start) if stage.start <= layer < stage.end else None
    if "embed_tokens" in name:
        return name if first or last else None  # a last stage without a tied head still has it in its config
    if name.startswith("lm_head"):
        return name if last and not tied else None
    return name


def _random_base(job: JobConfig, source: Path) -> dict[str, torch.Tensor]:
    """``init: random``: the whole base as a single process would build it (same seed), to cut from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.model.load import DTYPES

    torch.manual_seed(job.train.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)), dtype=DTYPES[job.model.dtype])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def write_stage(job: JobConfig, source: Path, stage: Stage, first: bool, last: bool, into: Path) -> Path:
    """A model directory holding only this stage's part of the base."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") not in PIPELINE_TYPES:
        raise ConfigError(
            f"model.source: pipeline stages support {', '.join(sorted(PIPELINE_TYPES))} models; "
            f"{config.get('model_type')!r} is not one. Use parallel: data"
        )
    tied = bool(config.get("tie_word_embeddings", False))
    base: Iterable[tuple[str, Callable[[], torch.Tensor]]] = (
        ((name, functools.partial(torch.Tensor.detach, value)) for name, value in _random_base(job, source).items())
        if job.model.init == "random"
        else _base_tensors(source)  # read lazily, while each file is open
    )
    tensors: dict[str, torch.Tensor] = {}
    for name, read in base:
        mine = _wanted(name, stage, first, last, tied)
        if mine is not None:
            tensors[mine] = read().contiguous()
    if not first and not last:  # fed hidden states, never token ids: a one-row stub keeps the model's shape
        dtype = next(iter(tensors.values())).dtype
        tensors["model.embed_tokens.weight"] = torch.zeros(1, int(config["hidden_size"]), dtype=dtype)
    into.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(into / "model.safetensors"), metadata={"format": "pt"})
    (into / "config.json").write_text(json.dumps(_stage_config(config, stage, first, last), indent=1))
    return into


def load_stage(job: JobConfig, code_dir: Path, stage: Stage, first: bool, last: bool, device: torch.device,
               scratch: Path) -> tuple[Any, Any]:  # fmt: skip
    """This stage's base with LoRA (peft) and the tokenizer; the final norm is the identity but on the last stage."""
    from train.model.load import add_lora_hf, load_base_hf, load_tokenizer, resolve_path, without_bitsandbytes

    without_bitsandbytes(job.model, "hf")
    source = Path(resolve_path(job.model.source, code_dir))
    tokenizer = load_tokenizer(job.model, code_dir)
    templates.apply(tokenizer, job.data, code_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"stage-{stage.start}-{stage.end}-", dir=scratch))
    try:
        write_stage(job, source, stage, first, last, folder)
        cfg = job.model.model_copy(update={"source": str(folder), "init": "pretrained"})
        base: Any = load_base_hf(cfg, code_dir, device, job.train.seed)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lora = job.lora
    if not last:
        base.model.norm = torch.nn.Identity()
        lora = _without_head(job)
    model = add_lora_hf(base, lora, job.model, job.rank_local.gradient_checkpointing)
    seed_lora(model, job.train.seed, stage.start)
    return model, tokenizer


def _without_head(job: JobConfig) -> Any:
    """The job's LoRA targets on a stage without the head: a listed head belongs to the last stage only."""
    names = job.lora.target_modules
    if names == "all-linear":
        return job.lora
    kept = [n for n in names if n != "lm_head" and not n.endswith(".lm_head")]
    if not kept:
        raise ConfigError("lora.target_modules: only the head is listed, and only the last pipeline stage has it; "
                          "add the decoder layers' linears (or all-linear)")  # fmt: skip
    return job.lora.model_copy(update={"target_modules": kept})


def seed_lora(model: torch.nn.Module, seed: int, start: int = 0) -> None:
    """Initialize every LoRA A matrix from its base name and the job's seed (peft's kaiming-uniform; B stays 0).

    Stages build their layers separately, so peft's own initialization, drawn from one random stream in
    module order, would give a stage's layer other values than the whole model's; seeded by name, a layer
    starts the same in every layout, and a pipeline's first step equals the single process's.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                generator = torch.Generator().manual_seed(
                    seed * 1_000_003 + zlib.crc32(global_name(name, start).encode())
                )
                value = torch.empty(param.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
                param.copy_(value.to(param.dtype))


def forward(
    model: Any, inputs: torch.Tensor, batch: dict[str, torch.Tensor], first: bool, last: bool, logits: bool = True
) -> torch.Tensor:
    """Token ids (first stage) or hidden states in; hidden states out, or logits from the last stage (its final
    hidden states, the head's input, with ``logits=False``: train/model/headloss.py takes the loss from them). ``batch``
    gives the rows' mask or, packed, their per-example positions (train/data/blocks.py ``model_inputs``)."""
    causal_lm = model.get_base_model()
    # A whole replica on unsloth (it loads through load_model): packed rows joined, with their lengths, or its
    # attention lets the examples of a row see each other; the output is cut back into the rows.
    joined = first and last and "position_ids" in batch and load.packs_by_lengths(model)
    given = model_inputs(batch, by_lengths=joined) | {"use_cache": False}
    ids = given.pop("input_ids")
    feed = {"input_ids": ids if joined else inputs} if first else {"inputs_embeds": inputs}
    out = causal_lm(**feed, **given).logits if last and logits else causal_lm.model(**feed, **given).last_hidden_state
    return out.reshape(*inputs.shape[:2], -1) if joined else out  # type: ignore[no-any-return]
