"""One optimizer step of a preference method over unequal per-rank shares of pairs (train.method dpo, orpo, kto).

With P items (pairs, or kto's examples) in the global batch and W ranks, rank r backpropagates
``W / P * sum of its items' loss terms`` (orpo adds ``W / N * its chosen answers' NLL``, N their tokens over all
ranks): DDP averages the gradients over the W ranks, so every rank holds the gradient of the method's loss over the
whole batch, whatever the split (train/preference/objective.py: each term depends on its own item). P, N and kto's
KL estimate (the mean over every rank's KL rows, TRL's batch-level figure) travel in the all-reduce every step makes
anyway (train/balance/step.py ``exchange_sums``), after each rank's passes without gradients (the reference with the
adapter off, kto's KL rows), which need none of them. The time a rank waits in that all-reduce is not its compute
(``StepClock.excluded``), so the balancer sees each rank's speed.

A micro-batch holds B items as 2B rows: row 0 of each, then row 1 (train/data/pairblocks.py ``PairBlocks.batch``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import cast

import torch
from torch.nn.parallel import DistributedDataParallel

from train.balance.step import StepClock, _summed, exchange_sums
from train.data.blocks import IGNORE
from train.dist.health import GroupHealth
from train.preference import objective as losses
from train.preference.logps import token_logps
from train.preference.objective import Objective, Terms
from train.preference.reference import ReferenceCache, adapter_off

# The figures every step adds up over the ranks (one all-reduce at its end), by name.
FIGURES = ("loss", "nll", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps", "chosen",
           "rejected", "correct", "pairs")  # fmt: skip


def rows(batch: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """The micro-batch's rows ``part`` (its row 0s: ``slice(0, B)``)."""
    return {key: batch[key][part] for key in ("input_ids", "attention_mask", "labels")}


def nll_targets(batch: dict[str, torch.Tensor], objective: Objective) -> torch.Tensor:
    """The tokens whose log-probabilities a step needs: the answers', and with orpo's NLL on the prompt every
    token of a row (as TRL's ORPOTrainer: every token the attention mask keeps)."""
    if objective.method == "orpo" and objective.nll_on_prompt:
        return torch.where(batch["attention_mask"] == 1, batch["input_ids"], IGNORE)
    return batch["labels"]


@dataclass
class Answers:
    """Every row's answer log-probability (summed over its answer tokens) and its answer tokens; with orpo the chosen
    rows' NLL (summed over their NLL tokens)."""

    logps: torch.Tensor  # [R] fp32, with gradients where the model has them
    tokens: torch.Tensor  # [R]
    nll: torch.Tensor | None = None


def answers(model: torch.nn.Module, batch: dict[str, torch.Tensor], objective: Objective,
            chosen_rows: int = 0) -> Answers:  # fmt: skip
    """The rows' answer log-probabilities under ``model`` as it is (adapter on or off, gradients or not); the NLL of
    the first ``chosen_rows`` rows where orpo needs it."""
    targets = nll_targets(batch, objective)
    logps = token_logps(model, batch, targets)
    keep = targets[:, 1:] != IGNORE
    row_of = keep.nonzero()[:, 0]
    answer = (batch["labels"][:, 1:] != IGNORE)[keep]
    count = batch["input_ids"].shape[0]
    sums = torch.zeros(count, dtype=torch.float32, device=logps.device).index_add(0, row_of[answer], logps[answer])
    tokens = (batch["labels"][:, 1:] != IGNORE).sum(dim=1)
    nll = -logps[row_of < chosen_rows].sum() if chosen_rows else None
    return Answers(sums, tokens, nll)


def trained_tokens(batch: dict[str, torch.Tensor], objective: Objective) -> int:
    """The answer tokens this micro-batch trains on: both rows' (kto: row 0's; its KL rows have no gradient)."""
    labels = batch["labels"] if objective.paired else batch["labels"][: len(batch["items"])]
    return int((labels[:, 1:] != IGNORE).sum())


def nll_tokens(batch: dict[str, torch.Tensor], objective: Objective) -> int:
    """orpo: the chosen rows' NLL tokens in this micro-batch (0 for the other methods)."""
    if objective.method != "orpo":
        return 0
    b = len(batch["items"])
    return int((nll_targets(batch, objective)[:b, 1:] != IGNORE).sum())


@dataclass
class Prepared:
    """What a micro-batch needs before its pass with gradients: the reference's row figures, kto's KL sum."""

    reference: torch.Tensor | None  # [2B]
    kl_sum: float = 0.0
    kl_rows: int = 0


@torch.no_grad()
def prepare(model: torch.nn.Module, batch: dict[str, torch.Tensor], objective: Objective,
            cache: ReferenceCache | None = None) -> Prepared:  # fmt: skip
    """The passes without gradients: the reference (the adapter off; from ``cache`` where it holds every item),
    and kto's KL rows under the model being tuned."""
    reference = None
    b = len(batch["items"])
    if objective.needs_reference:
        items = [int(i) for i in batch["items"].tolist()]
        reference = cache.lookup(items, batch["input_ids"].device) if cache is not None else None
        if reference is None:
            with adapter_off(model):
                reference = answers(model, batch, objective).logps
            if cache is not None:
                cache.keep(items, reference)
    if not objective.uses_kl:
        return Prepared(reference)
    assert reference is not None
    kl_rows = answers(model, rows(batch, slice(b, 2 * b)), objective).logps
    return Prepared(reference, float((kl_rows - reference[b:]).sum()), b)


