"""Model loading: unsloth on CUDA when available, transformers + peft otherwise.

Each branch is a small function of its own so that the CUDA ones can be exercised directly on a
GPU machine. The frozen base is loaded from disk (or built from a seeded config) on every rank,
so DDP never has to broadcast it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, cast

import torch

from train.config import ConfigError, JobConfig, LoraConfig, ModelConfig
from train.data import templates
from train.dist import devicecheck
from train.model import headloss, targets

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(name: str, base_dir: Path) -> str:
    """A local directory relative to the code dir when it exists there, else the name as given (hub)."""
    candidate = Path(name) if Path(name).is_absolute() else base_dir / name
    return str(candidate) if candidate.exists() else name


def resolve_backend(cfg: ModelConfig, cuda: bool) -> str:
    unsloth_ok = cuda and importlib.util.find_spec("unsloth") is not None
    if cfg.backend == "unsloth" and not unsloth_ok:
        why = "CUDA is not available" if not cuda else "the unsloth package is not installed"
        raise ConfigError(f"model.backend: 'unsloth' was asked for but {why}; use 'auto' or 'hf'")
    if cfg.quantization == "4bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("model.quantization: '4bit' needs bitsandbytes, which is not installed on this host")
    if cfg.backend == "auto":
        return "unsloth" if unsloth_ok else "hf"
    return cfg.backend


def without_bitsandbytes(cfg: ModelConfig, backend: str) -> None:
    """Keep bitsandbytes out of a rank that does not quantize through transformers + peft.

    peft imports it whenever it is installed (it is, on every node: the QLoRA jobs need it), and its import
    pulls in torch's compiler stack: ~0.8 s of CPU per rank at every start, and a warning about a kernel hub
    on CPU hosts. A None entry in sys.modules is Python's own way to make a module absent: importing it raises
    ImportError and importlib.util.find_spec answers None, which is what peft and transformers ask."""
    if backend == "hf" and cfg.quantization == "none" and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


def preload_cpu(cfg: ModelConfig) -> None:
    """Import what a CPU rank's ``load_model`` imports (transformers' auto classes and peft, without bitsandbytes
    where the rank keeps it out), for a launcher that forks CPU ranks once it has (train/launcher.py)."""
    without_bitsandbytes(cfg, resolve_backend(cfg, cuda=False))
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def load_tokenizer(cfg: ModelConfig, base_dir: Path) -> Any:
    from transformers import AutoTokenizer

    name = resolve_path(cfg.tokenizer or cfg.source, base_dir)
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.tokenizer: cannot load a tokenizer from '{name}': {exc}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def quantization_config(cfg: ModelConfig, device: torch.device) -> Any:
    """bitsandbytes NF4 with double quantization. It computes in the job's dtype; a float32 job computes in
    bfloat16 on CUDA (the usual QLoRA setting) and in float32 on CPU (where bfloat16 matmuls are slow)."""
    from transformers import BitsAndBytesConfig

    compute = DTYPES[cfg.dtype] if cfg.dtype != "float32" or device.type == "cpu" else torch.bfloat16
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )


def load_base_hf(cfg: ModelConfig, base_dir: Path, device: torch.device, seed: int) -> torch.nn.Module:
    """The frozen base model through transformers, on this rank's device only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = resolve_path(cfg.source, base_dir)
    dtype = DTYPES[cfg.dtype]
    try:
        if cfg.init == "random":
            config = AutoConfig.from_pretrained(name)
            torch.manual_seed(seed)  # identical base weights on every rank
            model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)
            return cast(torch.nn.Module, model.to(device))
        # One whole copy per rank on its own device: "auto" would silently split the model across GPUs.
        kwargs: dict[str, Any] = {"dtype": dtype, "device_map": {"": device.index if device.type == "cuda" else "cpu"}}
        if cfg.quantization == "4bit":
            kwargs["quantization_config"] = quantization_config(cfg, device)
        with devicecheck.paused():
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.source: cannot load '{name}': {exc}") from None
    if cfg.quantization == "4bit" and device.type == "cpu":
        keep_4bit_trainable_on_cpu(model)
    if devicecheck.installed():
        model.to(device)  # the device checker's rank device (cpu:0): the weights are where a GPU rank has them
    return cast(torch.nn.Module, model)


