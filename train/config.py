"""Typed job configuration: cluster-wide keys, rank-local keys, and how they are loaded.

A job file holds every knob of a run. Its keys come in two kinds:

* cluster-wide keys (model, LoRA, data recipe, optimizer, schedule, batch, seed, ...) must be
  identical on every rank, or DDP trains different models on different hosts;
* rank-local keys (the ``rank_local`` section) only change how one rank computes its share:
  micro-batch size, gradient checkpointing, data-loader workers. A host's memory profile
  (``/etc/ugro/profile.yaml``) may override these, and only these.

Every error names the file and the dotted key, and says what is accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(Exception):
    """A job file or profile that cannot be used; the message names the file and key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    source: str = Field(description="Hub name or local directory of the base model (or of its config).")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="'random' builds the model from its config.json with seeded random weights."
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory or hub name; defaults to source.")
    backend: Literal["auto", "unsloth", "hf"] = "auto"
    quantization: Literal["none", "4bit"] = "none"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("dtype")
    @classmethod
    def _not_float16(cls, value: str) -> str:
        if value == "float16":
            raise ValueError(
                "model.dtype: float16 trains without loss scaling: the loss's gradients are scaled by about "
                "1/tokens in the weights' dtype and underflow to zero in float16. Set model.dtype: bfloat16 (every "
                "card from the RTX 30 series on, the reference cluster's included) or float32 (older cards without "
                "bfloat16)"
            )
        return value


class LoraConfig(_Strict):
    r: int = Field(16, gt=0)
    alpha: int = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: Annotated[list[str], Field(min_length=1)] | Literal["all-linear"] = Field(
        "all-linear",
        description="The layers LoRA goes on. all-linear (the default): every linear layer of the base but its output "
        "head, resolved from the model's structure (Llama, Qwen2: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj; GPT-2: c_attn, c_proj, c_fc). A list names them: a module matches when its dotted name is the "
        "entry or ends with '.' + the entry; a name that matches no module, or no layer LoRA can wrap, is refused "
        "before launch.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_or_all_linear(cls, value: object) -> object:
        """One error for every other shape, instead of one per member of the union."""
        names = isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)
        if value != "all-linear" and not names:
            raise ValueError("must be a list of module names ([q_proj, v_proj]) or 'all-linear' (the default)")
        return value


# The fields each data.format reads, which data.columns may map from other names (docs/data.md).
FORMAT_FIELDS = {
    "instruction": ("instruction", "input", "output"),
    "chat": ("messages", "role", "content"),
    "text": ("text",),
    # Preference pairs (train.method dpo, orpo, kto): TRL's prompt / chosen / rejected, each a string or a list of
    # messages (ShareGPT's 'conversations' as the prompt, with chosen / rejected {from, value} turns).
    "preference": ("prompt", "chosen", "rejected", "system", "role", "content"),
    # Unpaired examples (train.method kto): a prompt, one completion and whether it is desirable (TRL's 'label').
    "unpaired": ("prompt", "completion", "label", "system", "role", "content"),
}
# What train.method each data.format serves (and the format a method reads by default: the first).
METHOD_FORMATS = {
    "sft": ("instruction", "chat", "text"),
    "dpo": ("preference",),
    "orpo": ("preference",),
    "kto": ("preference", "unpaired"),
}
# The loss variants of each preference method (preference.loss), the first the default: TRL's names and formulas.
METHOD_LOSSES = {"dpo": ("sigmoid", "hinge", "ipo", "robust"), "kto": ("kto", "apo_zero_unpaired"), "orpo": ("orpo",)}
ChatRole = Literal["system", "user", "assistant"]


