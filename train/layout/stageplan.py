"""Which rank holds which decoder layers: the stage planner (docs/pipeline.md, "The plan").

Every rank holds the whole model (data parallel) when it fits every rank's memory. Otherwise the ranks are
split into pipelines whose stages fit, with each stage's layers sized to its rank's memory and speed. The
planner works from estimates: the memory formula of ``estimate`` and a time model in which a stage's time is
proportional to its matmul parameters (its decoder layers, plus the head on the last stage) divided by its
rank's speed.

Torch-free and deterministic: the controller (``make plan``) and every rank call ``plan`` with the same job,
model shape and members, and get the same layout host by host, whatever order the members come in.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.config import JobConfig, RankLocalConfig, StagesConfig
from train.layout.topology import PIPELINE_TYPES, Layout, Replica, Stage
from train.model.headchunks import chunk_bytes, chunk_rows, transformed

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NF4: 4 bits a weight, plus one absmax per block of 64 stored in 8 bits after double quantization, plus one
# fp32 constant per 256 of those: 0.127 bits a weight (QLoRA paper, section 3).
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8
LORA_BYTES = 16  # per trainable parameter: fp32 weight, its gradient, Adam's two moments
LOGIT_BYTES = 4 * 2  # per logit of a model whose loss needs the whole logits: fp32 logits and their gradient
HF_4BIT_KEPT_BYTES = 4  # peft's prepare_model_for_kbit_training casts every parameter bitsandbytes left to fp32
CUDA_OVERHEAD_GIB = 0.5  # the CUDA context and cuBLAS workspaces, which live in the card's memory
CPU_OVERHEAD_GIB = 1.0  # the interpreter with torch and transformers imported
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEARCH_CAP = 5000  # partitions of the ranks into pipelines the planner compares (enough for 8 distinct ranks)
ORDER_EVERY = 5  # pipelines of up to this many stages try every stage order (_orders)
TIE = 1e-9


class PlanError(Exception):
    """No layout of the ranks fits the model (or the job's parallel setting cannot be met); says why, with numbers."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder's dimensions, read from its config.json (no transformers import)."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    whole_logits: bool = False  # logits transformed after the head: the loss needs them all (train/model/headchunks.py)

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> ModelShape:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                model_type=str(config.get("model_type", "")),
                layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(config["intermediate_size"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                whole_logits=transformed(config) is not None,
            )
        except KeyError as exc:
            raise PlanError(f"{where}: not a decoder config the planner can read: no key '{exc.args[0]}'") from None
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{where}: not a decoder config the planner can read: {exc}") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelShape:
        path = Path(directory) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"{path}: cannot read the model's config ({exc})") from None
        if not isinstance(config, dict):
            raise PlanError(f"{path}: not a model config (a JSON object)")
        return cls.from_config(config, str(path))

    def check_pipeline(self) -> None:
        """PlanError unless pipeline stages can cut this model."""
        if self.model_type not in PIPELINE_TYPES:
            raise PlanError(
                f"pipeline stages support {', '.join(sorted(PIPELINE_TYPES))} models; this one is "
                f"'{self.model_type}' (its forward adds position embeddings or scales the embedding, which a stage "
                "fed hidden states would apply twice). Use parallel: data, with ranks that hold the whole model"
            )

    def linears(self) -> dict[str, tuple[int, int]]:
        """The decoder layer's linear layers: name -> (in, out)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    @property
    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.linears().values())

    @property
    def layer_other_params(self) -> int:
        """Norms (and the attention biases of Qwen2, the q/k norms of Qwen3) of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q + 2 * kv if self.attention_bias else 0
        qk_norm = 2 * self.head_dim if self.model_type == "qwen3" else 0
        return 2 * self.hidden + bias + qk_norm

    @property
    def head_work(self) -> float:
        """The head's matmul work in decoder layers (its parameters over one layer's linear parameters)."""
        return self.vocab * self.hidden / self.layer_linear_params


def read_shape(job: JobConfig, repo: Path) -> ModelShape:
    """The shape of the job's base model from ``model.source``'s config.json (a directory; relative to ``repo``)."""
    source = Path(job.model.source)
    directory = source if source.is_absolute() else repo / source
    if not (directory / "config.json").is_file():
        raise PlanError(
            f"model.source '{job.model.source}': no config.json there, so the planner cannot size the model "
            "(a hub name is read by the ranks once they have downloaded it)"
        )
    return ModelShape.from_dir(directory)


@dataclass(frozen=True)
class Estimate:
    """One stage's peak memory, in GiB, by part."""

    weights: float  # frozen decoder weights (and norms)
    embedding: float  # the vocabulary matrices this stage holds: the embedding and/or an untied head
    lora: float  # LoRA weights with their gradients and Adam moments
    activations: float  # what the backward pass needs, for every micro-batch in flight
    loss: float  # the last stage's loss: a chunk of logits (or all of them) and their gradient
    overhead: float  # the CUDA context, or the interpreter with torch on CPU; the 4-bit dequantization buffer

    @property
    def total(self) -> float:
        return self.weights + self.embedding + self.lora + self.activations + self.loss + self.overhead

    def parts(self) -> str:
        """'weights 6.3 + embedding 2.9 + LoRA/optimizer 1.0 + activations 0.4 + loss 0.4 + overhead 0.6'."""
        named = [("weights", self.weights), ("embedding/head", self.embedding), ("LoRA/optimizer", self.lora),
                 ("activations", self.activations), ("loss", self.loss), ("overhead", self.overhead)]  # fmt: skip
        return " + ".join(f"{name} {value:.1f}" for name, value in named if value >= 0.05 or name == "weights")


def _targets(job: JobConfig) -> set[str]:
    """The LoRA targets by their last name (``self_attn.q_proj`` -> ``q_proj``)."""
    if job.lora.target_modules == "all-linear":
        return set(ALL_LINEAR)
    return {name.rsplit(".", 1)[-1] for name in job.lora.target_modules}


def _activation_elements(shape: ModelShape, job: JobConfig, device_kind: str, seq_len: int) -> float:
    """Elements one decoder layer keeps for the backward pass, per token, without gradient checkpointing.

    Two RMSNorms (input and output each), q/k/v and their rotary copies, the attention output and o_proj's
    input, the MLP's gate, up, activation and product; LoRA's dropout keeps a copy of each adapted linear's
    input (when lora.dropout > 0). Attention runs fused on CUDA (no scores kept); on CPU the math path keeps
    the softmax, heads x seq_len per token.
    """
    q, kv, h, i = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.intermediate
    kept = 4 * h + 2 * (q + 2 * kv) + 2 * q + 4 * i
    if job.lora.dropout > 0:
        kept += sum(dims[0] for name, dims in shape.linears().items() if name in _targets(job))
    if device_kind != "cuda":
        kept += shape.heads * seq_len
    return float(kept)


def _joined_attention(shape: ModelShape, job: JobConfig, tokens: int, layers: int) -> float:
    """Elements of unsloth's dense attention over a packed micro-batch joined into one row of ``tokens``.

    unsloth joins a micro-batch's packed rows into one row (train/data/blocks.py ``model_inputs``); without flash
    attention or xformers (the GPU lock has neither) it builds a dense mask over the joined row, and SDPA with
    grouped-query attention and a mask runs its math kernel: the mask, and per layer the scores and their softmax,
    heads x tokens² each, for every one of ``layers`` that keeps its activations (one under checkpointing). One row
    joins nothing: the plain causal path, fused."""
    if tokens <= job.data.seq_len:
        return 0.0
    kept = 1 if job.rank_local.gradient_checkpointing else layers
    return float(tokens) * tokens * (1 + 2 * shape.heads * kept)


@dataclass(frozen=True)
class Span:
    """Where a stage sits: how many decoder layers it holds, whether it is the first (the embedding) and the last (the
    head and the loss), and how many micro-batches a 1F1B stage keeps in flight (the stages after it, plus one)."""

    layers: int
    first: bool = True
    last: bool = True
    in_flight: int = 1


def estimate(
    shape: ModelShape,
    job: JobConfig,
    span: Span,
    device_kind: str,
    *,
    micro: int | None = None,
    backend: str = "hf",
) -> Estimate:
    """The peak memory of a stage holding ``span.layers`` decoder layers (the whole model: ``Span(layers)``, first and
    last) when ``backend`` ("hf": transformers + peft; "unsloth") trains it.

    Assumptions:

    * frozen weights in ``model.dtype``; with ``quantization: 4bit`` the decoder's linear layers take NF4 with
      double quantization (~0.516 byte a weight) and the embedding, norms and head stay unquantized: in
      ``model.dtype`` with unsloth, in fp32 with transformers + peft (``prepare_model_for_kbit_training`` casts
      every parameter bitsandbytes did not quantize to fp32);
    * vocabulary matrices as train/layout/stagemodel.py loads them: the first stage keeps the embedding (its head tied
      to it, no copy), a middle stage a one-row stub (nothing), the last stage the head, plus the embedding when
      the model's head is not tied to it;
    * LoRA: r x (in + out) for every targeted linear (``all-linear``: q, k, v, o, gate, up, down; ``lm_head`` on
      the last stage), 16 bytes a parameter (fp32 weight, gradient, two Adam moments);
    * activations in ``model.dtype``: a micro-batch is ``micro`` (default: the rank's cap) x data.seq_len tokens;
      with unsloth, packing and a micro-batch above one row, the joined row's dense attention (quadratic in the
      micro-batch's tokens: docs/limitations.md);
      per layer and token ``_activation_elements`` without gradient checkpointing, only the layer's input with
      it (plus one layer's full set while it is recomputed; unsloth's checkpointing keeps the layers' inputs in
      the host's memory, not the card's); a 1F1B stage keeps ``in_flight`` micro-batches (the number of stages
      minus its index; 1 for a whole model);
    * the loss on the last stage (train/model/headloss.py): one chunk of label tokens' fp32 logits and the head's
      output in the head's dtype beside them, and the hidden states' gradient; a model whose logits are
      transformed after the head needs micro x seq_len x vocab fp32 logits and their gradient;
    * overhead: the CUDA context (or the interpreter and torch on CPU), and with 4-bit weights one dequantized
      linear layer at a time;
    * not counted: the allocator's fragmentation and the display's share of a card (leave them out of the
      rank's ``memory_gib``), the inputs and outputs sent between stages (a few MiB), gradient buckets.
    """
    layers, first, last, in_flight = span.layers, span.first, span.last, span.in_flight
    cb = DTYPE_BYTES[job.model.dtype]
    four_bit = job.model.quantization == "4bit"
    wb = NF4_BYTES if four_bit else cb
    kept = HF_4BIT_KEPT_BYTES if four_bit and backend == "hf" else cb  # the parameters left unquantized
    h = shape.hidden
    weights = layers * (shape.layer_linear_params * wb + shape.layer_other_params * kept) + (h * kept if last else 0)
    matrices = (1 if shape.tie_word_embeddings else 2) if last else (1 if first else 0)
    embedding = matrices * shape.vocab * h * kept
    targets = _targets(job)
    r = job.lora.r
    lora_params = layers * sum(r * (a + b) for name, (a, b) in shape.linears().items() if name in targets)
    if last and "lm_head" in targets:
        lora_params += r * (h + shape.vocab)
    # A micro-batch of items: sequences, or pairs of two rows each with a preference method.
    tokens = (micro if micro is not None else job.micro_batch_cap) * job.rows_per_item * job.data.seq_len
    full = _activation_elements(shape, job, device_kind, job.data.seq_len)
    if not job.rank_local.gradient_checkpointing:
        per_token = in_flight * layers * full
    elif backend == "unsloth":
        per_token = h + (full if layers else 0)  # the inputs wait in host memory; one layer's and its recompute
    else:
        per_token = in_flight * layers * h + (full if layers else 0)
    activations = tokens * per_token * cb + (in_flight * tokens * h * cb if not first else 0)
    if backend == "unsloth" and job.data.packing and device_kind == "cuda":
        activations += _joined_attention(shape, job, tokens, in_flight * max(layers, 1)) * cb
    if not last:
        loss = 0.0
    elif shape.whole_logits:
        loss = tokens * shape.vocab * LOGIT_BYTES
    else:
        loss = (
            min(tokens, chunk_rows(shape.vocab, chunk_bytes(device_kind))) * shape.vocab * (4 + kept)
            + tokens * h * kept
        )
    overhead = (CUDA_OVERHEAD_GIB if device_kind == "cuda" else CPU_OVERHEAD_GIB) * GIB
    if four_bit and layers:
        overhead += max(a * b for a, b in shape.linears().values()) * cb
    return Estimate(weights / GIB, embedding / GIB, lora_params * LORA_BYTES / GIB, activations / GIB,
                    loss / GIB, overhead / GIB)  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One rank as the planner sees it: its host, the memory it may use, its relative speed.

    ``rank_local`` is the rank's own rank-local config (its memory profile over the job's; None: the job's), whose
    micro-batch cap and gradient checkpointing size its activations. ``device`` is "cuda" or "cpu"; ``backend`` what
    trains the whole model there ("unsloth" or "hf", train/model/load.py ``resolve_backend``: stages always run "hf").
    """

    host: str
    memory_gib: float
    speed: float = 1.0
    device: str = "cuda"
    rank_local: RankLocalConfig | None = None
    backend: str = "hf"


@dataclass(frozen=True)
class _Kind:
    """What the plan depends on of a member (interchangeable members share one)."""

    memory: float
    speed: float
    device: str
    cap: int
    checkpointing: bool
    backend: str


@dataclass
class _Pipeline:
    order: tuple[int, ...]  # kind indices, stage by stage
    counts: tuple[int, ...]  # decoder layers per stage
    peaks: tuple[float, ...]
    shares: tuple[float, ...]
    speed: float  # sequences per unit time, 1.0 = a speed-1.0 rank running the whole model alone
    micro: int = 0  # the micro-batch its stages are sized for
    stages: int = field(init=False)

    def __post_init__(self) -> None:
        self.stages = len(self.order)


class _Planner:
    def __init__(self, job: JobConfig, shape: ModelShape, members: Sequence[Member]) -> None:
        self.job, self.shape, self.members = job, shape, list(members)
        weights = job.balance if isinstance(job.balance, dict) else {}
        self.speeds = [float(weights.get(m.host, m.speed)) for m in self.members]
        # The members sorted so the result depends on the hosts only, not on the order they came in.
        self.sorted = sorted(range(len(self.members)), key=self._sort_key)
        kinds: list[_Kind] = []
        self.kind_of: dict[int, int] = {}
        for index in self.sorted:
            kind = self._kind(index)
            if kind not in kinds:
                kinds.append(kind)
            self.kind_of[index] = kinds.index(kind)
        self.kinds = kinds
        self.memo: dict[tuple[Any, ...], _Pipeline | None] = {}
        self.jobs: dict[_Kind, JobConfig] = {}
        self.fits: dict[tuple[Any, ...], tuple[int, float, float]] = {}

    def _sort_key(self, index: int) -> tuple[float, float, str, int]:
        member = self.members[index]
        return (-member.memory_gib, -self.speeds[index], member.host, index)

    def _rank_local(self, index: int) -> RankLocalConfig:
        return self.members[index].rank_local or self.job.rank_local

    def _kind(self, index: int) -> _Kind:
        local = self._rank_local(index)
        member = self.members[index]
        return _Kind(member.memory_gib, self.speeds[index], member.device, local.cap(self.job.data.seq_len),
                     local.gradient_checkpointing, member.backend)  # fmt: skip

    def _job(self, kind: _Kind) -> JobConfig:
        if kind not in self.jobs:
            local = self.job.rank_local.model_copy(update={"gradient_checkpointing": kind.checkpointing})
            self.jobs[kind] = self.job.model_copy(update={"rank_local": local})
        return self.jobs[kind]

    def estimate(self, kind: _Kind, layers: int, first: bool, last: bool, in_flight: int, micro: int) -> Estimate:
        """A stage's estimate; a whole model (first and last) is trained by the member's backend, a stage by
        transformers + peft (train/layout/engine.py)."""
        backend = kind.backend if first and last else "hf"
        return estimate(self.shape, self._job(kind), Span(layers, first, last, in_flight), kind.device, micro=micro,
                        backend=backend)  # fmt: skip

    def capacity(self, kind: _Kind, first: bool, last: bool, in_flight: int, micro: int) -> tuple[int, float, float]:
        """The most layers such a stage holds within its memory, its estimate with one layer and what each
        further layer adds (the estimate is linear in the layers)."""
        key = (kind, first, last, in_flight, micro)
        if key not in self.fits:
            one = self.estimate(kind, 1, first, last, in_flight, micro).total
            step = self.estimate(kind, 2, first, last, in_flight, micro).total - one
            cap = 0 if one > kind.memory else min(self.shape.layers, 1 + int((kind.memory - one) / step))
            self.fits[key] = (cap, one, step)
        return self.fits[key]

    def micro_batches(self, micro: int, replicas: int) -> int:
        """Micro-batches of each pipeline per step: an equal share of the global batch in micro-batches."""
        return max(1, math.ceil(self.job.train.global_batch_size / replicas / micro))

    def pipeline(self, order: tuple[int, ...], m: int, counts: Sequence[int] | None) -> _Pipeline | None:
        """The fastest layer counts for stages of these kinds in this order (or the given counts) when each step
        feeds the pipeline ``m`` micro-batches, or None when no counts fit."""
        layers, stages = self.shape.layers, len(order)
        if stages > layers:
            return None
        kinds = [self.kinds[k] for k in order]
        micro = min(k.cap for k in kinds)
        caps, extra, lines = [], [], []
        for i, kind in enumerate(kinds):
            cap, one, step = self.capacity(kind, i == 0, i == stages - 1, min(stages - i, m), micro)
            caps.append(cap)
            lines.append((one, step))
            extra.append(self.shape.head_work if i == stages - 1 else 0.0)
        speeds = [k.speed for k in kinds]
        if counts is not None:
            if any(c > cap for c, cap in zip(counts, caps, strict=True)):
                return None
            chosen = list(counts)
        else:
            balanced = _balance(layers, caps, extra, speeds)
            if balanced is None:
                return None
            chosen = balanced
        times = [(n + e) / s for n, e, s in zip(chosen, extra, speeds, strict=True)]
        slowest = max(times)
        step = (m + stages - 1) * slowest
        work = layers + self.shape.head_work
        peaks = tuple(one + (n - 1) * step for (one, step), n in zip(lines, chosen, strict=True))
        return _Pipeline(order, tuple(chosen), peaks, tuple(m * t / step for t in times), m * work / step, micro)

    def best_pipeline(self, block: tuple[int, ...], replicas: int, counts: Sequence[int] | None) -> _Pipeline | None:
        """The fastest stage order of a block of kinds (a multiset, as counts per kind)."""
        pool = [k for k, n in enumerate(block) for _ in range(n)]
        m = self.micro_batches(min(self.kinds[k].cap for k in pool), replicas)
        key = (block, m, tuple(counts) if counts is not None else None)
        if key in self.memo:
            return self.memo[key]
        best: _Pipeline | None = None
        for order in _orders(pool):
            found = self.pipeline(order, m, counts)
            if found is not None and (best is None or found.speed > best.speed * (1 + TIE)):
                best = found
        self.memo[key] = best
        return best

    def search(self, size: int | None, counts: Sequence[int] | None) -> list[_Pipeline] | None:
        """The partition of the ranks into pipelines (of ``size`` stages, when given) of highest throughput."""
        totals = tuple(sum(1 for i in self.sorted if self.kind_of[i] == k) for k in range(len(self.kinds)))
        best: list[_Pipeline] | None = None
        best_key: tuple[float, int] = (0.0, 0)
        for blocks in itertools.islice(_multiset_partitions(totals, size), SEARCH_CAP):
            pipelines = [self.best_pipeline(b, len(blocks), counts) for b in blocks]
            if any(p is None for p in pipelines):
                continue
            found = [p for p in pipelines if p is not None]
            speed, stages = sum(p.speed for p in found), max(p.stages for p in found)
            if (
                best is None
                or speed > best_key[0] * (1 + TIE)
                or (speed >= best_key[0] * (1 - TIE) and stages < best_key[1])
            ):
                best, best_key = found, (speed, stages)
        return best

    def layout(self, pipelines: Sequence[_Pipeline], reason: str) -> Layout:
        """Members assigned to the pipelines' stages kind by kind, in the sorted order (so by host)."""
        queues: dict[int, list[int]] = {}
        for index in self.sorted:
            queues.setdefault(self.kind_of[index], []).append(index)
        replicas = []
        for pipeline in sorted(pipelines, key=lambda p: (p.stages, -p.speed, p.order)):
            stages, start = [], 0
            for kind, count, peak, share in zip(pipeline.order, pipeline.counts, pipeline.peaks, pipeline.shares,
                                                strict=True):  # fmt: skip
                index = queues[kind].pop(0)
                member = self.members[index]
                stages.append(Stage(rank=index, host=member.host, start=start, end=start + count,
                                    peak_gib=round(peak, 2), memory_gib=member.memory_gib,
                                    time_share=round(share, 3), micro=pipeline.micro))  # fmt: skip
                start += count
            replicas.append(Replica(stages=tuple(stages), speed=round(pipeline.speed, 4)))
        return Layout(layers=self.shape.layers, replicas=tuple(replicas), reason=reason, head_work=self.shape.head_work)

    def whole(self, index: int, micro: int | None = None) -> Estimate:
        """The whole model on this member, at its micro-batch cap or at ``micro``."""
        kind = self.kinds[self.kind_of[index]]
        return self.estimate(kind, self.shape.layers, True, True, 1, micro or kind.cap)

    def largest_micro(self, index: int) -> int:
        """The largest micro-batch, up to the member's cap, at which the whole model fits it; 0 when none does."""
        kind = self.kinds[self.kind_of[index]]
        for micro in range(kind.cap, 0, -1):
            if self.whole(index, micro).total <= kind.memory:
                return micro
        return 0

    def cluster_memory(self) -> str:
        """'11.0 + 7.2 + 7.2 = 25.4 GiB'."""
        values = [self.members[i].memory_gib for i in self.sorted]
        return f"{' + '.join(f'{v:.1f}' for v in values)} = {sum(values):.1f} GiB"

    def refusal(self, why: str) -> PlanError:
        """The whole model's need against the cluster's memory, and ``why`` no layout fits."""
        index = self.sorted[-1]
        whole = self.whole(index)
        ranks = len(self.members)
        need = whole.total + (ranks - 1) * whole.overhead
        per_layer = self.estimate(self.kinds[self.kind_of[index]], 1, False, False, 1, 1)
        layer = per_layer.weights + per_layer.lora
        quantize = "" if self.job.model.quantization == "4bit" else "quantize (model.quantization: 4bit), "
        parts = (f"weights {whole.weights:.1f} + embedding/head {whole.embedding:.1f} + LoRA/optimizer "
                 f"{whole.lora:.1f} + activations {whole.activations:.1f} + loss {whole.loss:.1f} + "
                 f"{ranks} x {whole.overhead:.1f} overhead")  # fmt: skip
        return PlanError(
            f"{self.what()} needs ~{need:.1f} GiB ({parts}) and the cluster has {self.cluster_memory()}: {why}. "
            f"One decoder layer alone needs {layer:.2f} GiB of weights and LoRA state. Add memory (more ranks, "
            f"or a higher memory_gib in a host's profile where the card allows), {quantize}lower lora.r, "
            "data.seq_len or rank_local.micro_batch_size"
        )

    def what(self) -> str:
        name = Path(self.job.model.source).name or self.job.model.source
        bits = "4-bit" if self.job.model.quantization == "4bit" else self.job.model.dtype
        return f"{name} ({self.shape.layers} layers, {bits})"


def _balance(layers: int, caps: Sequence[int], extra: Sequence[float], speeds: Sequence[float]) -> list[int] | None:
    """Layers per stage (each at least 1, at most its cap, ``layers`` in all) minimizing the slowest stage's time
    (layers + extra) / speed; None when the caps do not add up to the layers."""
    stages = len(caps)
    if min(caps) < 1 or sum(caps) < layers or stages > layers:
        return None
    floor = max((1 + e) / s for e, s in zip(extra, speeds, strict=True))
    candidates = sorted({t for i in range(stages) for n in range(1, caps[i] + 1)
                         if (t := (n + extra[i]) / speeds[i]) >= floor})  # fmt: skip

    def allowed(t: float) -> list[int]:
        return [max(1, min(c, math.floor(t * s - e + 1e-9))) for c, e, s in zip(caps, extra, speeds, strict=True)]

    low, high = 0, len(candidates) - 1
    while low < high:
        mid = (low + high) // 2
        if sum(allowed(candidates[mid])) >= layers:
            high = mid
        else:
            low = mid + 1
    counts = allowed(candidates[low])
    while sum(counts) > layers:  # take the surplus from the slowest stages, later stages first on ties
        slowest = max((i for i in range(stages) if counts[i] > 1),
                      key=lambda i: ((counts[i] + extra[i]) / speeds[i], i))  # fmt: skip
        counts[slowest] -= 1
    return counts


def _orders(pool: list[int]) -> Iterator[tuple[int, ...]]:
    """The stage orders tried for a pipeline of these kinds (sorted by memory, the largest first): every
    distinct order up to ORDER_EVERY stages; beyond, every choice of first and last stage (the embedding and
    the most micro-batches in flight; the head and the logits) with the middle in sorted order."""
    if len(pool) <= ORDER_EVERY:
        yield from _distinct_orders(pool)
        return
    seen = set()
    for first, last in itertools.permutations(range(len(pool)), 2):
        middle = [k for i, k in enumerate(pool) if i not in (first, last)]
        order = (pool[first], *sorted(middle), pool[last])
        if order not in seen:
            seen.add(order)
            yield order


def _distinct_orders(pool: list[int]) -> Iterator[tuple[int, ...]]:
    """Every distinct ordering of a multiset, in lexicographic order."""
    items = sorted(pool)
    while True:
        yield tuple(items)
        i = len(items) - 2
        while i >= 0 and items[i] >= items[i + 1]:
            i -= 1
        if i < 0:
            return
        j = len(items) - 1
        while items[j] <= items[i]:
            j -= 1
        items[i], items[j] = items[j], items[i]
        items[i + 1 :] = reversed(items[i + 1 :])


def _multiset_partitions(
    counts: tuple[int, ...], size: int | None, bound: tuple[int, ...] | None = None
) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of a multiset (counts per kind) into blocks (of ``size`` members when given), each once:
    blocks come in non-increasing order, the bigger first."""
    if not any(counts):
        yield []
        return
    for block in sorted(itertools.product(*(range(n + 1) for n in counts)), key=lambda b: (-sum(b), b)):
        if not any(block) or (bound is not None and (-sum(block), block) < (-sum(bound), bound)):
            continue
        if size is not None and sum(block) != size:
            continue
        rest = tuple(n - b for n, b in zip(counts, block, strict=True))
        for tail in _multiset_partitions(rest, size, block):
            yield [block, *tail]


def plan(job: JobConfig, shape: ModelShape, members: Sequence[Member]) -> Layout:
    """The layout of the ranks ``members`` (in rank order) for the job: data parallel, or pipelines (job.parallel).

    PlanError when the job's setting cannot be met or no layout fits, with the arithmetic.
    """
    if not members:
        raise PlanError("no ranks to plan for")
    planner = _Planner(job, shape, members)
    layers = shape.layers
    parallel = job.parallel
    whole = [planner.whole(i) for i in range(len(members))]
    fits = [w.total <= m.memory_gib for w, m in zip(whole, members, strict=True)]
    if parallel == "auto" and not all(fits):
        smaller = _smaller_micro(planner, whole, fits)
        if smaller is not None:
            return smaller
    if parallel == "data" or (parallel == "auto" and all(fits)):
        if not all(fits):
            index = next(i for i in planner.sorted[::-1] if not fits[i])
            raise PlanError(
                f"parallel: data, but {planner.what()} needs ~{whole[index].total:.1f} GiB on every rank "
                f"({whole[index].parts()}) and {members[index].host} has {members[index].memory_gib:.1f} GiB. Use "
                "parallel: auto (pipeline stages across ranks) or give that host more memory"
            )
        pipelines = [_Pipeline((planner.kind_of[i],), (layers,), (whole[i].total,), (1.0,), planner.speeds[i],
                               planner.kinds[planner.kind_of[i]].cap) for i in planner.sorted]  # fmt: skip
        reason = "the whole model fits every rank: data parallel" if parallel == "auto" else "parallel: data"
        return planner.layout(pipelines, f"{reason} (~{max(w.total for w in whole):.1f} GiB a rank)")
    shape.check_pipeline()
    world = len(members)
    size: int | None = None
    counts: list[int] | None = None
    if isinstance(parallel, StagesConfig):
        if isinstance(parallel.stages, list):
            counts = list(parallel.stages)
            if sum(counts) != layers:
                raise PlanError(
                    f"parallel.stages {counts} adds up to {sum(counts)} layers, but {planner.what()} has {layers} "
                    "decoder layers: the counts must add up to them"
                )
        size = parallel.stages if isinstance(parallel.stages, int) else len(parallel.stages)
        if size > layers:
            raise PlanError(f"parallel.stages asks for {size} stages, but the model has only {layers} decoder layers")
        if world % size:
            hosts = ", ".join(f"{h}: {n}" for h, n in _per_host(members).items())
            raise PlanError(
                f"parallel.stages asks for pipelines of {size} stages, but there are {world} ranks ({hosts}): "
                f"the number of ranks must be a multiple of {size}"
            )
    found = planner.search(size, counts)
    if found is None:
        if size is not None:
            shape_text = f"{counts}" if counts is not None else f"{size} stages"
            raise planner.refusal(f"no pipelines of {shape_text} fit every stage in its rank's memory")
        raise planner.refusal(f"even cut into stages across the {world} ranks, some stage does not fit")
    stages = max(p.stages for p in found)
    if isinstance(parallel, StagesConfig):
        reason = f"parallel.stages: {parallel.stages}"
    else:
        short = [members[i].host for i in planner.sorted if not fits[i]]
        reason = (
            f"the whole model (~{max(whole[i].total for i in range(world)):.1f} GiB) does not fit "
            f"{', '.join(dict.fromkeys(short))}: pipelines of up to {stages} stages, the fastest layout that fits"
        )
    return planner.layout(found, reason)


def _smaller_micro(planner: _Planner, whole: Sequence[Estimate], fits: Sequence[bool]) -> Layout | None:
    """Data parallel with smaller micro-batches where the whole model fits every rank only so, else None.

    A smaller micro-batch costs nothing in the planner's time model (a step's work is its tokens, and gradient
    accumulation keeps the global batch), while stages add the pipeline's bubble and send activations between
    hosts every micro-batch; so whole replicas at a smaller micro-batch win wherever they fit.
    """
    micros = {i: planner.largest_micro(i) for i in planner.sorted}
    if not all(micros.values()):
        return None
    layers = planner.shape.layers
    pipelines = [_Pipeline((planner.kind_of[i],), (layers,), (planner.whole(i, micros[i]).total,), (1.0,),
                           planner.speeds[i], micros[i]) for i in planner.sorted]  # fmt: skip
    short = {planner.members[i].host: (micros[i], planner.kinds[planner.kind_of[i]].cap)
             for i in planner.sorted if not fits[i]}  # fmt: skip
    cuts = ", ".join(f"{host} at {micro} instead of {cap}" for host, (micro, cap) in short.items())
    peak = max(p.peaks[0] for p in pipelines)
    biggest = max(w.total for w, fit in zip(whole, fits, strict=True) if not fit)
    return planner.layout(pipelines, f"the whole model (~{biggest:.1f} GiB at the profiles' micro-batches) fits every "
                                     f"rank at a smaller micro-batch: data parallel, micro-batches {cuts} "
                                     f"(~{peak:.1f} GiB a rank at most)")  # fmt: skip


def _per_host(members: Sequence[Member]) -> dict[str, int]:
    found: dict[str, int] = {}
    for member in members:
        found[member.host] = found.get(member.host, 0) + 1
    return found