def terms(model: torch.nn.Module, batch: dict[str, torch.Tensor], objective: Objective, prepared: Prepared,
          kl: float) -> tuple[Terms, torch.Tensor | None]:  # fmt: skip
    """The micro-batch's loss terms under ``model`` (with gradients), and orpo's NLL sum."""
    b = len(batch["items"])
    if objective.method == "kto":
        own = answers(model, rows(batch, slice(0, b)), objective)
        assert prepared.reference is not None
        return losses.kto(objective, own.logps, prepared.reference[:b], batch["desirable"], kl), None
    own = answers(model, batch, objective, chosen_rows=b if objective.method == "orpo" else 0)
    chosen, rejected = own.logps[:b], own.logps[b:]
    if objective.method == "orpo":
        return losses.orpo(objective, chosen, rejected, own.tokens[:b], own.tokens[b:]), own.nll
    assert prepared.reference is not None
    ref = prepared.reference
    return losses.dpo(objective, chosen, rejected, ref[:b], ref[b:], own.tokens[:b], own.tokens[b:]), None


def summed_figures(found: Terms, nll: torch.Tensor | None, pairs: int) -> torch.Tensor:
    """This micro-batch's share of ``FIGURES``, in fp64 on the model's device: nothing waits for the device here
    (the step reads them once, after its last micro-batch)."""
    zero = found.losses.new_zeros((), dtype=torch.float64)
    sums = [found.losses.detach().sum(), zero if nll is None else nll.detach(), found.chosen_rewards.sum(),
            found.rejected_rewards.sum(), found.chosen_logps.sum(), found.rejected_logps.sum()]  # fmt: skip
    counts = [found.chosen_rewards.numel(), found.rejected_rewards.numel()]
    values = [v.double() for v in sums] + [zero + c for c in counts] + [found.correct.double(), zero + pairs]
    return torch.stack(values)


def global_figures(summed: list[float], objective: Objective, items: int, nll_count: int) -> dict[str, float]:
    """The step's figures (TRL's names without their prefix) from ``FIGURES`` summed over the ranks."""
    got = dict(zip(FIGURES, summed, strict=True))
    loss = got["loss"] / max(items, 1)
    if objective.method == "orpo":
        loss += got["nll"] / max(nll_count, 1)
    chosen, rejected = got["chosen_rewards"] / max(got["chosen"], 1), got["rejected_rewards"] / max(got["rejected"], 1)
    out = {
        "loss": loss,
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "rewards_margin": chosen - rejected,
        "logps_chosen": got["chosen_logps"] / max(got["chosen"], 1),
        "logps_rejected": got["rejected_logps"] / max(got["rejected"], 1),
    }
    if objective.paired:
        out["rewards_accuracy"] = got["correct"] / max(got["pairs"], 1)
    if objective.method == "orpo":
        out["nll_loss"] = got["nll"] / max(nll_count, 1)
    return out


def backward(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    objective: Objective,
    clock: StepClock | None = None,
    health: GroupHealth | None = None,
    cache: ReferenceCache | None = None,
    figures: dict[str, float] | None = None,
) -> tuple[float, int]:
    """Accumulate the gradient of the method's loss over every rank's micro-batches; return (the global batch's
    loss, the answer tokens of every rank); ``figures`` (when given) receives the step's rewards, margins and
    accuracy over the whole batch."""
    clock = clock or StepClock()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    ddp = isinstance(model, DistributedDataParallel)
    inner = cast(DistributedDataParallel, model).module if ddp else model
    clock.begin()
    prepared = [prepare(inner, batch, objective, cache) for batch in micro_batches]
    own_tokens = sum(trained_tokens(b, objective) for b in micro_batches)
    own = [sum(len(b["items"]) for b in micro_batches), sum(nll_tokens(b, objective) for b in micro_batches),
           sum(p.kl_sum for p in prepared), sum(p.kl_rows for p in prepared)]  # fmt: skip
    with clock.excluded():
        total_tokens, (items, nll_count, kl_sum, kl_rows) = exchange_sums(own_tokens, clock, health, own)
    kl = max(kl_sum / kl_rows, 0.0) if objective.uses_kl and kl_rows else 0.0
    scale, nll_scale = world / max(items, 1), world / max(nll_count, 1)
    summed = torch.zeros(len(FIGURES), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, (batch, ready) in enumerate(zip(micro_batches, prepared, strict=True)):
        sync = i == last or not ddp
        clock.work(batch["input_ids"].numel())
        with contextlib.nullcontext() if sync else cast(DistributedDataParallel, model).no_sync():
            found, nll = terms(model, batch, objective, ready, kl)
            local = found.losses.sum() * scale
            if nll is not None:
                local = local + nll * nll_scale
            local.backward()
        if not (ddp and sync):
            clock.lap()
        summed += summed_figures(found, nll, len(batch["items"]))
    clock.end()
    clock.last_tokens = own_tokens
    result = global_figures(_summed(summed, health), objective, int(items), int(nll_count))
    if objective.uses_kl:
        result["kl"] = kl
    if figures is not None:
        figures.update(result)
    return result["loss"], total_tokens


class PreferenceStep:
    """What an engine holds to run a preference method's steps: the objective, this rank's reference cache, and the
    figures of the last step."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.cache = ReferenceCache() if objective.reference == "cached" else None
        self.figures: dict[str, float] = {}

    def backward(self, model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
                 clock: StepClock, health: GroupHealth | None) -> tuple[float, int]:  # fmt: skip
        figures: dict[str, float] = {}
        result = backward(model, micro_batches, device, self.objective, clock, health, self.cache, figures)
        self.figures = figures
        return result
