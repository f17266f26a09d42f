"""Held-out pairs, before and after: how often the model prefers the chosen answer, by how much, and the method's
figures against the reference (the base).

Every rank evaluates every W-th held-out item; one all-reduce sums the figures (kto's KL estimate takes one more,
before its loss terms, as in a step), so they are the same whatever the number of ranks. The base model's figures
are its own log-probabilities with the adapter off: its rewards are 0 by definition (it is the reference), its
preference accuracy and margin are not.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from train.data.evaluate import HeldOut
from train.dist import comm
from train.dist.distributed import RankInfo
from train.dist.health import GroupHealth
from train.preference import objective as losses
from train.preference import step
from train.preference.objective import Objective, Terms
from train.preference.reference import adapter_off
from train.preference.step import Answers, answers

_SUMS = ("margin", "preferred", "loss", "chosen_rewards", "rejected_rewards", "correct", "pairs", "chosen",
         "rejected", "chosen_logps", "rejected_logps", "nll", "nll_tokens")  # fmt: skip


def _reduced(values: torch.Tensor, info: RankInfo, health: GroupHealth | None) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized() and info.world_size > 1):
        return values
    carried = values.to(comm.carrier())
    work = comm.all_reduce(carried, async_op=True)
    read = carried.cpu
    return health.result(work, read) if health is not None else comm.result(work, read)


@torch.no_grad()
def figures(model: torch.nn.Module, held_out: HeldOut, info: RankInfo, batch_size: int, objective: Objective,
            adapter: bool, health: GroupHealth | None = None) -> dict[str, float | None]:  # fmt: skip
    """The held-out figures of the model with its adapter on (``adapter``) or off (the base model)."""
    was_training = model.training
    model.eval()
    blocks = held_out.blocks
    mine = list(range(info.rank, len(blocks), info.world_size))
    passes = []
    kl = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(mine), batch_size):
        batch = blocks.batch(mine[start : start + batch_size], info.device)
        b = len(batch["items"])
        with nullcontext() if adapter else adapter_off(model):
            own = answers(model, batch, objective, chosen_rows=b if objective.method == "orpo" else 0)
        if objective.needs_reference and adapter:
            with adapter_off(model):
                reference = answers(model, batch, objective).logps
        else:
            reference = own.logps  # the base model is its own reference
        if objective.uses_kl:
            kl += torch.tensor([float((own.logps[b:] - reference[b:]).sum()), b], dtype=torch.float64)
        passes.append((batch, own, reference))
    kl = _reduced(kl, info, health)
    kl_value = max(float(kl[0]) / float(kl[1]), 0.0) if objective.uses_kl and kl[1] else 0.0
    sums = torch.zeros(len(_SUMS), dtype=torch.float64)
    for batch, own, reference in passes:
        sums += _summed(batch, own, reference, objective, kl_value)
    got = dict(zip(_SUMS, _reduced(sums, info, health).tolist(), strict=True))
    model.train(was_training)
    return _figures(got, objective, adapter)


def _summed(batch: dict[str, torch.Tensor], own: Answers, reference: torch.Tensor, objective: Objective,
            kl: float) -> torch.Tensor:  # fmt: skip
    b = len(batch["items"])
    logps, tokens, nll = own.logps, own.tokens, own.nll
    found: Terms
    if objective.method == "kto":
        found = losses.kto(objective, logps[:b], reference[:b], batch["desirable"], kl)
        margin, preferred, pairs = 0.0, 0.0, 0
    else:
        chosen, rejected = logps[:b], logps[b:]
        if objective.method == "orpo":
            found = losses.orpo(objective, chosen, rejected, tokens[:b], tokens[b:])
        else:
            found = losses.dpo(objective, chosen, rejected, reference[:b], reference[b:], tokens[:b], tokens[b:])
        margin, preferred, pairs = float((chosen - rejected).sum()), float((chosen > rejected).sum()), b
    nll_tokens = step.nll_tokens(batch, objective)  # orpo's chosen NLL tokens, counted as a step counts them
    return torch.tensor([margin, preferred, float(found.losses.sum()), float(found.chosen_rewards.sum()),
                         float(found.rejected_rewards.sum()), float(found.correct), pairs, found.chosen_rewards.numel(),
                         found.rejected_rewards.numel(), float(found.chosen_logps.sum()),
                         float(found.rejected_logps.sum()), float(nll) if nll is not None else 0.0, nll_tokens],
                        dtype=torch.float64)  # fmt: skip


def _figures(got: dict[str, float], objective: Objective, adapter: bool) -> dict[str, float | None]:
    """The figures from the sums; the base model has no reward accuracy (it is its own reference: every reward 0)."""
    items = got["pairs"] if objective.paired else got["chosen"] + got["rejected"]
    chosen, rejected = max(got["chosen"], 1), max(got["rejected"], 1)
    loss = got["loss"] / max(items, 1) + (got["nll"] / max(got["nll_tokens"], 1) if objective.method == "orpo" else 0)
    out: dict[str, float | None] = {
        "loss": loss,
        "items": items,
        "rewards_chosen": got["chosen_rewards"] / chosen,
        "rewards_rejected": got["rejected_rewards"] / rejected,
        "rewards_margin": got["chosen_rewards"] / chosen - got["rejected_rewards"] / rejected,
        "rewards_accuracy": got["correct"] / max(got["pairs"], 1) if objective.paired and adapter else None,
    }
    if objective.paired:  # the model's own preference: the chosen answer more likely than the rejected one
        out["preference_accuracy"] = got["preferred"] / max(got["pairs"], 1)
        out["logp_margin"] = got["margin"] / max(got["pairs"], 1)
    else:  # examples: desirable answers more likely than undesirable ones, on average
        out["preference_accuracy"] = None
        out["logp_margin"] = got["chosen_logps"] / chosen - got["rejected_logps"] / rejected
    return out
