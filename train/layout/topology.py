"""Who computes what: data-parallel replicas, each a pipeline of one or more stages, each stage one rank.

A replica of one stage holds the whole model (plain data parallel). A replica of several stages holds the
model cut by decoder layers: the first stage also holds the embedding, the last the final norm and the
head. Every replica trains its share of each global batch; the LoRA gradients of a layer are summed over the
ranks that hold that layer (train/layout/pipeline.py).

Torch-free: the controller prints and checks the same layout that the ranks build (train/layout/stageplan.py
makes it, ``make plan`` shows it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Decoders that can be cut into stages: the layers sit under model.layers, positions are rotary (applied inside
# each layer) and the model's forward adds nothing to embeddings it is given. GPT-2 adds position embeddings and
# Gemma scales the embedding inside the forward, so a stage fed hidden states would apply them twice.
PIPELINE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class Stage:
    rank: int  # global rank that computes this stage
    host: str
    start: int  # first decoder layer (inclusive)
    end: int  # last decoder layer (exclusive)
    peak_gib: float = 0.0  # the planner's estimate of this stage's peak memory
    memory_gib: float = 0.0  # the memory the rank may use (its profile or its device)
    time_share: float = 0.0  # the planner's expected fraction of the replica's step time spent in this stage
    micro: int = 0  # the micro-batch the planner sized this stage for; below the rank's cap, the rank uses it

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class Replica:
    stages: tuple[Stage, ...]
    speed: float = 1.0  # relative sequences per second: the replica's share of each global batch follows it

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stages)


@dataclass(frozen=True)
class Where:
    """One rank's place: its replica, its stage in it, and its neighbours (None at the ends)."""

    replica: int
    stage: int
    stages: int
    prev: int | None
    next: int | None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


@dataclass(frozen=True)
class Layout:
    layers: int  # decoder layers of the whole model
    replicas: tuple[Replica, ...]
    reason: str = ""  # why this layout: "fits every card", "parallel.stages: 3", "model needs 9.1 GiB ..."
    head_work: float = 0.0  # the LM head's matmul work in decoder layers (the planner charges it to last stages)

    def __post_init__(self) -> None:
        ranks = [s.rank for r in self.replicas for s in r.stages]
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"a layout must place every rank 0..{len(ranks) - 1} exactly once, got {ranks}")
        for replica in self.replicas:
            cuts = [(s.start, s.end) for s in replica.stages]
            expected = 0
            for start, end in cuts:
                if start != expected or end <= start:
                    raise ValueError(f"the stages {cuts} do not cover layers 0..{self.layers} in order")
                expected = end
            if expected != self.layers:
                raise ValueError(f"the stages {cuts} do not cover layers 0..{self.layers} in order")

    @property
    def world_size(self) -> int:
        return sum(len(r.stages) for r in self.replicas)

    @property
    def pipelined(self) -> bool:
        return any(len(r.stages) > 1 for r in self.replicas)

    def where(self, rank: int) -> Where:
        for index, replica in enumerate(self.replicas):
            for position, stage in enumerate(replica.stages):
                if stage.rank == rank:
                    ranks = replica.ranks
                    return Where(
                        replica=index,
                        stage=position,
                        stages=len(ranks),
                        prev=ranks[position - 1] if position > 0 else None,
                        next=ranks[position + 1] if position + 1 < len(ranks) else None,
                    )
        raise ValueError(f"rank {rank} is not in the layout")

    def stage(self, rank: int) -> Stage:
        where = self.where(rank)
        return self.replicas[where.replica].stages[where.stage]

    def holders(self, layer: int) -> tuple[int, ...]:
        """The ranks that hold decoder layer ``layer`` (one per replica)."""
        return tuple(s.rank for r in self.replicas for s in r.stages if s.start <= layer < s.end)

    def describe_rank(self, rank: int) -> str:
        """E.g. ``the whole model`` or ``stage 2/3, layers 10-19``."""
        where, stage = self.where(rank), self.stage(rank)
        if where.stages == 1:
            return "the whole model"
        return f"stage {where.stage + 1}/{where.stages}, layers {stage.start}-{stage.end - 1}"

    def describe(self) -> str:
        """E.g. ``replica 0: master layers 0-29; replica 1: node4070 layers 0-13 | node3070 layers 14-29``."""
        parts = []
        for index, replica in enumerate(self.replicas):
            stages = " | ".join(f"{s.host} layers {s.start}-{s.end - 1}" for s in replica.stages)
            parts.append(f"replica {index}: {stages}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        replicas = tuple(
            Replica(stages=tuple(Stage(**s) for s in r["stages"]), speed=float(r.get("speed", 1.0)))
            for r in data["replicas"]
        )
        return cls(
            layers=int(data["layers"]),
            replicas=replicas,
            reason=str(data.get("reason", "")),
            head_work=float(data.get("head_work", 0.0)),
        )


def data_parallel(layers: int, hosts: Sequence[str], reason: str = "") -> Layout:
    """Every rank one whole replica: the layout of plain data parallel."""
    return Layout(
        layers=layers,
        replicas=tuple(Replica(stages=(Stage(rank=r, host=h, start=0, end=layers),)) for r, h in enumerate(hosts)),
        reason=reason,
    )


def fixed(layers: int, hosts: Sequence[str], groups: Sequence[Sequence[int]], reason: str = "") -> Layout:
    """Replicas of consecutive ranks with the given layer counts per stage, e.g. ``[[30], [14, 16]]``."""
    replicas = []
    rank = 0
    for counts in groups:
        if sum(counts) != layers or min(counts) < 1:
            raise ValueError(f"stage layer counts {list(counts)} must be positive and add up to {layers}")
        stages, start = [], 0
        for count in counts:
            stages.append(Stage(rank=rank, host=hosts[rank], start=start, end=start + count))
            start += count
            rank += 1
        replicas.append(Replica(stages=tuple(stages)))
    if rank != len(hosts):
        raise ValueError(f"the stages use {rank} ranks but there are {len(hosts)}")
    return Layout(layers=layers, replicas=tuple(replicas), reason=reason)
