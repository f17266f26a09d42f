"""Templates, label masking and packing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import REPO

from train.config import ConfigError, DataConfig, ModelConfig
from train.data.blocks import IGNORE, build_blocks, model_inputs, pack, prepare, tokenize
from train.data.records import Record, load_records, read_checked
from train.model.load import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)


def test_completion_only_labels_cover_exactly_the_answer(tokenizer: object) -> None:
    cfg = DataConfig(source="x.jsonl", format="instruction", train_on="completion")
    record = {"instruction": "Why does rank 1 hang?", "output": "Its firewall drops 29500."}
    ((ids, labels),) = tokenize([Record("t.jsonl:1", record)], cfg, tokenizer)
    trained = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    text = tokenizer.decode(trained)  # type: ignore[attr-defined]
    assert text.startswith("Its firewall drops 29500.")
    assert "Instruction" not in text and "rank 1" not in text


def test_train_on_all_labels_every_token(tokenizer: object) -> None:
    cfg = DataConfig(source="x.jsonl", train_on="all")
    ((ids, labels),) = tokenize([Record("t.jsonl:1", {"instruction": "a", "output": "b"})], cfg, tokenizer)
    assert labels[1:] == ids[1:]


def test_chat_format_trains_on_assistant_turns(tokenizer: object) -> None:
    cfg = DataConfig(source="x.jsonl", format="chat")
    record = {"messages": [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]}
    ((ids, labels),) = tokenize([Record("t.jsonl:1", record)], cfg, tokenizer)
    trained = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])  # type: ignore[attr-defined]
    assert "pong" in trained and "ping" not in trained


def test_sharegpt_and_openai_conversations_train_alike(tokenizer: object) -> None:
    """ShareGPT's shape (conversations of from/value, human/gpt) is the same conversation as OpenAI's messages (a
    name or a system turn included): the same tokens, the same trained tokens."""
    cfg = DataConfig(source="x.jsonl", format="chat")
    openai = {"messages": [{"role": "system", "content": "You run a GPU cluster."},
                           {"role": "user", "name": "ada", "content": "Which port?"},
                           {"role": "assistant", "content": "29500."}]}  # fmt: skip
    sharegpt = {"conversations": [{"from": "system", "value": "You run a GPU cluster."},
                                  {"from": "human", "value": "Which port?"},
                                  {"from": "gpt", "value": "29500."}]}  # fmt: skip
    (a,) = tokenize([Record("t.jsonl:1", openai)], cfg, tokenizer)
    (b,) = tokenize([Record("s.jsonl:1", sharegpt)], cfg, tokenizer)
    assert a == b
    trained = tokenizer.decode([t for t, lab in zip(*b, strict=True) if lab != IGNORE])  # type: ignore[attr-defined]
    assert "29500." in trained and "Which port" not in trained


def test_record_that_does_not_fit_the_format_is_named(tokenizer: object) -> None:
    cfg = DataConfig(source="x.jsonl", format="instruction")
    records = [Record("t.jsonl:1", {"instruction": "a", "output": "b"}), Record("t.jsonl:2", {"prompt": "a"})]
    with pytest.raises(ConfigError, match=r"t.jsonl:2: missing or empty 'instruction'; data.format 'instruction'"):
        tokenize(records, cfg, tokenizer)


def test_packing_puts_whole_examples_in_rows_each_with_its_own_positions() -> None:
    examples = [([1, 5, 6, 7, 2], [-100, 5, 6, 7, 2]), ([1, 7, 2], [-100, 7, 2]), ([1, 8, 9, 9, 2], [-100, 8, 9, 9, 2])]
    blocks = build_blocks(examples, DataConfig(source="x", seq_len=8, packing=True), pad_id=0)
    # Best fit, the longest first: the 3-token example fills the first row's room; nothing is dropped.
    assert blocks.input_ids.tolist() == [[1, 5, 6, 7, 2, 1, 7, 2], [1, 8, 9, 9, 2, 0, 0, 0]]
    assert blocks.labels.tolist() == [[-100, 5, 6, 7, 2, -100, 7, 2], [-100, 8, 9, 9, 2, -100, -100, -100]]
    assert blocks.attention_mask.tolist() == [[1] * 8, [1] * 5 + [0] * 3]
    assert blocks.position_ids is not None
    assert blocks.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]
    # The model gets the positions, not a mask: where they start again, an example begins (train/data/blocks.py).
    inputs = model_inputs(blocks.batch([0, 1], torch.device("cpu")))
    assert set(inputs) == {"input_ids", "position_ids", "use_cache"} and inputs["use_cache"] is False


def test_pack_is_best_fit_and_keeps_every_example() -> None:
    lengths = [7, 1, 4, 4, 3, 8, 2, 5, 0]
    rows = pack(lengths, 8)
    assert sorted(i for row in rows for i in row) == [i for i, n in enumerate(lengths) if n]
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert len(rows) == 5  # 34 tokens: the fewest rows of 8 that hold them


def test_no_packing_pads_and_masks() -> None:
    long = list(range(10, 22))
    examples = [([1, 5, 2], [-100, 5, 2]), (long, long)]
    blocks = build_blocks(examples, DataConfig(source="x", seq_len=8, packing=False), pad_id=0)
    assert blocks.input_ids.tolist() == [[1, 5, 2, 0, 0, 0, 0, 0], long[:8]]
    assert blocks.labels.tolist()[0] == [-100, 5, 2, -100, -100, -100, -100, -100]
    assert blocks.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]


def test_sample_data_loads_through_datasets(tokenizer: object) -> None:
    cfg = DataConfig(source="data/sample/train.jsonl", seq_len=128)
    assert len(load_records(cfg.source, REPO)) >= 300
    blocks = prepare(cfg, tokenizer, REPO)
    assert blocks.input_ids.shape[1] == 128 and len(blocks) > 50
    assert blocks.input_ids.dtype == torch.long


def test_missing_data_file_is_a_config_error(tmp_path: Path, tokenizer: object) -> None:
    with pytest.raises(ConfigError, match=r"data\.source"):
        load_records(str(tmp_path / "absent.jsonl"), REPO)


@pytest.mark.parametrize(
    ("lines", "fmt", "message"),
    [
        (
            '{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n',
            "instruction",
            r"bad.jsonl:2: missing or empty 'output'",
        ),
        (
            '{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n',
            "instruction",
            r"bad.jsonl:3: not valid JSON",
        ),
        ('["a", "b"]\n', "instruction", r"bad.jsonl:1: a record must be a JSON object"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "chat", r"bad.jsonl:1: no 'assistant' message"),
        (
            '{"conversations": [{"from": "human", "value": "hi"}, {"from": "tool", "value": "42"}]}\n',
            "chat",
            r"bad.jsonl:1: message 2 has the from 'tool', which names no chat role \(user, assistant, system; ShareGPT",
        ),
        ('{"conversations": [{"from": "human", "text": "hi"}]}\n', "chat", r"string 'from' and 'value'"),
        ('{"dialog": []}\n', "chat", r"bad.jsonl:1: missing 'messages' \(or ShareGPT's 'conversations'\)"),
        ('{"text": 3}\n', "text", r"bad.jsonl:1: missing or empty 'text'"),
        ("", "instruction", r"holds no records \(an empty file\?\)"),
    ],
)
def test_a_bad_record_is_named_by_file_and_line(tmp_path: Path, lines: str, fmt: str, message: str) -> None:
    (tmp_path / "bad.jsonl").write_text(lines)
    cfg = DataConfig(source=str(tmp_path / "bad.jsonl"), format=fmt)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        read_checked(cfg.source, cfg, REPO)


def test_chat_template_labels_only_the_answer_and_its_end_token() -> None:
    from transformers import AutoTokenizer

    from ugro.model.basemodel import ensure

    ensure(REPO / "models" / "smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(REPO / "models" / "smollm2-135m-instruct"))
    cfg = DataConfig(source="x.jsonl")
    ((ids, labels),) = tokenize([Record("t:1", {"instruction": "Which port?", "output": "29500."})], cfg, tok)
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])
    assert trained.startswith("29500.<|im_end|>")
    assert tok.decode(ids).startswith("<|im_start|>system") and "Which port?" not in trained
