"""The loss from hidden states (train/model/headloss.py) equals the loss from the full logits, gradients included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from train.balance.step import logits_loss, summed_loss
from train.data.blocks import IGNORE
from train.model import headchunks, headloss

VOCAB = 300


def _model(tied: bool = False, lora_head: bool = True, **config: Any) -> Any:
    """A tiny random Llama with LoRA (dropout 0) on q_proj and, unless tied, the head; every LoRA B nonzero."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, **config)  # fmt: skip
    targets = ["q_proj", "lm_head"] if lora_head else ["q_proj"]
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    model = get_peft_model(LlamaForCausalLM(cfg), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # peft starts B at 0, which would hide a wrong gradient of A
    return model


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=gen)
    labels = ids.clone()
    labels[:, :6] = IGNORE  # a prompt
    labels[1, 15:] = IGNORE  # padding
    mask = (labels != IGNORE).long()
    mask[:, :6] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: Any, new: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    batch = _batch()
    if new:
        loss = summed_loss(model, batch)
    else:
        loss = logits_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                           batch["labels"])  # fmt: skip
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


SEVEN = 4 * VOCAB * 7  # CHUNK_BYTES for chunks of 7 label tokens


@pytest.mark.parametrize(("tied", "chunk_bytes"), [(False, headchunks.CHUNK_BYTES), (False, SEVEN), (True, SEVEN)])
def test_equal_to_the_logits_path(tied: bool, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loss and gradients, in one chunk or in chunks of 7 label tokens; LoRA on the head, or a head tied to the
    embedding."""
    monkeypatch.setattr(headchunks, "CHUNK_BYTES", chunk_bytes)
    model = _model(tied=tied, lora_head=not tied)
    assert headloss.head(model) is model.get_base_model().lm_head
    old_loss, old_grads = _loss_and_grads(model, new=False)
    new_loss, new_grads = _loss_and_grads(model, new=True)
    assert new_loss.dtype == torch.float32
    torch.testing.assert_close(new_loss, old_loss, rtol=1e-5, atol=0)
    assert new_grads.keys() == old_grads.keys()
    assert any("lm_head.lora_B" in n for n in new_grads) != tied
    for name, grad in old_grads.items():  # relative to the gradient's largest entry, as bench/headloss.py reports it
        assert float((new_grads[name] - grad).abs().max() / grad.abs().max()) <= 1e-5, name


def test_without_the_adapter_and_without_gradients() -> None:
    """The held-out loss: no gradient, and the base model's (adapter switched off)."""
    model = _model()
    batch = _batch()
    with torch.no_grad():
        for disabled in (False, True):
            with model.disable_adapter() if disabled else torch.autograd.grad_mode.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                new = summed_loss(model, batch)
                torch.testing.assert_close(new, logits_loss(logits, batch["labels"]), rtol=1e-5, atol=0)


def test_soft_capped_logits_fall_back_to_the_logits(caplog: pytest.LogCaptureFixture) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = Gemma2Config(vocab_size=VOCAB, num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0, **shape)
    model = get_peft_model(Gemma2ForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj"]))
    with caplog.at_level("INFO", logger="train.model.headloss"):
        assert headloss.head(model) is None
    assert "final_logit_softcapping=30.0" in caplog.text
    batch = _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(summed_loss(model, batch), logits_loss(logits, batch["labels"]))
