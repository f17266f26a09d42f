"""ugro's preference losses equal TRL 1.13's trainers': the loss and every LoRA gradient, to 1e-5 in fp32.

On one model (the project's loader, models/tiny-llama at random, every LoRA B weight seeded random so that the tuned
model differs from the reference), one batch of four items with unequal prompt and answer lengths, and the same
adapter weights, ugro's step (train/preference/step.py ``backward``, one process) and TRL's own trainer
(``DPOTrainer.compute_loss``, ``KTOTrainer.compute_loss``, ``ORPOTrainer.get_batch_loss_metrics``) give the same loss
and the same LoRA gradients, with the head's LoRA on and off.

TRL's reference: with a PeftModel and ``ref_model=None``, TRL 1.13's DPO and KTO trainers add a frozen copy of the
adapter ("ref") and take that as the reference, not the adapter off. ugro's ``preference.reference: live`` is the base
model, the adapter off, which TRL gets with ``ref_model`` the base model itself (its LoRA layers removed): that is what
these tests hand it, and ``test_trl_reference_is_the_adapter_off`` checks it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import trl
from helpers import REPO
from preference_helpers import (
    Example,
    Pair,
    example_batch,
    kl_completion,
    lora_grads,
    pair_batch,
    preference_job,
    random_examples,
    random_pairs,
    randomize_lora_b,
    zero_grads,
)

from train.config import JobConfig
from train.model.load import load_model

CPU = torch.device("cpu")
WIDTH = 32  # ugro's rows are padded to data.seq_len; TRL's collators pad to the longest row
TOLERANCE = 1e-5

# Four items of unequal prompt and answer lengths.
PAIRS = random_pairs(11, [(3, 5, 2), (6, 2, 7), (2, 9, 4), (5, 4, 4)])
# Three desirable examples, one undesirable.
EXAMPLES = random_examples(12, [(3, 5), (6, 2), (2, 9), (5, 4)], [True, False, True, True])

ALL_BUT_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HEADS = {"head-lora": [*ALL_BUT_HEAD, "lm_head"], "no-head-lora": ALL_BUT_HEAD}
# Each model's LoRA B weights (seed, scale), chosen so that the batch covers both sides of every kink: with the
# head's LoRA a pair beyond dpo hinge's margin at beta 0.5 and a KL estimate below 0 (TRL clamps it to 0); without,
# a KL estimate above 0 (test_kto_equals_trl checks both).
LORA_B = {"head-lora": (6, 0.2), "no-head-lora": (5, 0.2)}
KL_ABOVE_ZERO = {"head-lora": False, "no-head-lora": True}


@pytest.fixture(scope="module")
def models() -> Iterator[Callable[[str], Any]]:
    """The LoRA model for a HEADS key, built once per module, its B weights random."""
    built: dict[str, Any] = {}

    def get(head: str) -> Any:
        if head not in built:
            torch.manual_seed(0)
            job = JobConfig.model_validate(preference_job("dpo", lora={"target_modules": HEADS[head]}))
            model, tokenizer, _ = load_model(job, REPO, CPU)
            seed, scale = LORA_B[head]
            randomize_lora_b(model, seed=seed, scale=scale)
            built[head] = (model, tokenizer)
        return built[head]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield get
    torch.set_num_threads(threads)


def _base(model: Any) -> Any:
    """The base model alone, as TRL's reference: a copy with the LoRA layers removed."""
    base = copy.deepcopy(model).unload()
    base.requires_grad_(False)
    return base


def _common(tmp_path: Path) -> dict[str, Any]:
    return {"output_dir": str(tmp_path / "trl"), "report_to": "none", "use_cpu": True, "bf16": False,
            "disable_dropout": True}  # fmt: skip