class DataSet(_Strict):
    """One of several data sets of a job (data.sources), with its weight and, where its shape differs from the
    others, a column and role mapping of its own."""

    source: str = Field(description="A data file, folder or hub name, as data.source.")
    weight: float = Field(
        1.0,
        gt=0,
        le=100,
        description="How many times its records count in an epoch: 2 repeats every record, 0.5 takes a seeded half "
        "of them (train.seed), 1.5 every record and a seeded half again.",
    )
    columns: dict[str, str] | None = Field(None, description="As data.columns, for this set (default: data.columns).")
    roles: dict[str, ChatRole] | None = Field(None, description="As data.roles, for this set (default: data.roles).")


class DataConfig(_Strict):
    source: str | None = Field(
        None,
        description="Local .jsonl/.json/.csv/.parquet file, .txt/.md notes (data.format text) or a folder of them, "
        "a datasets folder, or a datasets hub name (docs/data.md). Or data.sources, for several.",
    )
    sources: list[DataSet] | None = Field(
        None, min_length=1, description="Several data sets in one job, each with a weight (instead of data.source)."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="The record's own names of the fields data.format reads: instruction: {instruction: question, "
        "input: context, output: answer}; chat: {messages: dialog, role: speaker, content: text}; text: {text: "
        "body}.",
    )
    roles: dict[str, ChatRole] = Field(
        default_factory=dict,
        description="Speaker names of a chat data set and the chat role each stands for ({customer: user, agent: "
        "assistant}), beside the usual ones (user, assistant, system; ShareGPT's human and gpt).",
    )
    format: Literal["instruction", "chat", "text", "preference", "unpaired"] = "instruction"
    split: str = "train"
    seq_len: int = Field(256, ge=8)
    packing: bool = True
    train_on: Literal["completion", "all"] = "completion"
    template: str = Field(
        "auto",
        description="How instruction and chat records become text. chat: the tokenizer's own chat template (what "
        "an instruct model was trained with); plain: '### Instruction / ### Response' text; auto: chat when the "
        "tokenizer has a chat template; chatml, or a .jinja file: that chat template, which the run's tokenizer "
        "then carries (make chat, the GGUF export and the Ollama Modelfile use it).",
    )

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        if value not in ("auto", "chat", "plain", "chatml") and not value.endswith(".jinja"):
            raise ValueError(f"'{value}' is no template: use auto, chat, plain, chatml or a .jinja file's path")
        return value

    @model_validator(mode="after")
    def _one_source_and_known_columns(self) -> DataConfig:
        if (self.source is None) == (self.sources is None):
            raise ValueError(
                "name the training data in data.source (one data set) or in data.sources (several), one of the two"
            )
        known = FORMAT_FIELDS[self.format]
        mappings = [("data.columns", self.columns)] + [
            (f"data.sources[{i}].columns", s.columns or {}) for i, s in enumerate(self.sources or [])
        ]
        for key, columns in mappings:
            for name, theirs in columns.items():
                if name not in known:
                    raise ValueError(f"{key}: '{name}' is no field of data.format '{self.format}' (it reads "
                                     f"{', '.join(known)}); map those to your records' names, such as {known[0]}: "
                                     f"{theirs}")  # fmt: skip
                if not theirs:
                    raise ValueError(f"{key}.{name}: name the field of your records that holds {name}")
        return self

    def sets(self) -> list[DataSet]:
        """Every training data set, each with the column and role mapping that applies to it."""
        if self.source is not None:
            return [DataSet(source=self.source, columns=self.columns, roles=self.roles)]
        return [
            s.model_copy(update={"columns": s.columns if s.columns is not None else self.columns,
                                 "roles": s.roles if s.roles is not None else self.roles})
            for s in self.sources or []
        ]  # fmt: skip


