"""The preference methods' losses on each item's answer log-probabilities, as TRL 1.13's trainers compute them.

An item is a pair (dpo, orpo: a chosen and a rejected answer to one prompt) or an example (kto: one answer,
desirable or not). Every loss here is a mean over the items of the global batch, of terms that each depend on one
item alone (kto's KL estimate, the one figure shared by all items, carries no gradient), plus for orpo the chosen
answers' NLL, a mean over their tokens. So a rank computes the terms of its own items and scales their sum by the
global counts, which one all-reduce gives every rank at the step's start (train/preference/step.py): the step is
the same whatever the shares. tests/test_preference_trl.py checks every loss against TRL's trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.config import JobConfig


@dataclass(frozen=True)
class Objective:
    """What a preference step optimizes: train.method and the preference section of the job."""

    method: str  # dpo | orpo | kto
    loss: str  # the method's variant (preference.loss)
    beta: float
    label_smoothing: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    nll_on_prompt: bool = False  # orpo with data.train_on: all (TRL's ORPOTrainer): the NLL covers the prompt too
    reference: str = "live"  # live | cached (train/preference/reference.py)

    @classmethod
    def from_job(cls, job: JobConfig) -> Objective:
        pref = job.preference
        return cls(job.train.method, job.preference_loss, pref.beta, pref.label_smoothing, pref.desirable_weight,
                   pref.undesirable_weight, job.data.train_on == "all", pref.reference)  # fmt: skip

    @property
    def paired(self) -> bool:
        """Both rows of an item are answers trained on (dpo, orpo); kto trains row 0, its row 1 the KL estimate's."""
        return self.method != "kto"

    @property
    def needs_reference(self) -> bool:
        return self.method in ("dpo", "kto")

    @property
    def uses_kl(self) -> bool:
        return self.method == "kto" and self.loss == "kto"


@dataclass
class Terms:
    """One micro-batch's items: the loss terms (with gradients), and the figures people look at (detached)."""

    losses: torch.Tensor  # [B]: each item's term of the mean (orpo: minus its odds-ratio term)
    chosen_rewards: torch.Tensor  # [n]: desirable examples' with kto
    rejected_rewards: torch.Tensor  # [m]
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    correct: torch.Tensor  # pairs whose chosen reward beats the rejected one (TRL's rewards/accuracies)


def dpo(obj: Objective, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor) -> Terms:  # fmt: skip
    """DPO (TRL's DPOTrainer, f-divergence reverse KL): sigmoid, hinge, ipo (length-normalized) or robust."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    beta, smoothing = obj.beta, obj.label_smoothing
    if obj.loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif obj.loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif obj.loss == "ipo":
        per_token = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    elif obj.loss == "robust":
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * smoothing)
    else:
        raise ValueError(f"unknown dpo loss {obj.loss!r}")
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    correct = (chosen_rewards > rejected_rewards).sum()
    return Terms(losses, chosen_rewards, rejected_rewards, chosen.detach(), rejected.detach(), correct)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(obj: Objective, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
         rejected_tokens: torch.Tensor) -> Terms:  # fmt: skip
    """ORPO's odds-ratio term on the answers' mean token log-probabilities (TRL's ORPOTrainer), negated: the loss is
    the chosen answers' NLL plus the mean of these."""
    mean_chosen = chosen.float() / chosen_tokens.clamp(min=1)
    mean_rejected = rejected.float() / rejected_tokens.clamp(min=1)
    log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
    losses = -obj.beta * F.logsigmoid(log_odds)
    chosen_rewards, rejected_rewards = obj.beta * mean_chosen.detach(), obj.beta * mean_rejected.detach()
    correct = (chosen_rewards > rejected_rewards).sum()
    return Terms(losses, chosen_rewards, rejected_rewards, mean_chosen.detach(), mean_rejected.detach(), correct)


def kto(obj: Objective, logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: float) -> Terms:
    """KTO (TRL's KTOTrainer): each example's term against the batch's KL estimate (0 for apo_zero_unpaired), by
    its weight."""
    ratio = logps - ref
    good, bad = desirable.bool(), ~desirable.bool()
    if obj.loss == "kto":
        good_losses = 1 - torch.sigmoid(obj.beta * (ratio[good] - kl))
        bad_losses = 1 - torch.sigmoid(obj.beta * (kl - ratio[bad]))
    elif obj.loss == "apo_zero_unpaired":
        good_losses = 1 - torch.sigmoid(obj.beta * ratio[good])
        bad_losses = torch.sigmoid(obj.beta * ratio[bad])
    else:
        raise ValueError(f"unknown kto loss {obj.loss!r}")
    losses = torch.zeros_like(ratio)
    losses = losses.index_put((good,), obj.desirable_weight * good_losses)
    losses = losses.index_put((bad,), obj.undesirable_weight * bad_losses)
    rewards = obj.beta * ratio.detach()
    return Terms(losses, rewards[good], rewards[bad], logps.detach()[good], logps.detach()[bad], ratio.new_zeros(()))
