"""What the controller checks and prepares for a job before any host is touched.

The data is read once here: a malformed record, a missing field or an empty file is one error naming
the file and line, not an exception inside a rank after launch. A base model that comes from a wheel
is converted here, once, so that every node receives the same files with the code.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from train.config import ConfigError, JobConfig
from train.data import pairs, templates
from train.data.records import Record, held_out_records, messages, training_data
from ugro.model import basemodel


@dataclass(frozen=True)
class DataSummary:
    train_records: int
    eval_records: int


# A held-out note this short (a heading, a separator, a signature) may well repeat a trained one: not leakage.
SHORT_NOTE_WORDS = 8


def _questions(records: list[Record], fmt: str) -> dict[str, str]:
    """Every record's prompt side (all turns but the answers; a preference item's prompt; a whole note) -> where
    it is."""
    found: dict[str, str] = {}
    for record in records:
        if fmt == "text":
            key = str(record.fields["text"])
            if len(key.split()) < SHORT_NOTE_WORDS:
                continue
        else:  # a pair's or an unpaired example's prompt, as an SFT record's
            turns = pairs.prompt_of(record, fmt) if fmt in pairs.PAIR_FORMATS else messages(record.fields, fmt)
            key = "\n".join(t["content"] for t in turns if t["role"] != "assistant")
        found.setdefault(key, record.where)
    return found


def check_data(job: JobConfig, repo: Path) -> DataSummary:
    """Read and check the training and held-out data; an evaluation question also trained on is an error."""
    templates.named(job.data.template, repo)  # a .jinja file that is not there is refused before anything starts
    train = training_data(job.data, repo, job.train.seed, check=True).records
    if job.eval is None:
        return DataSummary(len(train), 0)
    held_out = held_out_records(job.eval.source, job.data, repo, check=True)
    trained = _questions(train, job.data.format)
    asked = "prompt" if job.data.format in pairs.PAIR_FORMATS else "question"
    for question, where in _questions(held_out, job.data.format).items():
        if question in trained:
            raise ConfigError(
                f"{where}: this held-out {asked} is also trained on ({trained[question]}), so the evaluation "
                "would measure memory, not learning; remove it from one of the two files"
            )
    return DataSummary(len(train), len(held_out))


def model_dir(job: JobConfig, repo: Path) -> Path | None:
    """The job's base model directory inside the repository, when it is one (not a hub name)."""
    path = Path(job.model.source)
    path = path if path.is_absolute() else repo / path
    return path if path.is_dir() else None


def prepare_model(job: JobConfig, repo: Path, say: object = print) -> None:
    """Convert the job's base model from its wheel when its directory has a recipe and is not converted yet."""
    directory = model_dir(job, repo)
    if directory is None:
        return
    try:
        basemodel.ensure(directory, say)
    except basemodel.ModelError as exc:
        raise ConfigError(f"model.source: {exc}") from None


def check_targets(job: JobConfig, repo: Path, cache: Path | None = None) -> list[str] | None:
    """The job's LoRA target modules resolved against its base model's structure, or ConfigError naming every
    module the job names that the model lacks.

    The model is built from its config.json on the meta device: no weights, but transformers' model code is
    imported (~3 s). A resolution that passed is kept in ``cache`` (a directory), keyed by the config, the
    names and the transformers version, so the next launch of the same job does not pay it again. None when the
    config cannot be read or built here (a hub name, a model that needs its own code, a base not converted
    yet): the ranks check it on the loaded base.
    """
    directory = model_dir(job, repo)
    config_file = None if directory is None else directory / "config.json"
    if config_file is None or not config_file.is_file():
        return None
    versions = [importlib.metadata.version(name) for name in ("transformers", "peft")]
    key = hashlib.sha256(json.dumps([config_file.read_text(), job.lora.target_modules, versions]).encode())
    known = None if cache is None else cache / f"{key.hexdigest()[:32]}.json"
    if known is not None and known.is_file():
        return list(json.loads(known.read_text()))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.model import targets  # torch: imported only when a check runs, not by every command of the CLI

    try:
        config = AutoConfig.from_pretrained(config_file.parent)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError):
        return None
    resolved = targets.resolve(model, job.lora.target_modules, job.model.source)
    if known is not None:
        known.parent.mkdir(parents=True, exist_ok=True)
        known.write_text(json.dumps(resolved))
    return resolved


def model_dirs(job: JobConfig, repo: Path) -> list[str]:
    """The job's converted base model directory relative to the repository (the launch copies it to nodes)."""
    directory = model_dir(job, repo)
    if directory is None or not (directory / basemodel.RECIPE).is_file():
        return []
    return [directory.resolve().relative_to(repo.resolve()).as_posix()]
