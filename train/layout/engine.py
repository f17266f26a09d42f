"""What a rank computes each step, in the layout the job runs with: a whole replica (DDP) or a pipeline stage.

The training loop (train/loop.py) is the same for both; it asks its engine to load, step, clip, evaluate,
save and restore. ``DataParallel`` is every rank holding the whole model with DDP over the LoRA weights.
``Pipelined`` is any layout with stages (train/layout/topology.py): the rank holds its stage's layers, runs the
1F1B step (train/layout/pipeline.py), and checkpoints and adapters are put together from every stage under the
base's own names, in the same format as data parallel's, so a resume may re-cut the stages or go back to
data parallel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import platform
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.balance.batchplan import Balancer
from train.balance.step import backward, clip
from train.config import JobConfig
from train.data import evaluate
from train.data.blocks import prompt_text
from train.data.evaluate import HeldOut
from train.data.records import Record
from train.dist import comm, distributed
from train.dist.distributed import RankInfo
from train.dist.health import GroupHealth
from train.layout import pipeline, stagemodel
from train.layout.topology import Layout, data_parallel
from train.model.load import DTYPES, load_model
from train.preference import evaluate as pair_eval
from train.preference.objective import Objective
from train.preference.step import PreferenceStep
from train.recovery import checkpoint

log = logging.getLogger(__name__)


class _Engine:
    """What both layouts share: the model (whole or a stage) with its LoRA adapter, and the batch plan."""

    model: Any
    balancer: Balancer
    layout: Layout
    in_place: bool = True  # whether the survivors of a lost host go on in their processes (``regroup``)
    preference: PreferenceStep | None = (
        None  # a preference method's step (data parallel only: placement refuses stages)
    )

    def rank_shares(self) -> tuple[int, ...]:
        return self.balancer.rank_shares()

    def base_model(self) -> contextlib.AbstractContextManager[None]:
        return evaluate.base_model(self.model)


class DataParallel(_Engine):
    """Every rank a whole replica: DDP over the LoRA weights, shares by measured speed (train/balance/batchplan.py)."""

    def __init__(self, job: JobConfig, info: RankInfo, code_dir: Path, layout: Layout, health: GroupHealth) -> None:
        self.job, self.info, self.layout, self.health = job, info, layout, health
        self.model, self.tokenizer, self.backend = load_model(job, code_dir, info.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.batch_rank = info.rank  # the sampler's index of this rank's share
        self.preference = preference_step(job, self.model)  # train.method dpo, orpo, kto; None for sft
        self.ddp: torch.nn.Module = self.model
        self.synchronized = False  # checked at the first step of each group (distributed.check_gradients_agree)

    def start(self, saved_plan: dict[str, Any] | None, src: int = 0) -> str:
        self.balancer = Balancer(self.job, self.info, saved_plan)
        compress = distributed.compression(self.job, self.info, self.model)
        self.ddp = distributed.wrap(self.model, self.info, self.balancer.clock, compress, src, self.health)
        self.synchronized = False
        return f"data parallel, grad_compression={compress}"

    def regroup(self, info: RankInfo, src: int, retired: list[Any]) -> str:
        """Go on in a new group (survivors, or hosts taken back in): DDP anew over it (from rank ``src``'s weights),
        shares re-planned, a whole replica on each of its ranks. The old DDP wrapper goes into ``retired``: its
        reducer holds the broken group (train/dist/distributed.py ``form`` says why it is kept)."""
        self.info, self.batch_rank = info, info.rank
        self.layout = data_parallel(self.layout.layers, info.hosts, self.layout.reason)
        retired.append(self.ddp)
        self.ddp = self.model
        return self.start(None, src)

    def train(self) -> None:
        self.ddp.train()

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        if self.preference is not None:
            result = self.preference.backward(self.ddp, micro_batches, self.info.device, self.balancer.clock,
                                              self.health)  # fmt: skip
        else:
            result = backward(self.ddp, micro_batches, self.info.device, self.balancer.clock, self.health)
        if not self.synchronized:  # the first step of this group: did DDP all-reduce the gradients?
            distributed.check_gradients_agree(self.trainable, self.info, self.backend, self.health)
            self.synchronized = True
        return result

    def clip(self, max_norm: float) -> float:
        return clip(self.trainable, max_norm)

    def held_out_loss(self, held_out: HeldOut, batch_size: int) -> tuple[float, int]:
        return evaluate.loss(self.model, held_out, self.info, batch_size, self.health)

    def held_out_preference(self, held_out: HeldOut, batch_size: int, adapter: bool) -> dict[str, float | None]:
        """The held-out pairs' figures (train/preference/evaluate.py), of the base model or the fine-tuned one."""
        assert self.preference is not None
        return pair_eval.figures(self.model, held_out, self.info, batch_size, self.preference.objective, adapter,
                                 self.health)  # fmt: skip

    def restore(self, run_dir: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> checkpoint.Restored | None:
        return checkpoint.restore(run_dir, self.model, optimizer, scheduler, self.info.rank, self.info.main_rank)

    def save(self, run_dir: Path, step: int, optimizer: torch.optim.Optimizer, scheduler: Any,
             extra: dict[str, Any]) -> Path | None:  # fmt: skip
        extra = extra | {"rng": checkpoint.gather_rngs(self.health)}
        return checkpoint.save(
            run_dir, step, self.model, optimizer, scheduler, self.job.checkpoint.keep_last, self.info.is_main, extra
        )

    def save_adapter(self, folder: Path) -> None:
        if self.info.is_main:
            self.model.save_pretrained(str(folder), save_embedding_layers=False)

    def answers(self, records: list[Record]) -> tuple[list[str], list[str]] | None:
        """Greedy answers of the base and of the fine-tuned model (the main rank's; None on the others)."""
        if not self.info.is_main:
            return None
        with evaluate.base_model(self.model):
            before = evaluate.answers(self.model, self.tokenizer, self.job, records, self.info.device)
        return before, evaluate.answers(self.model, self.tokenizer, self.job, records, self.info.device)


def preference_step(job: JobConfig, model: torch.nn.Module) -> PreferenceStep | None:
    """A preference method's step (with dropout off where the job says so, as TRL's disable_dropout), or None."""
    if job.train.method == "sft":
        return None
    if job.preference.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return PreferenceStep(Objective.from_job(job))


class Pipelined(_Engine):
    """This rank's stage of a pipeline (or a whole replica beside pipelines)."""

    in_place = False  # stages are cut for the hosts that hold them

    def __init__(self, job: JobConfig, info: RankInfo, code_dir: Path, layout: Layout, run_dir: Path,
                 health: GroupHealth) -> None:  # fmt: skip
        self.job, self.info, self.layout, self.health = job, info, layout, health
        self.where, self.stage = layout.where(info.rank), layout.stage(info.rank)
        if self.where.stages == 1:
            self.model, self.tokenizer, self.backend = load_model(job, code_dir, info.device)
            stagemodel.seed_lora(self.model, job.train.seed)
        else:
            scratch = run_dir / "hosts" / info.host / "stages"
            first, last = self.where.first, self.where.last
            self.model, self.tokenizer = stagemodel.load_stage(job, code_dir, self.stage, first, last, info.device,
                                                               scratch)  # fmt: skip
            self.backend = "hf"
        self.named = pipeline.named_trainable(self.model, self.stage.start)
        self.trainable = [p for _, p in self.named]
        hidden = int(self.model.get_base_model().config.hidden_size)
        self.runner = pipeline.StageRunner(self.model, self.where, hidden, DTYPES[job.model.dtype], info.device, health)
        self.batch_rank = self.where.replica

    def regroup(self, info: RankInfo, src: int, retired: list[Any]) -> str:
        """Stages are cut for the hosts that hold them: a lost stage host means a relaunch that re-cuts them."""
        raise RuntimeError("a pipeline's stages cannot regroup in place; the controller relaunches from a checkpoint")

    def start(self, saved_plan: dict[str, Any] | None) -> str:
        # Collective (it makes groups): after the "loaded" wait, which allows each host its own loading time; made in
        # the build, a host that loaded for longer than distributed.timeout_s ended the run.
        self.sync = pipeline.GradSync(self.named, self.info.rank, self.info.world_size)
        self.balancer = Balancer(self.job, self.info, saved_plan, self.layout)
        stage = f"stage {self.where.stage + 1}/{self.where.stages} of replica {self.where.replica}"
        sizes = self.balancer.micro_sizes()
        layers = f"layers {self.stage.start}-{self.stage.end - 1}"
        return f"pipeline: {stage}, {layers}, micro-batches {sizes}, {self.sync.bytes_per_step} gradient bytes/step"

    def train(self) -> None:
        self.model.train()

    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        loss, tokens = self.runner.step(micro_batches, self.balancer.clock)
        self.sync.all_reduce()
        return loss, tokens

    def clip(self, max_norm: float) -> float:
        return self.sync.clip(max_norm)

    @torch.no_grad()
    def held_out_loss(self, held_out: HeldOut, batch_size: int) -> tuple[float, int]:
        """Each replica evaluates every R-th held-out record through its stages; one all-reduce sums them."""
        was_training = self.model.training
        self.model.eval()
        blocks = held_out.blocks
        mine = list(range(self.where.replica, len(blocks), len(self.layout.replicas)))
        batches = [blocks.batch(mine[i : i + batch_size], self.info.device) for i in range(0, len(mine), batch_size)]
        summed, tokens = self.runner.loss(batches)
        total = comm.tensor([summed, float(tokens)], torch.float64)
        if dist.is_initialized() and self.info.world_size > 1:
            self.health.wait(comm.all_reduce(total, async_op=True))
        self.model.train(was_training)
        count = int(total[1])
        return (float(total[0]) / count if count else math.nan), count

    def _gather(self, optimizer: torch.optim.Optimizer | None) -> list[Any] | None:
        """Collective: replica 0's stages send (replica, stage, named LoRA weights, named optimizer state, peft state,
        peft config) to the main rank; the other replicas hold copies of the same weights and send nothing."""

        mine = self._mine(optimizer) if self.where.replica == 0 else None
        if not dist.is_initialized():
            return [mine]
        everyone: list[Any] | None = [None] * self.info.world_size if self.info.is_main else None
        dist.gather_object(mine, everyone, dst=self.info.main_rank)
        return everyone

    def _mine(self, optimizer: torch.optim.Optimizer | None) -> tuple[Any, ...]:
        from peft import get_peft_model_state_dict

        state = {
            name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for name, p in self.named
            if optimizer is not None and p in optimizer.state
        }
        peft_state = {
            stagemodel.global_name(k, self.stage.start): v.detach().cpu().clone()
            for k, v in get_peft_model_state_dict(self.model, save_embedding_layers=False).items()
        }
        config = self.model.peft_config["default"] if self.where.last else None
        weights = {n: p.detach().cpu().clone() for n, p in self.named}
        return self.where.replica, self.where.stage, weights, state, peft_state, config

    @staticmethod
    def _whole(everyone: list[Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor], Any]:
        """Replica 0's stages in order: the whole model's LoRA weights in the whole model's order."""
        stages = sorted((e for e in everyone if e is not None), key=lambda e: e[1])
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, Any] = {}
        peft_state: dict[str, torch.Tensor] = {}
        config = None
        for _, _, params, state, peft_part, peft_config in stages:
            weights |= params
            moments |= state
            peft_state |= peft_part
            config = peft_config or config
        return weights, moments, peft_state, config

    def _adapter_writer(self, peft_state: dict[str, torch.Tensor], config: Any) -> Any:
        def write(folder: Path) -> None:
            from safetensors.torch import save_file

            folder.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in peft_state.items()}, str(folder / "adapter_model.safetensors"),
                      metadata={"format": "pt"})  # fmt: skip
            # The stage's own config names its temporary directory as the base: name the job's, as data parallel does.
            dataclasses.replace(config, base_model_name_or_path=self.job.model.source).save_pretrained(str(folder))

        return write

    def save(self, run_dir: Path, step: int, optimizer: torch.optim.Optimizer, scheduler: Any,
             extra: dict[str, Any]) -> Path | None:  # fmt: skip
        rngs = checkpoint.gather_rngs(self.health)
        everyone = self._gather(optimizer)
        if not self.info.is_main or everyone is None:
            return None
        weights, moments, peft_state, config = self._whole(everyone)
        group = {k: v for k, v in optimizer.state_dict()["param_groups"][0].items() if k != "params"}
        names = list(weights)
        optim = {
            "state": {i: moments[n] for i, n in enumerate(names) if n in moments},
            "param_groups": [group | {"params": list(range(len(names)))}],
        }
        state = {"step": step, "trainable": weights, "optimizer": optim, "scheduler": scheduler.state_dict(),
                 "rng": rngs, **extra, "layout": self.layout.to_dict()}  # fmt: skip
        return checkpoint.write(run_dir, step, state, self.job.checkpoint.keep_last,
                                self._adapter_writer(peft_state, config))  # fmt: skip

    def restore(self, run_dir: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> checkpoint.Restored | None:
        """The newest checkpoint, whatever layout wrote it: this stage takes its layers' weights and moments."""
        fetched = checkpoint.fetch(run_dir, self.info.rank, self.info.main_rank)
        if fetched is None:
            return None
        path, state = fetched
        names = list(state["trainable"])
        saved = state["optimizer"]
        with torch.no_grad():
            for name, param in self.named:
                param.copy_(state["trainable"][name].to(param.device))
        index = {name: i for i, name in enumerate(names)}
        mine = {j: saved["state"][index[n]] for j, (n, _) in enumerate(self.named) if index[n] in saved["state"]}
        group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        optimizer.load_state_dict({"state": mine, "param_groups": [group | {"params": list(range(len(self.named)))}]})
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.restore_rng(state, self.info.rank)
        return checkpoint.restored(path, state)

    def save_adapter(self, folder: Path) -> None:
        per_step = self.runner.step_bytes / max(1, self.runner.steps) / 1e6
        log.info("per step this stage sent %.2f MB of hidden states and gradients, all-reduced %.2f MB of LoRA "
                 "gradients", per_step, self.sync.bytes_per_step / 1e6)  # fmt: skip
        everyone = self._gather(None)
        if self.info.is_main and everyone is not None:
            _, _, peft_state, config = self._whole(everyone)
            self._adapter_writer(peft_state, config)(folder)

    def answers(self, records: list[Record]) -> tuple[list[str], list[str]] | None:
        """Collective: replica 0 answers greedily through its stages, base then fine-tuned; every rank gets them."""
        replica = self.layout.replicas[0]
        result: list[Any] = [None]
        if self.where.replica == 0:
            was_training = self.model.training
            self.model.eval()
            assert self.job.eval is not None
            config = self.model.get_base_model().generation_config
            stops = {self.tokenizer.eos_token_id, *([config.eos_token_id] if isinstance(config.eos_token_id, int)
                                                     else config.eos_token_id or [])}  # fmt: skip
            texts: list[list[str]] = [[], []]
            for column, adapter in enumerate((False, True)):
                with contextlib.nullcontext() if adapter else evaluate.base_model(self.model):
                    for record in records:
                        prompt = prompt_text(record.fields, self.job.data, self.tokenizer)
                        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
                        new = self.runner.generate(ids.to(self.info.device), self.job.eval.max_new_tokens,
                                                   {s for s in stops if s is not None}, replica.ranks)  # fmt: skip
                        texts[column].append(self.tokenizer.decode(new, skip_special_tokens=True).strip())
            self.model.train(was_training)
            result = [(texts[0], texts[1])]
        distributed.wait_for_all("replica 0 has answered the samples", self.job.distributed.startup_timeout_s)
        if dist.is_initialized():
            return self.health.broadcast_objects(result[0], replica.ranks[-1])  # type: ignore[no-any-return]
        return result[0]  # type: ignore[no-any-return]


Engine = DataParallel | Pipelined


def peak_gib(device: torch.device) -> float:
    """This rank's peak memory: allocated on its GPU, or its process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / (1 << 30)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # Linux reports KiB


@functools.cache
def device_name(device: torch.device) -> str:
    """The rank's device for people (its status file, the model card): the GPU's name and memory, or the CPU's
    model ("cuda: NVIDIA GeForce RTX 4070, 7.6 GiB", "cpu: AMD EPYC 7B13"). Once per process."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda: {props.name}, {props.total_memory / (1 << 30):.1f} GiB"
    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return f"{device.type}: {model or platform.processor() or platform.machine() or 'unknown model'}"


def build(job: JobConfig, info: RankInfo, code_dir: Path, layout: Layout, run_dir: Path,
          health: GroupHealth) -> Engine:  # fmt: skip
    """The rank's engine; its waits on collectives end when ``health`` says the group broke."""
    if layout.pipelined:
        log.info("layout (%s): %s", layout.reason, layout.describe())
        return Pipelined(job, info, code_dir, layout, run_dir, health)
    return DataParallel(job, info, code_dir, layout, health)