class EvalConfig(_Strict):
    """Held-out evaluation: loss before the first step, every N steps and after the last; answers before/after."""

    source: str = Field(description="Held-out records in data.format (no record of it may be in data.source).")
    every: int = Field(10, gt=0, description="Optimizer steps between evaluations (plus before and after training).")
    samples: int = Field(3, ge=0, description="Held-out questions answered by the base and the fine-tuned model.")
    max_new_tokens: int = Field(64, gt=0, description="Length limit of each greedy sample answer.")
    batch_size: int = Field(8, gt=0, description="Held-out records per forward pass on a rank.")
    tasks: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks `make eval` runs on the base and the tuned model once training "
        "finished (docs/export.md): heldout (the job's own held-out set, generated from eval.source: perplexity, and "
        "for chat and instruction data a generation task) and any task whose data is local or cached. Empty: none "
        "after training (`make eval` still runs heldout).",
    )
    tasks_limit: int | None = Field(
        None, gt=0, description="At most this many documents of each lm-evaluation-harness task (none: all)."
    )


class OptimConfig(_Strict):
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)


class ScheduleConfig(_Strict):
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class RunConfig(_Strict):
    method: Literal["sft", "dpo", "orpo", "kto"] = Field(
        "sft",
        description="sft: supervised fine-tuning on answers; dpo, orpo, kto: preference tuning on chosen and "
        "rejected answers (data.format preference, or unpaired for kto; knobs in the preference section; "
        "docs/preference.md). With a preference method, train.global_batch_size and rank_local.micro_batch_size "
        "count pairs (kto: examples), each two rows of data.seq_len.",
    )
    max_steps: int = Field(100, gt=0, description="Optimizer steps of the run (or give train.epochs instead).")
    epochs: float | None = Field(
        None,
        gt=0,
        description="Passes over the training rows (after packing) instead of train.max_steps: the run takes "
        "ceil(epochs x rows / global_batch_size) steps; `make validate` prints the steps of one epoch.",
    )
    global_batch_size: int = Field(16, gt=0, description="Sequences per optimizer step, summed over all ranks.")
    seed: int = 1234
    log_every: int = Field(5, gt=0)
    max_restarts: int = Field(
        3,
        ge=0,
        description="How many times the controller relaunches the job after a failure it can recover from (a lost "
        "host, a crashed rank, a collective error); the run ends failed once they are used up.",
    )
    min_hosts: int = Field(
        1,
        gt=0,
        description="The fewest hosts the job may continue on after losing some; with fewer it ends failed.",
    )


