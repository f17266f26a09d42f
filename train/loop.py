"""The training loop every rank runs. Read top to bottom: set-up, resume, steps, checkpoints, finish."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train import checkpoint, distributed, door, engine, evaluate, placement, preempt, regroup, rejoin, survivors
from train.config import JobConfig
from train.data import Blocks, prepare
from train.distributed import RankInfo
from train.failure import NonFiniteError
from train.metrics import (
    MetricsWriter,
    last_logged_step,
    plot_loss,
    rank_figures,
    take_over,
    write_rank_status,
    write_samples,
    write_status,
)
from train.records import describe_source
from train.sampler import GlobalBatchSampler
from train.schedule import warmup_cosine

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """The optimizer steps done so far, for the failure record of a rank that stops mid-run; after a regroup, what
    the rank's status file says of it (train/survivors.py), with the digest of its weights at the first step in the
    new group (every survivor's must be the same)."""

    step: int | None = None
    weights_due: bool = False
    regrouped: dict[str, Any] | None = None  # the last regroup, with the weights' digest once a step ran after it


def _data_facts(job: JobConfig, code_dir: Path, blocks: Blocks, held_out: evaluate.HeldOut | None) -> dict[str, Any]:
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


def run(job: JobConfig, info: RankInfo, run_dir: Path, code_dir: Path, resume: bool, progress: Progress) -> None:
    """Train (under `make bench`, the job's benchmark section makes this rank emulate a slower device)."""
    torch.manual_seed(job.train.seed)
    preempt.install()  # a batch scheduler's warning before its time limit (train/preempt.py); LAN: nothing
    layout = placement.decide(job, info, code_dir)  # data parallel, or pipeline stages when the model needs them
    job = placement.sized(job, layout, info.rank)  # a smaller micro-batch where only that fits the whole model
    trainer = engine.build(job, info, code_dir, layout, run_dir)  # a whole replica, or this rank's stage
    tokenizer, backend = trainer.tokenizer, trainer.backend
    blocks = prepare(job.data, tokenizer, code_dir, job.train.seed)
    job = job.for_rows(len(blocks))  # train.epochs: the run's length in steps, from the rows every rank built
    held_out = evaluate.load(job, tokenizer, code_dir)
    data = _data_facts(job, code_dir, blocks, held_out) if info.is_main else None  # hashing: inside the wait
    # Loading takes each host its own time; from here on collectives wait at most distributed.timeout_s.
    distributed.wait_for_all("the model and data are loaded", job.distributed.startup_timeout_s)
    # Where a launch's seconds go (the controller prints them with its own: ugro/run/phases.py).
    phases = {"loaded": time.time()}
    sampler = GlobalBatchSampler(len(blocks), job.train.global_batch_size, job.train.seed)
    trainable = trainer.trainable
    optimizer = torch.optim.AdamW(
        trainable, lr=job.optim.lr, betas=job.optim.betas, eps=job.optim.eps, weight_decay=job.optim.weight_decay
    )
    scheduler = warmup_cosine(optimizer, job.schedule.warmup_steps, job.train.max_steps, job.schedule.min_lr_ratio)

    start = 0
    torch.manual_seed(job.train.seed + 7919 * (info.rank + 1))  # LoRA dropout differs per rank
    joining = rejoin.requested()  # this host's ranks crashed and were started again: they take the group's state
    restored = trainer.restore(run_dir, optimizer, scheduler) if resume and not joining else None
    if restored is not None:
        start = restored.step
        log.info("resumed from %s at step %d", restored.path, start)
        if info.is_main:
            resumed = {"from_step": start, "last_step_logged": last_logged_step(run_dir), "attempt": info.attempt,
                       "world_size": info.world_size, "hosts": sorted(set(info.hosts))}  # fmt: skip
            write_status(run_dir, resumed=resumed)
    elif resume and not joining:
        log.info("no intact checkpoint in %s: starting from step 0", run_dir / "checkpoints")

    how = trainer.start(restored.extra.get("plan") if restored else None)
    balancer = trainer.balancer
    log.info(
        "backend=%s device=%s cpu_threads=%d blocks=%d seq_len=%d trainable=%d micro_batch_cap=%d %s",
        backend,
        info.device,
        torch.get_num_threads(),
        len(blocks),
        job.data.seq_len,
        sum(p.numel() for p in trainable),
        job.micro_batch_cap,
        how,
    )
    if joining:  # into the running group: its step, weights and optimizer state (train/rejoin.py)
        info, progress.regrouped = survivors.come_back(info, trainer, optimizer, scheduler, run_dir, job)
        start, progress.weights_due, balancer = progress.regrouped["from_step"], True, trainer.balancer
        layout = trainer.layout

    def keep_records(first: int) -> MetricsWriter:
        """The main rank's records of the run from step ``first``: its state (run.json), metrics and TensorBoard.
        The first main rank opens them at the start; a survivor whose host becomes the main one, after a regroup."""
        write_status(
            run_dir,
            state="running",
            step=first,
            total_steps=job.train.max_steps,
            backend=backend,
            world_size=info.world_size,
            plan=balancer.plan.to_dict(),
            layout=layout.to_dict(),
            error=None,  # a relaunch after a failure starts clean
            cause=None,
            # What the model card (ugro/model/card.py) tells: the job as the main rank runs it (rank_local with its
            # host's profile merged), and the data it trained and was judged on.
            job=job.model_dump(mode="json"),
            data=data or _data_facts(job, code_dir, blocks, held_out),
        )
        return MetricsWriter(run_dir, job.train.max_steps, first)

    writer = keep_records(start) if info.is_main else None
    # Every other host's first rank keeps the same rows, should its host take over the run's records (a regroup
    # after the main host is lost: train/survivors.py).
    several_hosts = len(set(info.hosts)) > 1
    shadow_dir = run_dir / "hosts" / info.host
    shadow = MetricsWriter(shadow_dir, job.train.max_steps, start, tensorboard=False) if (
        several_hosts and not layout.pipelined and not info.is_main and info.local_rank == 0) else None  # fmt: skip

    def held_out_loss(step: int, adapter: bool = True) -> None:
        """Every rank evaluates its part; the main rank records the mean over all of them."""
        if held_out is None or job.eval is None:
            return
        with contextlib.nullcontext() if adapter else trainer.base_model():
            value, count = trainer.held_out_loss(held_out, job.eval.batch_size)
        if shadow is not None:
            shadow.log_eval(step, value, count, adapter)
        if writer is not None:
            writer.log_eval(step, value, count, adapter)
            log.info("step %d: held-out loss %.4f over %d answer tokens (%s)", step, value, count,
                     "fine-tuned" if adapter else "base model")  # fmt: skip
            write_status(run_dir, **{"eval_loss_after" if adapter else "eval_loss_before": round(value, 6)})

    if start == 0 and not joining:
        held_out_loss(0, adapter=False)
    trainer.train()
    part = layout.describe_rank(info.rank)  # what this rank computes, for `make status`
    device = engine.device_name(info.device)  # and on what, for the model card
    # Ranks on several hosts go on without a lost host, in their own processes (train/regroup.py).
    peers = {h: e for h, e in info.stores if h != info.host} if info.local_rank == 0 else None
    watch = regroup.start(run_dir, info.host, peers) if several_hosts else None
    if watch is not None and trainer.in_place and not joining:  # a host whose ranks crash may come back
        rejoin.publish(run_dir, info, watch.generation, job.cluster_hash())

    def one_step(step: int) -> None:
        """Step ``step`` + 1 on every rank: forward, backward, the all-reduce, the update; then log, evaluate and
        checkpoint as the job asks."""
        indices = sampler.micro_batches(step, trainer.batch_rank, balancer.plan.shares, balancer.micro_sizes())
        micro_batches = [blocks.batch(ix, info.device) for ix in indices]
        loss, tokens = trainer.step(micro_batches)
        shares = trainer.rank_shares()  # the split this step ran with
        new_plan = balancer.after_step(warming_up=step < start + 2)
        if new_plan is not None:
            log.info("step %d: re-planned from measured step times: %s", step + 1, new_plan.describe())
            if info.is_main:
                write_status(run_dir, plan=new_plan.to_dict())
        grad_norm = trainer.clip(job.optim.grad_clip)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            last = checkpoint.latest_valid(run_dir)
            raise NonFiniteError(
                f"step {step + 1}: loss={loss} grad_norm={grad_norm} at lr={scheduler.get_last_lr()[0]:.3g}. "
                f"The update was not applied. Last good checkpoint: {last or 'none'}. "
                "Lower optim.lr, raise schedule.warmup_steps or lower optim.grad_clip, then resume."
            )
        lr = float(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = progress.step = step + 1
        figures = rank_figures(info.hosts, shares, balancer.clock.gathered, balancer.clock.gathered_tokens)
        if progress.weights_due and progress.regrouped is not None:  # the survivors' weights, to compare
            progress.regrouped["weights"] = {"step": done, "sha256": survivors.weights_digest(trainable)}
            progress.weights_due = False
        write_rank_status(run_dir, info.host, info.rank, done, job.train.max_steps, loss, figures, part, device,
                          progress.regrouped)  # fmt: skip

        if shadow is not None:
            shadow.log(done, loss, tokens, lr, grad_norm, sampler.epoch_of(done), figures)
        if writer is not None:
            row = writer.log(done, loss, tokens, lr, grad_norm, sampler.epoch_of(done), figures)
            if done == start + 1 and info.attempt == 0:  # the first launch's (a relaunch's are in its restart)
                write_status(run_dir, phases=phases | {"first_step": row["time"]})
            if done % job.train.log_every == 0 or done in (start + 1, job.train.max_steps):
                log.info(
                    "step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f ranks ready after %s s",
                    done,
                    job.train.max_steps,
                    loss,
                    lr,
                    grad_norm,
                    row["tokens_per_s"],
                    "/".join(f"{t:.2f}" for t in balancer.clock.gathered),  # the step before: a balance check
                )
        if job.eval is not None and (done % job.eval.every == 0 or done == job.train.max_steps):
            held_out_loss(done)
        stop = preempt.requested()  # collective when installed: every rank stops after this step
        if done % job.checkpoint.every == 0 or done == job.train.max_steps or stop:
            extra = {"cluster_hash": job.cluster_hash(), "world_size": info.world_size, "plan": balancer.plan.to_dict()}
            saved = trainer.save(run_dir, done, optimizer, scheduler, extra)
            if saved is not None:
                log.info("checkpoint %s written and verified", saved)
                write_status(run_dir, step=done, last_checkpoint=str(saved))
        if stop and done < job.train.max_steps:
            raise preempt.stop(run_dir, info.is_main, done)

    progress.step = start
    while progress.step < job.train.max_steps:
        try:
            one_step(progress.step)
            if watch is not None and door.due():  # hosts whose ranks came back: the group takes them in
                taken = survivors.take_in(info, watch, trainer, optimizer, scheduler, progress.step, run_dir, job)
                if taken is not None:
                    info, progress.regrouped = taken
                    progress.weights_due, balancer = True, trainer.balancer
        except Exception as exc:
            if watch is None or not regroup.broken(exc):
                raise
            done = int(progress.step or 0)
            info, progress.regrouped = survivors.go_on(exc, watch, info, trainer, optimizer, scheduler, done, run_dir,
                                                       job)  # fmt: skip
            progress.step, progress.weights_due = progress.regrouped["from_step"], True
            balancer = trainer.balancer
            if info.is_main and writer is None:  # the main host was the one lost: this host keeps the run now
                if shadow is not None:
                    shadow.close()
                    take_over(shadow_dir, run_dir)
                    shadow = None
                writer = keep_records(progress.step)

    beat = regroup.heartbeat()
    if beat is not None:  # the peers end their processes from now on: that breaks no group
        beat.stop()
    trainer.save_adapter(run_dir / "adapter")  # with stages: every stage's LoRA weights put together on the main rank
    asked = held_out.records[: job.eval.samples] if held_out is not None and job.eval is not None else []
    answered = trainer.answers(asked) if asked else None  # through the stages with a pipeline, on the main rank without
    if shadow is not None:
        shadow.close()
    if writer is not None:
        writer.close()
        tokenizer.save_pretrained(str(run_dir / "adapter"))
        checkpoint.name_base(run_dir / "adapter", job.model.source)
        if answered is not None:
            items = [
                {"question": evaluate.question(r), "reference": evaluate.reference(r), "before": b, "after": a}
                for r, b, a in zip(asked, *answered, strict=True)
            ]
            log.info("answers before/after in %s", write_samples(run_dir, job.model.source, items))
        plot_loss(run_dir)
        write_status(run_dir, state="finished", step=job.train.max_steps, error=None, cause=None)
        log.info("finished: adapter in %s", run_dir / "adapter")
    log.info("peak memory of this rank: %.2f GiB (%s)", engine.peak_gib(info.device), part)
    distributed.wait_for_all("the main rank has written the results", job.distributed.startup_timeout_s)
    if watch is not None:
        watch.settle(job.distributed.timeout_s)  # collectives a regroup abandoned end before the process does
