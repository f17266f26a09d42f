"""The training loop every rank runs. ``run`` reads top to bottom: set-up, resume, the records, the steps (each one
with its records and checkpoints, and the regroup when a host is lost), finish. ``Rank`` holds what the steps share."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from train.balance.batchplan import Balancer
from train.balance.sampler import GlobalBatchSampler
from train.config import JobConfig
from train.data import evaluate
from train.data.blocks import Blocks, prepare
from train.data.pairblocks import PairBlocks, prepare_eval_pairs, prepare_pairs
from train.data.records import describe_source
from train.dist import distributed
from train.dist.distributed import RankInfo
from train.layout import engine, placement
from train.layout.topology import Layout
from train.metrics import (
    MetricsWriter,
    RankStatus,
    last_logged_step,
    plot_loss,
    rank_figures,
    steps_by_host,
    take_over,
    write_samples,
    write_status,
)
from train.recovery import checkpoint, lending, rejoin
from train.recovery.failure import NonFiniteError
from train.recovery.membership import Change, Membership, weights_digest
from train.schedule import warmup_cosine

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """The optimizer steps done so far, for the failure record of a rank that stops mid-run; after a change of group,
    what the rank's status file says of it (train/recovery/membership.py), with the digest of its weights at the first
    step in the new group (every member's must be the same)."""

    step: int | None = None
    weights_due: bool = False
    regrouped: dict[str, Any] | None = None  # the last regroup, with the weights' digest once a step ran after it


def run(job: JobConfig, run_dir: Path, code_dir: Path, resume: bool, progress: Progress,
        membership: Membership) -> bool:  # fmt: skip
    """Train (under `make bench`, the job's benchmark section makes this rank emulate a slower device). Between two
    steps is the one point where the group may change (train/recovery/membership.py): hosts taken back in after a
    step, hosts their owners took back, or the survivors of a lost host where a step broke off. Returns True where
    this rank's host was taken back and the rank left the run (train/recovery/lending.py), False at the run's end."""
    rank = Rank.set_up(job, run_dir, code_dir, progress, membership)
    joining = rejoin.requested()  # this host's ranks crashed and were started again: they take the group's state
    rank.resume(resume and not joining)
    if joining:  # into the running group: its step, weights and optimizer state (train/recovery/rejoin.py)
        rank.change_group(membership.come_back(rank.trainer.in_place))
    rank.open_records()
    if rank.start == 0 and not joining:
        rank.held_out_loss(0, adapter=False)
    rank.trainer.train()
    rank.describe()
    membership.watch(publish=not joining and rank.trainer.in_place)
    progress.step = rank.start
    while progress.step < job.train.max_steps:
        change: Change | None
        try:
            rank.step(progress.step)
            change = membership.after_step(rank.balancer.clock.proposed, rank.balancer.clock.leavers)
        except Exception as exc:
            change = membership.after_loss(exc, progress.step, rank.trainer.in_place)
        if change is not None and change.leaves:
            rank.leave(change)
            return True
        if change is not None:
            rank.change_group(change)
    rank.finish()
    return False


@dataclass
class Rank:
    """One rank's run between its set-up and its finish: the model, data, optimizer and the records it keeps."""

    job: JobConfig
    info: RankInfo
    run_dir: Path
    code_dir: Path
    progress: Progress
    membership: Membership  # the group this rank is in, and what lives with it (train/recovery/membership.py)
    layout: Layout  # train/layout/placement.py: data parallel, or pipeline stages
    trainer: engine.Engine  # train/layout/engine.py: a whole replica, or this rank's stage
    trainable: list[torch.nn.Parameter]  # what the optimizer updates
    blocks: Blocks | PairBlocks  # PairBlocks: a preference method's pairs (train/data/pairblocks.py)
    held_out: evaluate.HeldOut | None
    data: dict[str, Any] | None  # run.json ``data`` (the main rank's, hashed while the others load)
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    phases: dict[str, float]
    start: int = 0
    writer: MetricsWriter | None = None  # the run's records, on the main rank
    shadow: MetricsWriter | None = None  # the same rows on every other host, should it take the records over
    part: str = ""  # what this rank computes, for `make status`
    device: str = ""  # and on what, for the model card
    balancer: Balancer = field(init=False)  # train/balance/batchplan.py, once the trainer has started
    sampler: GlobalBatchSampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = GlobalBatchSampler(len(self.blocks), self.job.train.global_batch_size, self.job.train.seed)

    @classmethod
    def set_up(cls, job: JobConfig, run_dir: Path, code_dir: Path, progress: Progress, membership: Membership) -> Rank:
        """The model (or this rank's stage of it), the data, the held-out set and the optimizer, on every rank."""
        info = membership.info
        torch.manual_seed(job.train.seed)
        layout = placement.decide(job, info, code_dir)  # data parallel, or pipeline stages when the model needs them
        job = placement.sized(job, layout, info.rank)  # a smaller micro-batch where only that fits the whole model
        trainer = engine.build(job, info, code_dir, layout, run_dir, membership.health)
        blocks = _training_rows(job, trainer.tokenizer, code_dir)
        job = job.for_rows(len(blocks))  # train.epochs: the run's length in steps, from the rows every rank built
        held_out = _held_out(job, trainer.tokenizer, code_dir)
        data = _data_facts(job, code_dir, blocks, held_out) if info.is_main else None  # hashing: inside the wait
        # Loading takes each host its own time; from here on collectives wait at most distributed.timeout_s.
        distributed.wait_for_all("the model and data are loaded", job.distributed.startup_timeout_s)
        phases = {"loaded": time.time()}  # where a launch's seconds go (the controller's: ugro/run/phases.py)
        optim, trainable = job.optim, trainer.trainable
        optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )
        scheduler = warmup_cosine(optimizer, job.schedule.warmup_steps, job.train.max_steps, job.schedule.min_lr_ratio)
        torch.manual_seed(job.train.seed + 7919 * (info.rank + 1))  # LoRA dropout differs per rank
        return cls(job, info, run_dir, code_dir, progress, membership, layout, trainer, trainable, blocks, held_out,
                   data, optimizer, scheduler, phases)  # fmt: skip

    def resume(self, from_checkpoint: bool) -> None:
        """From the last intact checkpoint when ``from_checkpoint``; then the trainer starts (its DDP wrap or its
        stages) with the balance plan the checkpoint kept."""
        job, info = self.job, self.info
        restored = self.trainer.restore(self.run_dir, self.optimizer, self.scheduler) if from_checkpoint else None
        if restored is not None:
            self.start = restored.step
            log.info("resumed from %s at step %d", restored.path, self.start)
            if info.is_main:
                resumed = {"from_step": self.start, "last_step_logged": last_logged_step(self.run_dir),
                           "attempt": info.attempt, "world_size": info.world_size,
                           "hosts": sorted(set(info.hosts))}  # fmt: skip
                write_status(self.run_dir, resumed=resumed)
        elif from_checkpoint:
            log.info("no intact checkpoint in %s: starting from step 0", self.run_dir / "checkpoints")
        how = self.trainer.start(restored.extra.get("plan") if restored else None)
        self.balancer = self.trainer.balancer
        log.info("backend=%s device=%s cpu_threads=%d blocks=%d seq_len=%d trainable=%d micro_batch_cap=%d %s",
                 self.trainer.backend, info.device, torch.get_num_threads(), len(self.blocks), job.data.seq_len,
                 sum(p.numel() for p in self.trainable), job.micro_batch_cap, how)  # fmt: skip

    def open_records(self) -> None:
        """The main rank's records; on every other host's first rank, the same rows kept aside (a change of group
        after the main host is lost makes that host keep the run's records: ``change_group``)."""
        info = self.info
        if info.is_main:
            self.writer = self.keep_records(self.start)
        several_hosts = len(set(info.hosts)) > 1
        if several_hosts and not self.layout.pipelined and not info.is_main and info.local_rank == 0:
            self.shadow = MetricsWriter(self.shadow_dir, self.job.train.max_steps, self.start, tensorboard=False)

    @property
    def shadow_dir(self) -> Path:
        return self.run_dir / "hosts" / self.info.host

    def keep_records(self, first: int) -> MetricsWriter:
        """The run's state (run.json), metrics and TensorBoard from step ``first``."""
        job, info = self.job, self.info
        write_status(
            self.run_dir, state="running", step=first, total_steps=job.train.max_steps, backend=self.trainer.backend,
            collectives=distributed.collectives_backend(),  # what carried them: nccl, gloo, or the tests' NCCL-like
            world_size=info.world_size, plan=self.balancer.plan.to_dict(), layout=self.layout.to_dict(),
            error=None, cause=None,  # a relaunch after a failure starts clean
            records_moved_to=None,  # this host keeps them (again)
            # What the model card (ugro/model/card.py) tells: the job as the main rank runs it (rank_local with its
            # host's profile merged), and the data it trained and was judged on.
            job=job.model_dump(mode="json"),
            data=self.data or _data_facts(job, self.code_dir, self.blocks, self.held_out),
        )  # fmt: skip
        return MetricsWriter(self.run_dir, job.train.max_steps, first)

    def held_out_loss(self, step: int, adapter: bool = True) -> None:
        """Every rank evaluates its part; the main rank records the mean over all of them (with a preference
        method, the held-out pairs' figures: train/preference/evaluate.py)."""
        if self.held_out is None or self.job.eval is None:
            return
        pairs: dict[str, float | None] | None = None
        if isinstance(self.trainer, engine.DataParallel) and self.trainer.preference is not None:
            pairs = self.trainer.held_out_preference(self.held_out, self.job.eval.batch_size, adapter)
            value, count = float(pairs["loss"] or 0.0), int(pairs["items"] or 0)
        else:
            with contextlib.nullcontext() if adapter else self.trainer.base_model():
                value, count = self.trainer.held_out_loss(self.held_out, self.job.eval.batch_size)
        if self.shadow is not None:
            self.shadow.log_eval(step, value, count, adapter, pairs)
        if self.writer is not None:
            self.writer.log_eval(step, value, count, adapter, pairs)
            who = "fine-tuned" if adapter else "base model"
            if pairs is None:
                log.info("step %d: held-out loss %.4f over %d answer tokens (%s)", step, value, count, who)
            else:
                log.info("step %d: held-out %s loss %.4f over %d items, %s (%s)", step, self.job.train.method,
                         value, count, pair_line(pairs), who)  # fmt: skip
            fields: dict[str, Any] = {"eval_loss_after" if adapter else "eval_loss_before": round(value, 6)}
            if pairs is not None:
                fields["eval_preference_after" if adapter else "eval_preference_before"] = pairs
            write_status(self.run_dir, **fields)

    def describe(self) -> None:
        """What this rank computes, and on what (for `make status` and the model card)."""
        self.part = self.layout.describe_rank(self.info.rank)
        self.device = engine.device_name(self.info.device)

    def step(self, step: int) -> None:
        """Step ``step`` + 1 on every rank: forward, backward, the all-reduce, the update; then its records, the
        held-out loss and a checkpoint as the job asks."""
        indices = self.sampler.micro_batches(
            step, self.trainer.batch_rank, self.balancer.plan.shares, self.balancer.micro_sizes()
        )
        self.balancer.clock.proposing = self.membership.door.waiting()  # hosts asking to rejoin: after this step
        self.balancer.clock.leaving = self.membership.wanted_back(self.trainer.in_place)  # leaves after this step
        loss, tokens = self.trainer.step([self.blocks.batch(ix, self.info.device) for ix in indices])
        shares = self.trainer.rank_shares()  # the split this step ran with
        new_plan = self.balancer.after_step(warming_up=step < self.start + 2)
        if new_plan is not None:
            log.info("step %d: re-planned from measured step times: %s", step + 1, new_plan.describe())
            if self.info.is_main:
                write_status(self.run_dir, plan=new_plan.to_dict())
        lr, grad_norm = self.update(step, loss)
        done = self.progress.step = step + 1
        self.record(done, loss, tokens, lr, grad_norm, shares)
        job = self.job
        if job.eval is not None and (done % job.eval.every == 0 or done == job.train.max_steps):
            self.held_out_loss(done)
        stop = self.membership.preemption.requested()  # collective when installed: every rank stops after this step
        if done % job.checkpoint.every == 0 or done == job.train.max_steps or stop:
            self.save_checkpoint(done)
        if stop and done < job.train.max_steps:
            raise self.membership.preemption.stop(self.run_dir, self.info.is_main, done)

    def update(self, step: int, loss: float) -> tuple[float, float]:
        """Clip and apply the update; a non-finite loss or gradient stops the run before it is applied."""
        grad_norm = self.trainer.clip(self.job.optim.grad_clip)
        # The commit point: a collective of this step that a watchdog ended left its buffers as they were (NaN, a
        # partial sum); the group's recorded error says so, and the step is a failed collective, not an update.
        self.membership.health.committable(self.info.device)
        lr = float(self.scheduler.get_last_lr()[0])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteError(
                f"step {step + 1}: loss={loss} grad_norm={grad_norm} at lr={lr:.3g}. The update was not applied. "
                f"Last good checkpoint: {checkpoint.latest_valid(self.run_dir) or 'none'}. "
                "Lower optim.lr, raise schedule.warmup_steps or lower optim.grad_clip, then resume."
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, grad_norm

    def record(self, done: int, loss: float, tokens: int, lr: float, grad_norm: float, shares: Any) -> None:
        """The step's rows: this rank's status, the shadow's and the main rank's metrics, and the log line."""
        info, progress, clock = self.info, self.progress, self.balancer.clock
        figures = rank_figures(info.hosts, shares, clock.gathered, clock.gathered_tokens, clock.gathered_peak_gib)
        clock.last_peak_gib = engine.peak_gib(info.device)  # the next step's exchange carries it to every rank
        if progress.weights_due and progress.regrouped is not None:  # the survivors' weights, to compare
            progress.regrouped["weights"] = {"step": done, "sha256": weights_digest(self.trainable)}
            progress.weights_due = False
        total = self.job.train.max_steps
        RankStatus(info.host, info.rank, done, total, loss, figures, self.part, self.device,
                   progress.regrouped).write(self.run_dir)  # fmt: skip
        epoch = self.sampler.epoch_of(done)
        pairs = self.trainer.preference.figures if self.trainer.preference is not None else None
        if self.shadow is not None:
            self.shadow.log(done, loss, tokens, lr, grad_norm, epoch, figures, pairs)
        if self.writer is None:
            return
        row = self.writer.log(done, loss, tokens, lr, grad_norm, epoch, figures, pairs)
        if done == self.start + 1 and info.attempt == 0:  # the first launch's (a relaunch's are in its restart)
            write_status(self.run_dir, phases=self.phases | {"first_step": row["time"]})
        if done % self.job.train.log_every == 0 or done in (self.start + 1, total):
            ready = "/".join(f"{t:.2f}" for t in clock.gathered)  # the step before: a balance check
            log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f ranks ready after %s s", done, total,
                     loss, lr, grad_norm, row["tokens_per_s"], ready)  # fmt: skip

    def save_checkpoint(self, done: int) -> None:
        plan = self.balancer.plan.to_dict()
        extra = {"cluster_hash": self.job.cluster_hash(), "world_size": self.info.world_size, "plan": plan}
        saved = self.trainer.save(self.run_dir, done, self.optimizer, self.scheduler, extra)
        if saved is not None:
            log.info("checkpoint %s written and verified", saved)
            write_status(self.run_dir, step=done, last_checkpoint=str(saved))

    def change_group(self, change: Change) -> None:
        """Go on in the next group (train/recovery/membership.py ``enter``): from the step it agreed, with the weights,
        optimizer state and shares it gave; where the main host was the one lost, this host keeps the run's records
        from now on."""
        progress = self.progress
        done = -1 if progress.step is None else progress.step  # -1: this host's ranks have just come back
        progress.regrouped = self.membership.enter(change, self, done)
        self.info = self.membership.info
        progress.step = progress.regrouped["from_step"]
        if done < 0:
            self.start = progress.step
        progress.weights_due, self.balancer, self.layout = True, self.trainer.balancer, self.trainer.layout
        if self.info.is_main and self.writer is None and done >= 0:
            if self.shadow is not None:
                self.shadow.close()
                take_over(self.shadow_dir, self.run_dir)
                self.shadow = None
            self.writer = self.keep_records(progress.step)

    def leave(self, change: Change) -> None:
        """This rank's host was taken back (train/recovery/lending.py): the rank ends after the step every rank of the
        group completed, and says so on its host; the others go on in ``change.group``, whose main host keeps the
        run's records from now on (every other host's first rank kept the same rows)."""
        done = self.progress.step or 0
        host_dir = self.membership.host_dir
        asked = lending.request(host_dir) or lending.Request(time.time(), lending.BY_HAND, "taken back")
        lending.record_left(host_dir, lending.Lent(round(time.time(), 3), done, self.info.attempt,
                                                   change.group.generation, change.group.main, asked))  # fmt: skip
        self.membership.finish()
        for writer in (self.shadow, self.writer):
            if writer is not None:
                writer.close()
        if self.writer is not None:
            write_status(self.run_dir, records_moved_to={"host": change.group.main, "step": done})
        log.info("%s: this host's ranks leave the run after step %d; %s go on (main host %s), nothing redone",
                 asked.line(self.info.host), done, ", ".join(change.group.members), change.group.main)  # fmt: skip

    def finish(self) -> None:
        """The adapter, the answers before and after, the loss picture and the finished state; then every rank
        waits for the main one to have written them."""
        job, run_dir, held_out = self.job, self.run_dir, self.held_out
        self.membership.finish()  # the peers end their processes from now on: that breaks no group
        self.trainer.save_adapter(run_dir / "adapter")  # with stages: every stage's LoRA weights on the main rank
        asked = held_out.records[: job.eval.samples] if held_out is not None and job.eval is not None else []
        answered = self.trainer.answers(asked) if asked else None  # through the stages with a pipeline
        if self.shadow is not None:
            self.shadow.close()
        if self.writer is not None:
            self.writer.close()
            self.trainer.tokenizer.save_pretrained(str(run_dir / "adapter"))
            checkpoint.name_base(run_dir / "adapter", job.model.source)
            if answered is not None:
                items = [
                    {"question": evaluate.question(r), "reference": evaluate.reference(r), "before": b, "after": a}
                    for r, b, a in zip(asked, *answered, strict=True)
                ]
                log.info("answers before/after in %s", write_samples(run_dir, job.model.source, items))
            plot_loss(run_dir)
            write_status(run_dir, state="finished", step=job.train.max_steps, error=None, cause=None,
                         steps_by_host=steps_by_host(run_dir))  # fmt: skip
            log.info("finished: adapter in %s", run_dir / "adapter")
        log.info("peak memory of this rank: %.2f GiB (%s)", engine.peak_gib(self.info.device), self.part)
        distributed.wait_for_all("the main rank has written the results", job.distributed.startup_timeout_s)
        self.membership.settle()  # collectives a change of group abandoned end before the process does


