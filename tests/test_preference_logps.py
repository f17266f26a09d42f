"""Each answer token's log-probability from the hidden states equals log_softmax of the whole logits, and so do its
gradients with a factor per token (what a preference loss needs): with and without LoRA on the head."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO, small_job

from train.config import JobConfig
from train.data.blocks import IGNORE
from train.model.load import load_model
from train.preference.logps import token_logps

CPU = torch.device("cpu")
HEADLESS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(targets: list[str]) -> torch.nn.Module:
    job = JobConfig.model_validate(small_job(lora={"dropout": 0.0, "target_modules": targets}))
    model, _, _ = load_model(job, REPO, CPU)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B is zero at first: give the adapter a part in the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 400, (3, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 9:] = 0
    labels = torch.full_like(ids, IGNORE)
    labels[0, 6:] = ids[0, 6:]
    labels[1, 4:15] = ids[1, 4:15]
    labels[2, 3:9] = ids[2, 3:9]
    return {"input_ids": ids, "attention_mask": mask}, labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    found = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


@pytest.mark.parametrize("targets", [HEADLESS, [*HEADLESS, "lm_head"]], ids=["head-frozen", "head-lora"])
def test_token_logps_and_their_gradients_equal_the_whole_logits(targets: list[str]) -> None:
    model = _model(targets)
    batch, labels = _batch()
    weights = torch.linspace(-1.0, 2.0, int((labels[:, 1:] != IGNORE).sum()))  # a different factor per token

    logits = model(**batch).logits[:, :-1].float()
    keep = labels[:, 1:] != IGNORE
    whole = logits.log_softmax(dim=-1)[keep].gather(1, labels[:, 1:][keep][:, None]).squeeze(1)
    (whole * weights).sum().backward()
    expected = _grads(model)

    mine = token_logps(model, batch, labels)
    (mine * weights).sum().backward()
    got = _grads(model)

    assert (mine.detach() - whole.detach()).abs().max() <= 1e-5
    assert got.keys() == expected.keys() and got
    worst = max(float((got[n] - expected[n]).abs().max() / expected[n].abs().max().clamp(min=1e-12)) for n in got)
    assert worst <= 1e-5, worst