def keep_4bit_trainable_on_cpu(model: torch.nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers on the path that gradients flow through.

    On a CPU with AVX-512 BF16, a ``Linear4bit`` that runs once in eval mode on an input without grad (the
    held-out loss before step 1) repacks its weight, for good, for a bfloat16 inference kernel that autograd
    cannot go through. Every later training step then gets no gradient from below that layer: the held-out loss
    of the short 4-bit test fell 0.3 % instead of 12 %. The flag that allows the repacking is per layer."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (a bitsandbytes attribute torch does not type)


def target_modules(model: torch.nn.Module, lora: LoraConfig, cfg: ModelConfig) -> list[str]:
    """The job's lora.target_modules made concrete for this base (train/model/targets.py), logged once."""
    names = targets.resolve(model, lora.target_modules, cfg.source)
    log.info("LoRA target modules (lora.target_modules: %s): %s", lora.target_modules, ", ".join(names))
    return names


def add_lora_hf(model: Any, lora: LoraConfig, cfg: ModelConfig, checkpointing: bool) -> Any:
    """Freeze the base and attach LoRA adapters with peft."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    names = target_modules(model, lora, cfg)
    if cfg.quantization == "4bit":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=names,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as exc:
        raise ConfigError(f"lora.target_modules: {exc}") from None


def load_unsloth(job: JobConfig, base_dir: Path, local_rank: int, checkpointing: bool) -> tuple[Any, Any]:
    """unsloth's FastLanguageModel with its LoRA patching (CUDA only)."""
    from unsloth import FastLanguageModel

    cfg = job.model
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=resolve_path(cfg.source, base_dir),
        max_seq_length=job.data.seq_len,
        dtype=None if cfg.dtype == "float32" else DTYPES[cfg.dtype],
        load_in_4bit=cfg.quantization == "4bit",
        device_map={"": local_rank},
    )
    names = target_modules(model, job.lora, cfg)  # unsloth gets explicit names, never the shorthand
    model = FastLanguageModel.get_peft_model(
        model,
        r=job.lora.r,
        lora_alpha=job.lora.alpha,
        lora_dropout=job.lora.dropout,
        target_modules=names,
        bias="none",
        use_gradient_checkpointing="unsloth" if checkpointing else False,
        random_state=job.train.seed,
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


BY_LENGTHS = "_ugro_packs_by_lengths"  # the model's attribute that says so


def packs_by_lengths(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps packed examples apart only when told their lengths (unsloth: its attention reads
    ``packed_seq_lengths``, not restarting positions; train/data/blocks.py ``model_inputs``)."""
    return bool(getattr(headloss.causal_lm(model), BY_LENGTHS, False))


def pack_by_lengths(model: torch.nn.Module) -> None:
    """From now on ``model`` is called with packed rows joined and their lengths (``packs_by_lengths``)."""
    setattr(headloss.causal_lm(model), BY_LENGTHS, True)


def load_model(job: JobConfig, base_dir: Path, device: torch.device) -> tuple[Any, Any, str]:
    """Base model + LoRA + tokenizer for this rank; returns the backend actually used."""
    cuda = device.type == "cuda"
    backend = resolve_backend(job.model, cuda)
    checkpointing = job.rank_local.gradient_checkpointing
    if backend == "unsloth" and job.model.init == "pretrained":
        model, tokenizer = load_unsloth(job, base_dir, device.index or 0, checkpointing)
        pack_by_lengths(model)
        templates.apply(tokenizer, job.data, base_dir)
        headloss.head(model)  # how the loss reaches the vocabulary, decided (and logged) once
        return model, tokenizer, backend
    if backend == "unsloth":
        log.info("model.init is 'random': unsloth loads pretrained weights only, using transformers + peft")
        backend = "hf"
    without_bitsandbytes(job.model, backend)
    tokenizer = load_tokenizer(job.model, base_dir)
    templates.apply(tokenizer, job.data, base_dir)
    base = load_base_hf(job.model, base_dir, device, job.train.seed)
    model = add_lora_hf(base, job.lora, job.model, checkpointing)
    headloss.head(model)
    return model, tokenizer, backend