def _training_rows(job: JobConfig, tokenizer: Any, code_dir: Path) -> Blocks | PairBlocks:
    """The training rows every rank builds alike: packed blocks for sft, pairs for a preference method."""
    if job.train.method == "sft":
        return prepare(job.data, tokenizer, code_dir, job.train.seed)
    return prepare_pairs(job, tokenizer, code_dir)


def _held_out(job: JobConfig, tokenizer: Any, code_dir: Path) -> evaluate.HeldOut | None:
    if job.eval is None or job.train.method == "sft":
        return evaluate.load(job, tokenizer, code_dir)
    records, pairs = prepare_eval_pairs(job.eval.source, job, tokenizer, code_dir)
    return evaluate.HeldOut(records, pairs)


def pair_line(figures: dict[str, float | None]) -> str:
    """The held-out pairs' figures in a line: the model's own preference, and the rewards against the base."""
    parts = []
    if figures.get("preference_accuracy") is not None:
        parts.append(f"prefers the chosen answer in {figures['preference_accuracy']:.0%} of pairs")
    parts.append(f"log-prob margin {figures.get('logp_margin') or 0.0:+.3f}")
    parts.append(f"reward margin {figures.get('rewards_margin') or 0.0:+.3f}")
    return ", ".join(parts)


def _data_facts(
    job: JobConfig, code_dir: Path, blocks: Blocks | PairBlocks, held_out: evaluate.HeldOut | None
) -> dict[str, Any]:
    """run.json ``data``: each data file as the job names it, its sha256 and the records the run loaded from it
    (with several data sets, ``train_sets``: each one's, with its weight and the records it gave an epoch)."""
    facts: dict[str, Any] = {}
    if job.data.source is not None:
        facts["train"] = describe_source(job.data.source, code_dir, blocks.records)
    else:
        facts["train"] = {"source": f"{len(blocks.sets)} data sets", "sha256": None, "records": blocks.records}
        facts["train_sets"] = [
            describe_source(s["source"], code_dir, s["read"]) | {"weight": s["weight"], "used": s["used"]}
            for s in blocks.sets
        ]
    if held_out is not None and job.eval is not None:
        facts["eval"] = describe_source(job.eval.source, code_dir, len(held_out.records))
    return facts
