"""Packing keeps examples apart: examples packed whole into one row each see only themselves, so an example's loss
is the same packed with others as alone (train/data/blocks.py ``build_blocks``, ``model_inputs``)."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO
from transformers import AutoConfig, AutoModelForCausalLM

from train.balance.step import summed_loss
from train.config import DataConfig
from train.data.blocks import IGNORE, Example, build_blocks, model_inputs

SEQ = 24


def _examples() -> list[Example]:
    torch.manual_seed(3)
    found = []
    for length in (9, 6, 7):  # 22 tokens: one row of 24 packed, three rows alone
        ids = torch.randint(5, 2000, (length,)).tolist()
        found.append((ids, [IGNORE, IGNORE, *ids[2:]]))  # a prompt of two tokens, then the answer
    return found


def _only(blocks: object, row: int, keep: range) -> dict[str, torch.Tensor]:
    """Row ``row`` of ``blocks`` as a batch whose labels keep only the positions ``keep``."""
    batch = blocks.batch([row], torch.device("cpu"))  # type: ignore[attr-defined]
    labels = torch.full_like(batch["labels"], IGNORE)
    labels[0, keep.start : keep.stop] = batch["labels"][0, keep.start : keep.stop]
    return batch | {"labels": labels}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_examples_loss_is_the_same_packed_with_others_as_alone(attention: str) -> None:
    config = AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    examples = _examples()
    packed = build_blocks(examples, DataConfig(source="x", seq_len=SEQ, packing=True), pad_id=0)
    alone = build_blocks(examples, DataConfig(source="x", seq_len=SEQ, packing=False), pad_id=0)
    assert len(packed) == 1 and len(alone) == 3
    assert packed.position_ids is not None
    starts = [i for i, p in enumerate(packed.position_ids[0].tolist()) if p == 0]
    # Best fit, the longest first: 9, 7, 6 tokens, then the padding as a sequence of its own.
    order = sorted(range(3), key=lambda i: -len(examples[i][0]))
    with torch.no_grad():
        for place, index in enumerate(order):
            at, size = starts[place], len(examples[index][0])
            assert packed.input_ids[0, at : at + size].tolist() == examples[index][0]
            together = summed_loss(model, _only(packed, 0, range(at, at + size)))
            apart = summed_loss(model, _only(alone, index, range(size)))
            torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
        # Without the positions (one causal mask over the row), the later examples would see the earlier ones.
        at, size = starts[1], len(examples[order[1]][0])
        mixed = _only(packed, 0, range(at, at + size))
        del mixed["position_ids"]
        assert (
            abs(float(summed_loss(model, mixed)) - float(summed_loss(model, _only(alone, order[1], range(size)))))
            > 1e-3
        )


def test_packed_rows_joined_into_one_with_their_lengths_give_the_same_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """unsloth keeps packed examples apart only by ``packed_seq_lengths`` over one joined row (train/data/blocks.py
    ``model_inputs(by_lengths=True)``): the lengths are each example's and each row's padding, and the loss read
    from the joined row is the loss of the rows (here with transformers, which keeps them apart by positions)."""
    import train.balance.step

    config = AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    torch.manual_seed(4)
    examples = [(ids, [IGNORE, *ids[1:]]) for ids in (torch.randint(5, 2000, (n,)).tolist() for n in (15, 11, 9, 8))]
    blocks = build_blocks(examples, DataConfig(source="x", seq_len=SEQ, packing=True), pad_id=0)
    assert len(blocks) == 2  # best fit: 15 + 9, and 11 + 8 + 5 of padding
    batch = blocks.batch([0, 1], torch.device("cpu"))
    joined = model_inputs(batch, by_lengths=True)
    assert joined["input_ids"].shape == (1, 2 * SEQ)
    assert joined["packed_seq_lengths"].tolist() == [15, 9, 11, 8, 5]  # the padding: a sequence of its own
    with torch.no_grad():
        rows = summed_loss(model, batch)
        monkeypatch.setattr(train.balance.step, "packs_by_lengths", lambda _model: True)
        one_row = summed_loss(model, batch)
    torch.testing.assert_close(one_row, rows, rtol=1e-5, atol=1e-5)