class PreferenceConfig(_Strict):
    """The preference methods' knobs (train.method dpo, orpo, kto), as TRL names them (docs/preference.md)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo, kto: how far the tuned model may move from the reference (the base: the adapter off); "
        "ipo: its regularization tau; orpo: the weight of the odds-ratio term beside the chosen answers' NLL.",
    )
    loss: str | None = Field(
        None,
        description="The method's loss variant: dpo: sigmoid (the default), hinge, ipo, robust; kto: kto (the "
        "default), apo_zero_unpaired (no KL term); orpo has one.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo with loss robust: the assumed share of pairs whose chosen and rejected answers are swapped.",
    )
    reference: Literal["live", "cached"] = Field(
        "live",
        description="dpo, kto: the reference log-probabilities. live: computed at every step with the adapter off; "
        "cached: once per pair, the first time a rank trains it, and kept (the base never changes: the same "
        "figures, one forward pass fewer per pair after the first epoch).",
    )
    desirable_weight: float = Field(1.0, gt=0, description="kto: the weight of a desirable example's loss.")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: the weight of an undesirable example's loss.")
    disable_dropout: bool = Field(
        True,
        description="Dropout off in the model and its LoRA layers (as TRL's disable_dropout), so that the tuned "
        "model's and the reference's log-probabilities differ by the adapter alone.",
    )


class CheckpointConfig(_Strict):
    every: int = Field(50, gt=0, description="Optimizer steps between checkpoints; the last step always saves.")
    keep_last: int = Field(3, gt=0)
    replicas: int = Field(
        0,
        ge=0,
        description="Besides the controller's copy, how many other hosts of the job also keep every checkpoint "
        "(the controller pushes its verified copy to them), so a resume does not depend on the controller's disk.",
    )


class DistributedConfig(_Strict):
    timeout_s: int = Field(
        120,
        gt=0,
        description="Process-group timeout: a collective waiting longer fails, so a rank whose peer was lost (its "
        "host died, its link was cut) ends within this many seconds instead of hanging (torch's default is 600).",
    )
    startup_timeout_s: int = Field(
        1800,
        gt=0,
        description="How long ranks wait for each other where each takes its own time: loading the model and "
        "data at the start, and the main rank writing the adapter and samples at the end.",
    )
    regroup_timeout_s: int = Field(
        60,
        ge=0,
        description="When a host is lost, how long the surviving ranks try to learn who is left (from the controller "
        "that follows the run, or, where none does, by agreeing among themselves: train/recovery/consensus.py) "
        "and then go on in their own processes, nothing redone (train/recovery/membership.py); after that they fail "
        "and a controller relaunches from a checkpoint. 0: never regroup, always relaunch.",
    )
    rejoins: int = Field(
        2,
        ge=0,
        description="When a rank crashes on a host that stays up (the OOM killer, a driver error), the other hosts go "
        "on without it and that host's ranks start again and rejoin them, taking the step, weights and optimizer "
        "state from them (train/recovery/rejoin.py): at most this many times per host and launch, and no more than "
        "train.max_restarts. 0: a controller relaunches every host from a checkpoint instead.",
    )
    grad_compression: Literal["auto", "bf16", "none"] = Field(
        "auto",
        description="Gradients are all-reduced in bf16 (half the bytes). auto: bf16 when the trainable weights are "
        "fp32 and the ranks span more than one host (a network link); none on a single host.",
    )
    calibration_steps: int = Field(
        3,
        gt=0,
        description="balance: auto -- steps timed before the first measured plan and between re-plans; speeds "
        "are the median of the last 2n-1 steps, so a single slow step never moves work.",
    )
    replan_threshold: float = Field(
        0.10,
        gt=0,
        lt=1,
        description="balance: auto -- re-plan when a plan from the latest step times would shorten the step by more "
        "than this fraction.",
    )


class RankLocalConfig(_Strict):
    """The only knobs a host's memory profile may change."""

    micro_batch_size: int = Field(
        4, gt=0, description="The largest micro-batch this rank's memory holds; the balancer never exceeds it."
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Optional token budget of one micro-batch on this rank (sequences x data.seq_len). A profile "
        "that gives a budget stays right for every sequence length; the micro-batch is then at most "
        "micro_batch_tokens // data.seq_len sequences (and never more than micro_batch_size).",
    )
    gradient_checkpointing: bool = False
    memory_gib: float | None = Field(
        None,
        gt=0,
        description="The memory this rank may use for the model, its activations and the optimizer (GiB). The "
        "stage planner sizes pipeline stages by it; unset: the GPU's memory, or on a CPU host its available "
        "memory divided among its ranks.",
    )

    def cap(self, seq_len: int) -> int:
        """The most sequences of ``seq_len`` tokens one micro-batch of this rank may hold."""
        if self.micro_batch_tokens is None:
            return self.micro_batch_size
        return max(1, min(self.micro_batch_size, self.micro_batch_tokens // seq_len))

    def budget_problem(self, seq_len: int) -> str | None:
        """Why one sequence does not fit this rank's token budget, or None."""
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < seq_len:
            return (
                f"rank_local.micro_batch_tokens ({self.micro_batch_tokens}) is smaller than one sequence "
                f"(data.seq_len {seq_len}): raise the budget to at least {seq_len} or lower data.seq_len"
            )
        return None


class BenchmarkConfig(_Strict):
    """Only for `make bench`: the worker refuses a job that sets it unless started by the benchmark."""

    emulate_speed: list[float] = Field(
        min_length=1,
        description="Per global rank, a speed factor in (0, 1]: the rank emulates a device that needs "
        "seconds_per_token / f per token.",
    )
    seconds_per_token: float = Field(
        gt=0,
        description="Compute time per token of the emulated speed-1.0 device. Each micro-batch lasts its tokens x "
        "seconds_per_token / f: the rank computes it for real, then sleeps the rest (make bench sets it from this "
        "machine's measured time per token, divided by --scale, so the real compute always fits).",
    )

    @model_validator(mode="after")
    def _check_factors(self) -> BenchmarkConfig:
        bad = [f for f in self.emulate_speed if not 0 < f <= 1]
        if bad:
            raise ValueError(f"speed factors must be in (0, 1], got {bad}")
        return self


Balance = Literal["auto", "equal"] | dict[str, Annotated[float, Field(gt=0)]]


class StagesConfig(_Strict):
    """A pipeline layout fixed by the user instead of planned (docs/pipeline.md)."""

    stages: Annotated[int, Field(gt=0)] | Annotated[list[Annotated[int, Field(gt=0)]], Field(min_length=1)] = Field(
        description="Stages per pipeline: a number (the planner sizes each stage's layers by its host's memory and "
        "speed) or the decoder layers of each stage, first to last, e.g. [14, 16] (the planner picks which host "
        "takes which stage). The ranks form as many pipelines of this many stages as they fill; every rank must "
        "belong to one."
    )


Parallel = Literal["auto", "data"] | StagesConfig


class MlflowConfig(_Strict):
    """Where `report_to: [mlflow]` logs (docs/monitoring.md); unset keys come from MLflow's own variables."""

    tracking_uri: str | None = Field(
        None, description="The tracking server (http://host:5000) or store; else MLFLOW_TRACKING_URI."
    )
    experiment: str | None = Field(None, description="The experiment; else MLFLOW_EXPERIMENT_NAME, else the job name.")


class WandbConfig(_Strict):
    """Where `report_to: [wandb]` logs (docs/monitoring.md); unset keys come from W&B's own variables. The API key
    only ever comes from WANDB_API_KEY or `wandb login`, never from a job file (which is recorded with the run)."""

    project: str | None = Field(None, description="The project; else WANDB_PROJECT, else the job name.")
    entity: str | None = Field(None, description="The team or user; else WANDB_ENTITY, else the key's default.")
    mode: Literal["online", "offline"] | None = Field(
        None,
        description="offline: the run stays in runs/<job-id>/wandb for `wandb sync`; else WANDB_MODE, else online.",
    )


Tracker = Literal["mlflow", "wandb"]

CLUSTER_WIDE_SECTIONS = (
    "model", "lora", "data", "eval", "optim", "schedule", "train", "preference", "checkpoint", "distributed",
)  # fmt: skip


class JobConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)
    model: ModelConfig
    lora: LoraConfig = LoraConfig()
    data: DataConfig
    eval: EvalConfig | None = None
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: RunConfig = RunConfig()
    preference: PreferenceConfig = PreferenceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    balance: Balance = Field(
        "auto",
        description="How each global batch is split across ranks. auto: by measured throughput, re-planned when it "
        "drifts; equal: the same share for every rank; {host: weight}: fixed shares by host (every rank of a host "
        "gets the host's weight). Micro-batches never exceed a rank's rank_local.micro_batch_size (nor its "
        "rank_local.micro_batch_tokens).",
    )
    parallel: Parallel = Field(
        "auto",
        description="How ranks share the model. auto: every rank holds the whole model (data parallel) when it fits "
        "every rank's memory, else the model is cut into pipeline stages sized to each host's memory and speed; "
        "data: always data parallel; {stages: N} or {stages: [layers, ...]}: pipelines of that shape.",
    )
    rank_local: RankLocalConfig = RankLocalConfig()
    benchmark: BenchmarkConfig | None = None
    report_to: list[Tracker] = Field(
        default_factory=list,
        description="Trackers the controller reports the run to besides its records in runs/<job-id>/ and "
        "TensorBoard (always written): mlflow and/or wandb, one tracker run per job (docs/monitoring.md).",
    )
    mlflow: MlflowConfig = MlflowConfig()
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> JobConfig:
        if self.train.epochs is not None and "max_steps" in self.train.model_fields_set:
            raise ValueError("train.max_steps and train.epochs both say how long to train: give one of them")
        if self.train.epochs is None and self.schedule.warmup_steps >= self.train.max_steps:
            raise ValueError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) must be smaller than "
                f"train.max_steps ({self.train.max_steps})"
            )
        problem = self.rank_local.budget_problem(self.data.seq_len) or self._method_problem()
        if problem:
            raise ValueError(problem)
        return self

    def _method_problem(self) -> str | None:
        """Why train.method does not fit the data, the preference knobs or the layout, or None."""
        method, fmt, pref = self.train.method, self.data.format, self.preference
        formats = METHOD_FORMATS[method]
        if fmt not in formats:
            if method == "sft":
                return (
                    f"data.format '{fmt}' holds preference data, which train.method 'sft' does not train on: set "
                    "train.method: dpo, orpo or kto (docs/preference.md), or give instruction, chat or text data"
                )
            return (f"train.method '{method}' trains on chosen and rejected answers: set data.format: "
                    f"{' or '.join(formats)} (docs/preference.md), not '{fmt}'")  # fmt: skip
        if method == "sft":
            return None
        if pref.loss is not None and pref.loss not in METHOD_LOSSES[method]:
            return (f"preference.loss '{pref.loss}' is no loss of train.method '{method}': use "
                    f"{', '.join(METHOD_LOSSES[method])}")  # fmt: skip
        if pref.label_smoothing > 0 and self.preference_loss != "robust":
            return (
                "preference.label_smoothing applies to preference.loss: robust (dpo) alone; set that loss or "
                "leave label_smoothing out"
            )
        if self.data.packing and "packing" in self.data.model_fields_set:
            return (
                "data.packing: preference pairs are never packed (each answer is a row of its own, so that its "
                "log-probability is its own): remove data.packing or set it to false"
            )
        if not isinstance(self.parallel, str):
            return (
                f"parallel: pipeline stages do not run train.method '{method}' (the loss needs both answers' "
                "log-probabilities of a pair on one rank, with and without the adapter): use parallel: data"
            )
        return None

    @property
    def preference_loss(self) -> str:
        """The preference method's loss variant (preference.loss, or the method's default)."""
        return self.preference.loss or METHOD_LOSSES.get(self.train.method, ("",))[0]

    @property
    def rows_per_item(self) -> int:
        """Rows of data.seq_len one item of the global batch takes: a pair two (kto: an example and its KL row)."""
        return 1 if self.train.method == "sft" else 2

    def steps_per_epoch(self, rows: int) -> float:
        """Optimizer steps in one pass over ``rows`` training rows."""
        return rows / self.train.global_batch_size

    def for_rows(self, rows: int) -> JobConfig:
        """The job with its length in steps: with ``train.epochs``, ceil(epochs x rows / global batch) (ConfigError
        when the warm-up does not fit them); else the job as it is."""
        if self.train.epochs is None:
            return self
        steps = max(1, math.ceil(self.train.epochs * self.steps_per_epoch(rows) - 1e-9))
        if self.schedule.warmup_steps >= steps:
            raise ConfigError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) must be smaller than the run's {steps} steps "
                f"(train.epochs {self.train.epochs:g} of {rows} rows at a global batch of "
                f"{self.train.global_batch_size}); lower the warm-up or train more epochs"
            )
        return self.model_copy(update={"train": self.train.model_copy(update={"max_steps": steps})})

    @property
    def micro_batch_cap(self) -> int:
        """The largest micro-batch this rank takes: its memory profile's limit in sequences, in items (pairs) of
        ``rows_per_item`` sequences each with a preference method."""
        return max(1, self.rank_local.cap(self.data.seq_len) // self.rows_per_item)

    def cluster_wide(self) -> dict[str, Any]:
        """The part of the job that must be identical on every rank."""
        sections = {
            key: None if getattr(self, key) is None else getattr(self, key).model_dump(mode="json")
            for key in CLUSTER_WIDE_SECTIONS
        }
        parallel = self.parallel if isinstance(self.parallel, str) else self.parallel.model_dump(mode="json")
        return sections | {"name": self.name, "balance": self.balance, "parallel": parallel}

    def cluster_hash(self) -> str:
        blob = json.dumps(self.cluster_wide(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}{where}: not valid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def _describe(error: ValidationError, path: Path | str, prefix: str = "") -> str:
    lines = []
    for err in error.errors():
        key = prefix + ".".join(str(part) for part in err["loc"]) if err["loc"] else "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key '{key}' (check the spelling; see jobs/default.yaml for every key)")
        elif err["type"] == "missing":
            lines.append(f"{path}: missing required key '{key}'")
        elif err["type"] == "value_error":  # ours: the message names its keys (a combination has no one key)
            message = str(err["msg"]).removeprefix("Value error, ")
            lines.append(
                f"{path}: {message}" if not err["loc"] or key in message else f"{path}: key '{key}': {message}"
            )
        else:
            got = err.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
            lines.append(f"{path}: key '{key}': {err['msg']}{shown}")
    return "\n".join(lines)


def load_job(path: str | Path, benchmark: bool = False) -> JobConfig:
    """Load and validate a job file; raise ConfigError naming the file and every bad key.

    The ``benchmark`` section slows ranks down on purpose; only the benchmark may pass ``benchmark=True``.
    """
    path = Path(path)
    raw = _read_yaml(path)
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    if job.benchmark is not None and not benchmark:
        raise ConfigError(
            f"{path}: key 'benchmark' is only for `make bench` (benchmark.emulate_speed makes ranks sleep on "
            "purpose to emulate slower GPUs); remove the section from the job file"
        )
    return job


def load_profile(path: str | Path, host: str) -> dict[str, Any]:
    """Load a host's memory profile; only rank-local keys are allowed in it."""
    path = Path(path)
    return check_profile(_read_yaml(path), f"{path} on host {host}")


def check_profile(raw: object, where: str) -> dict[str, Any]:
    """The knobs of a memory profile, or ConfigError naming ``where`` and the key.

    RankLocalConfig is the one definition of what a profile may hold: the trainer loads every profile
    with this, and the memory_profile role checks what it renders with it before writing it.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a memory profile is a mapping of knobs, not {type(raw).__name__}")
    allowed = ", ".join(sorted(RankLocalConfig.model_fields))
    for key in raw:
        if key in JobConfig.model_fields and key != "rank_local":
            raise ConfigError(
                f"{where}: key '{key}' is cluster-wide and must be the same on every rank; "
                f"set it in the job file instead. A profile may only set: {allowed}"
            )
        if key not in RankLocalConfig.model_fields:
            raise ConfigError(
                f"{where}: unknown key '{key}'; a profile may only set: {allowed} (rank-local knobs); everything "
                "else (model, LoRA, sequence length, learning rate, batch) is cluster-wide and belongs in the job file"
            )
    try:
        RankLocalConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, where)) from None
    return raw


def apply_profile(job: JobConfig, profile: dict[str, Any], where: str = "the profile") -> JobConfig:
    """The job as this rank runs it: the profile's rank-local keys merged over the job's.

    ``where`` names the profile in errors ("/etc/ugro/profile.yaml on host node3070").
    """
    merged = RankLocalConfig.model_validate(job.rank_local.model_copy(update=profile).model_dump())
    problem = merged.budget_problem(job.data.seq_len)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return job.model_copy(update={"rank_local": merged})