def _ugro(model: Any, batch: dict[str, torch.Tensor], job: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    from train.preference.objective import Objective
    from train.preference.step import backward

    objective = Objective.from_job(JobConfig.model_validate(job))
    zero_grads(model)
    loss, _ = backward(model, [batch], CPU, objective)
    return float(loss), lora_grads(model)


def _trl(model: Any, loss_of: Callable[[], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    zero_grads(model)
    loss = loss_of()
    loss.backward()
    return float(loss.detach()), lora_grads(model)


def _check_trl_side(model: Any, loss: float, grads: dict[str, torch.Tensor]) -> None:
    """TRL's own step is a real one on this batch: a finite loss, every LoRA parameter of the fp32 model moved."""
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert torch.isfinite(torch.tensor(loss)), loss
    still = [name for name, g in grads.items() if not bool(g.abs().max() > 0)]
    assert not still, f"TRL's step left these LoRA parameters without a gradient: {still[:5]}"


def _compare(case: str, ugro: tuple[float, dict[str, torch.Tensor]], theirs: tuple[float, dict[str, torch.Tensor]]
             ) -> None:  # fmt: skip
    """Assert ugro's loss and LoRA gradients equal TRL's (the measured differences printed, and in any failure)."""
    (loss_u, grads_u), (loss_t, grads_t) = ugro, theirs
    assert grads_u.keys() == grads_t.keys()
    scale = max(g.abs().max().item() for g in grads_t.values())
    worst, worst_name = 0.0, ""
    for name, g in grads_t.items():
        diff = (grads_u[name] - g).abs().max().item()
        if diff >= worst:
            worst, worst_name = diff, name
    loss_diff = abs(loss_u - loss_t)
    print(f"{case}: loss ugro {loss_u:.8f} TRL {loss_t:.8f} |diff| {loss_diff:.2e}; "
          f"max|g diff| {worst:.2e} at {worst_name} (max|g_trl| {scale:.2e})")  # fmt: skip
    assert loss_diff <= TOLERANCE, f"{case}: |loss_ugro - loss_trl| = {loss_diff:.3e} ({loss_u} vs {loss_t})"
    assert worst <= TOLERANCE * max(1.0, scale), (
        f"{case}: max|g_ugro - g_trl| = {worst:.3e} at {worst_name} (max|g_trl| = {scale:.3e}; loss diff "
        f"{loss_diff:.3e})"
    )


# --------------------------------------------------------------------------------------------------
# DPO


def _dpo_trainer(model: Any, tokenizer: Any, tmp_path: Path, **config: Any) -> Any:
    train = datasets.Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d e"}] * 2)
    args = trl.DPOConfig(**_common(tmp_path), **config)
    return trl.DPOTrainer(model=model, ref_model=_base(model), args=args, train_dataset=train,
                          processing_class=tokenizer)  # fmt: skip


def _dpo_inputs(trainer: Any, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """TRL's batch of the pairs, from its own collator: chosen rows, then rejected rows."""
    examples = [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs]
    inputs: dict[str, torch.Tensor] = trainer.data_collator(examples)
    return inputs


def _answer_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed log-probability of its answer (labels), from the whole logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    token = logits.log_softmax(-1).gather(2, labels.clamp(min=0)[..., None]).squeeze(2)
    return (token * keep).sum(1)


def _margins(model: Any, pairs: list[Pair], beta: float) -> torch.Tensor:
    """beta x (chosen log-ratio - rejected log-ratio) of each pair: what the hinge compares with 1."""
    batch = pair_batch(pairs, range(len(pairs)))
    with torch.no_grad():
        tuned = _answer_logps(model, batch)
        with model.disable_adapter():
            ref = _answer_logps(model, batch)
    ratio = tuned - ref
    chosen, rejected = ratio.chunk(2)
    return beta * (chosen - rejected)


DPO_CASES = [
    pytest.param("sigmoid", beta, 0.0, id=f"sigmoid-beta{beta}") for beta in (0.1, 0.5)
] + [
    pytest.param("hinge", beta, 0.0, id=f"hinge-beta{beta}") for beta in (0.1, 0.5)
] + [
    pytest.param("ipo", beta, 0.0, id=f"ipo-beta{beta}") for beta in (0.1, 0.5)
] + [
    pytest.param("robust", beta, 0.1, id=f"robust-beta{beta}-smoothing0.1") for beta in (0.1, 0.5)
]  # fmt: skip


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize(("loss_type", "beta", "smoothing"), DPO_CASES)
def test_dpo_equals_trl(models: Callable[[str], Any], tmp_path: Path, head: str, loss_type: str, beta: float,
                        smoothing: float) -> None:  # fmt: skip
    model, tokenizer = models(head)
    trainer = _dpo_trainer(model, tokenizer, tmp_path, beta=beta, loss_type=[loss_type], label_smoothing=smoothing)
    assert trainer.ref_model is not None and trainer.model is model  # the model TRL trains is ugro's
    inputs = _dpo_inputs(trainer, PAIRS)
    theirs = _trl(trainer.model, lambda: trainer.compute_loss(trainer.model, inputs))
    _check_trl_side(trainer.model, *theirs)
    if loss_type == "hinge" and beta == 0.5 and head == "head-lora":  # both sides of the hinge: a pair beyond 1
        margins = _margins(trainer.model, PAIRS, beta)
        assert bool((margins < 1).any() and (margins > 1).any()), margins
    batch = pair_batch(PAIRS, range(len(PAIRS)), WIDTH)
    job = preference_job("dpo", loss=loss_type, beta=beta, label_smoothing=smoothing)
    _compare(f"dpo {loss_type} beta {beta} {head}", _ugro(trainer.model, batch, job), theirs)


# --------------------------------------------------------------------------------------------------
# KTO


def _kto_trainer(model: Any, tokenizer: Any, tmp_path: Path, examples: list[Example], **config: Any) -> Any:
    rows = [{"prompt": f"p{i}", "completion": f" c{i}", "label": e.desirable} for i, e in enumerate(examples)]
    args = trl.KTOConfig(**_common(tmp_path), per_device_train_batch_size=len(examples), **config)
    train = datasets.Dataset.from_list(rows)
    return trl.KTOTrainer(model=model, ref_model=_base(model), args=args, train_dataset=train,
                          processing_class=tokenizer)  # fmt: skip


def _kto_inputs(trainer: Any, examples: list[Example]) -> dict[str, torch.Tensor]:
    """TRL's batch of the examples, from its own collator; the KL rows (kto) by TRL's rotation."""
    rows = []
    for i, e in enumerate(examples):
        row: dict[str, Any] = {"prompt_ids": e.prompt, "completion_ids": e.completion, "label": e.desirable}
        if trainer.calculate_KL:
            row["KL_completion_ids"] = kl_completion(examples, i)
        rows.append(row)
    inputs: dict[str, torch.Tensor] = trainer.data_collator(rows)
    return inputs


def _raw_kl(model: Any, examples: list[Example]) -> float:
    """The batch's KL estimate before TRL's clamp: the KL rows' mean log-ratio, tuned model over reference."""
    kl_rows = example_batch(examples, range(len(examples)))
    kl_rows = {k: v[len(examples) :] for k, v in kl_rows.items() if k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        tuned = _answer_logps(model, kl_rows)
        with model.disable_adapter():
            ref = _answer_logps(model, kl_rows)
    return float((tuned - ref).mean())


KTO_CASES = [
    pytest.param("kto", 0.1, 1.0, 1.33, id="kto-beta0.1-weights1.0/1.33"),
    pytest.param("kto", 0.5, 1.33, 1.0, id="kto-beta0.5-weights1.33/1.0"),
    pytest.param("apo_zero_unpaired", 0.1, 1.0, 1.33, id="apo_zero_unpaired-beta0.1-weights1.0/1.33"),
    pytest.param("apo_zero_unpaired", 0.5, 1.33, 1.0, id="apo_zero_unpaired-beta0.5-weights1.33/1.0"),
]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize(("loss_type", "beta", "desirable", "undesirable"), KTO_CASES)
def test_kto_equals_trl(models: Callable[[str], Any], tmp_path: Path, head: str, loss_type: str, beta: float,
                        desirable: float, undesirable: float) -> None:  # fmt: skip
    model, tokenizer = models(head)
    trainer = _kto_trainer(model, tokenizer, tmp_path, EXAMPLES, beta=beta, loss_type=loss_type,
                           desirable_weight=desirable, undesirable_weight=undesirable)  # fmt: skip
    assert trainer.ref_model is not None and trainer.model is model
    assert trainer.calculate_KL == (loss_type == "kto")
    inputs = _kto_inputs(trainer, EXAMPLES)
    theirs = _trl(trainer.model, lambda: trainer.compute_loss(trainer.model, inputs))
    _check_trl_side(trainer.model, *theirs)
    if loss_type == "kto":  # the KL estimate: above 0 with one model, below (TRL's clamp to 0 in play) with the other
        raw, clamped = _raw_kl(trainer.model, EXAMPLES), trainer._metrics["train"]["kl"][-1]
        assert (raw > 0) == KL_ABOVE_ZERO[head], f"the batch's KL estimate {raw} is not what the case covers"
        assert clamped == pytest.approx(max(raw, 0.0), abs=1e-6)
    batch = example_batch(EXAMPLES, range(len(EXAMPLES)), WIDTH)
    job = preference_job("kto", data={"format": "unpaired"}, loss=loss_type, beta=beta, desirable_weight=desirable,
                         undesirable_weight=undesirable)  # fmt: skip
    _compare(f"kto {loss_type} beta {beta} weights {desirable}/{undesirable} {head}",
             _ugro(trainer.model, batch, job), theirs)  # fmt: skip


def test_trl_kl_rows_rotate_the_completions_by_one(models: Callable[[str], Any], tmp_path: Path) -> None:
    """The KL rows these tests build are TRL's: its prepared data set pairs prompt i with completion i - 1."""
    model, tokenizer = models("no-head-lora")
    trainer = _kto_trainer(model, tokenizer, tmp_path, EXAMPLES, loss_type="kto")
    completions, kl = trainer.train_dataset["completion_ids"], trainer.train_dataset["KL_completion_ids"]
    assert len(completions) == len(EXAMPLES)
    assert kl == [completions[(i - 1) % len(completions)] for i in range(len(completions))]


def test_trl_reference_is_the_adapter_off(models: Callable[[str], Any]) -> None:
    """The reference these tests hand TRL (the base, LoRA layers removed) gives the logits of the adapter off."""
    model, _ = models("head-lora")
    batch = pair_batch(PAIRS, range(len(PAIRS)))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        with model.disable_adapter():
            off = model(**inputs).logits
        on = model(**inputs).logits
        base = _base(model)(**inputs).logits
    assert torch.equal(base, off)
    assert (on - off).abs().max() > 1e-2  # the random B weights: the tuned model is not the reference


# --------------------------------------------------------------------------------------------------
# ORPO


def _orpo_trainer(model: Any, tokenizer: Any, tmp_path: Path, **config: Any) -> Any:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    train = datasets.Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d e"}] * 2)
    args = ORPOConfig(**_common(tmp_path), max_length=64, **config)
    return ORPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)


def _orpo_inputs(trainer: Any, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """TRL's batch of the pairs, from its own collator: each answer's row, its labels -100 on the prompt."""
    features = []
    for p in pairs:
        feature: dict[str, Any] = {}
        for side, answer in (("chosen", p.chosen), ("rejected", p.rejected)):
            feature[f"{side}_input_ids"] = p.prompt + answer
            feature[f"{side}_attention_mask"] = [1] * (len(p.prompt) + len(answer))
            feature[f"{side}_labels"] = [-100] * len(p.prompt) + answer
        features.append(feature)
    inputs: dict[str, torch.Tensor] = trainer.data_collator(features)
    return inputs


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_equals_trl(models: Callable[[str], Any], tmp_path: Path, head: str, beta: float) -> None:
    """ORPO with data.train_on: all, whose chosen NLL covers the prompt tokens too, as TRL's ORPOTrainer's does."""
    model, tokenizer = models(head)
    trainer = _orpo_trainer(model, tokenizer, tmp_path, beta=beta)
    assert trainer.model is model
    inputs = _orpo_inputs(trainer, PAIRS)
    theirs = _trl(trainer.model, lambda: trainer.get_batch_loss_metrics(trainer.model, inputs)[0])
    _check_trl_side(trainer.model, *theirs)
    batch = pair_batch(PAIRS, range(len(PAIRS)), WIDTH)
    job = preference_job("orpo", data={"train_on": "all"}, beta=beta)
    _compare(f"orpo beta {beta} {head}", _ugro(trainer.model, batch, job), theirs)
