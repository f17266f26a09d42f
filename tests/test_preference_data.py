"""Preference data (data.format preference and unpaired, train.method dpo, orpo, kto): every shape people bring
reads as the same pair, a bad row is one error naming its line and key, and the pairs become the two rows per item
the preference loss reads (train/data/pairs.py, train/data/pairblocks.py), as `make validate SHOW=` shows them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import REPO, cli, small_job

from train.config import ConfigError, DataConfig, JobConfig, ModelConfig
from train.data import pairs, templates
from train.data.blocks import IGNORE, prompt_text
from train.data.evaluate import question, reference
from train.data.pairblocks import PairBlocks, prepare_eval_pairs, prepare_pairs
from train.data.pairs import Preference, Unpaired
from train.data.records import Record, held_out_records, read_checked, training_data
from train.model.load import load_tokenizer
from ugro.checks import datafacts, jobcheck

SYSTEM, QUESTION, CHOSEN, REJECTED = "You run a GPU cluster.", "Which port?", "29500/tcp.", "Any port."
PAIR = (
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    [{"role": "assistant", "content": CHOSEN}],
    [{"role": "assistant", "content": REJECTED}],
)


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


SHAPES: dict[str, dict[str, Any]] = {
    "trl standard, axolotl's system": {"system": SYSTEM, "prompt": QUESTION, "chosen": CHOSEN, "rejected": REJECTED},
    "trl conversational": {"prompt": [_msg("system", SYSTEM), _msg("user", QUESTION)],
                           "chosen": [_msg("assistant", CHOSEN)], "rejected": [_msg("assistant", REJECTED)]},
    "trl implicit prompt": {
        "chosen": [_msg("system", SYSTEM), _msg("user", QUESTION), _msg("assistant", CHOSEN)],
        "rejected": [_msg("system", SYSTEM), _msg("user", QUESTION), _msg("assistant", REJECTED)],
    },
    "ultrafeedback: a prompt and whole conversations": {
        "system": SYSTEM, "prompt": QUESTION,
        "chosen": [_msg("user", QUESTION), _msg("assistant", CHOSEN)],
        "rejected": [_msg("user", QUESTION), _msg("assistant", REJECTED)],
    },
    "sharegpt / llama-factory": {
        "conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": QUESTION}],
        "chosen": {"from": "gpt", "value": CHOSEN}, "rejected": {"from": "gpt", "value": REJECTED},
    },
    "sharegpt with its system field and answer lists": {
        "system": SYSTEM, "conversations": [{"from": "human", "value": QUESTION}],
        "chosen": [{"from": "gpt", "value": CHOSEN}], "rejected": [{"from": "gpt", "value": REJECTED}],
    },
}  # fmt: skip


def _file(tmp_path: Path, rows: list[dict[str, Any]], name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _job(source: Path | str, method: str = "dpo", fmt: str = "preference", **data: Any) -> JobConfig:
    raw = small_job(data={"source": str(source), "format": fmt, "seq_len": 64, **data}, train={"method": method})
    return JobConfig.model_validate(raw)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_accepted_shape_reads_as_the_same_pair(tmp_path: Path, shape: str) -> None:
    path = _file(tmp_path, [SHAPES[shape]])
    (record,) = read_checked(str(path), DataConfig(source=str(path), format="preference"), REPO)
    assert pairs.preference(record) == Preference(f"{path}:1", *PAIR)


def test_a_pair_without_a_system_prompt_and_with_several_turns() -> None:
    record = Record(
        "p.jsonl:1",
        {
            "prompt": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c")],
            "chosen": "d",
            "rejected": [_msg("assistant", "e"), _msg("assistant", "f")],
        },
    )
    pair = pairs.preference(record)
    assert [t["role"] for t in pair.prompt] == ["user", "assistant", "user"]
    assert pair.chosen == [_msg("assistant", "d")] and len(pair.rejected) == 2
    # The implicit prompt is every turn both conversations begin with, earlier answers included.
    implicit = {
        "chosen": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), _msg("assistant", "d")],
        "rejected": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), _msg("assistant", "e")],
    }
    assert pairs.preference(Record("p.jsonl:2", implicit)).prompt == pair.prompt


def test_columns_and_speakers_are_mapped_as_for_chat(tmp_path: Path) -> None:
    flat = _file(tmp_path, [{"id": 7, "question": QUESTION, "better": CHOSEN, "worse": REJECTED, "sys": SYSTEM}])
    cfg = DataConfig(
        source=str(flat),
        format="preference",
        columns={"prompt": "question", "chosen": "better", "rejected": "worse", "system": "sys"},
    )
    (record,) = training_data(cfg, REPO, seed=0, check=True).records
    assert pairs.preference(record)[1:] == PAIR
    # 'system' is optional: a record without the mapped field has none.
    bare = _file(tmp_path, [{"question": QUESTION, "better": CHOSEN, "worse": REJECTED}], "bare.jsonl")
    (record,) = training_data(cfg.model_copy(update={"source": str(bare)}), REPO, seed=0, check=True).records
    assert pairs.preference(record).prompt == PAIR[0][1:]

    said = [{"speaker": "Operator", "text": SYSTEM}, {"speaker": "customer", "text": QUESTION}]
    dialog = {
        "dialog": said,
        "good": [{"speaker": "agent", "text": CHOSEN}],
        "bad": {"speaker": "Agent", "text": REJECTED},
    }
    path = _file(tmp_path, [dialog], "tickets.jsonl")
    cfg = DataConfig(
        source=str(path),
        format="preference",
        columns={"prompt": "dialog", "chosen": "good", "rejected": "bad", "role": "speaker", "content": "text"},
        roles={"customer": "user", "agent": "assistant", "operator": "system"},
    )
    (record,) = training_data(cfg, REPO, seed=0, check=True).records
    assert pairs.preference(record)[1:] == PAIR
    # ShareGPT's keys with speakers of their own: data.roles alone.
    sharegpt = {
        "conversations": [{"from": "customer", "value": QUESTION}],
        "chosen": {"from": "agent", "value": "x"},
        "rejected": {"from": "agent", "value": "y"},
    }
    path = _file(tmp_path, [sharegpt], "sharegpt.jsonl")
    cfg = DataConfig(source=str(path), format="preference", roles={"customer": "user", "agent": "assistant"})
    (record,) = training_data(cfg, REPO, seed=0, check=True).records
    assert pairs.preference(record).prompt == [_msg("user", QUESTION)]


GOOD = {"prompt": QUESTION, "chosen": CHOSEN, "rejected": REJECTED}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": QUESTION, "chosen": CHOSEN}, r"'rejected' is missing or empty; data.format 'preference' needs "
                                                 r"'prompt', 'chosen' and 'rejected'"),
        (GOOD | {"chosen": "  "}, r"'chosen' is missing or empty"),
        (GOOD | {"chosen": 3}, r"'chosen' must be a string or a list of messages, not int"),
        ({"chosen": CHOSEN, "rejected": REJECTED}, r"'prompt' is missing or empty; data.format 'preference'"),
        (GOOD | {"prompt": [_msg("user", "a"), _msg("assistant", "b")]},
         r"'prompt' ends with an assistant turn: a prompt ends with the user turn the answer replies to"),
        (GOOD | {"prompt": [{"role": "tool", "content": "42"}]},
         r"'prompt' message 1 has the role 'tool', which names no chat role \(user, assistant, system; ShareGPT"),
        (GOOD | {"rejected": ["just text"]},
         r"'rejected' message 1 is not an object with string 'role' and 'content' \(or ShareGPT's 'from' and "
         r"'value'\)"),
        (GOOD | {"chosen": [_msg("assistant", "a"), _msg("user", "b")]},
         r"'chosen' message 2 is a user turn: an answer holds assistant turns only"),
        ({"chosen": [_msg("user", "a"), _msg("assistant", "b")],
          "rejected": [_msg("user", "c"), _msg("assistant", "d")]},
         r"'prompt' is missing and 'chosen' and 'rejected' begin with different turns"),
        ({"chosen": [_msg("user", "a"), _msg("assistant", "b")],
          "rejected": [_msg("user", "a"), _msg("assistant", "b")]},
         r"'chosen' and 'rejected' are the same conversation"),
        ({"chosen": [_msg("user", "a"), _msg("assistant", "b"), _msg("assistant", "c")],
          "rejected": [_msg("user", "a"), _msg("assistant", "b"), _msg("assistant", "d")]},
         r"'chosen' and 'rejected' begin with the same 2 turns, the last an assistant turn: the prompt they share"),
        (GOOD | {"system": ["x"]}, r"'system' must be a string \(the system prompt\), not list"),
        (GOOD | {"system": "s", "prompt": [_msg("system", "t"), _msg("user", "q")]},
         r"'system' and the system turn that begins 'prompt' both give the system prompt"),
    ],
)  # fmt: skip
def test_a_bad_pair_is_one_error_naming_its_line_and_key(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = _file(tmp_path, [GOOD, row], "bad.jsonl")
    cfg = DataConfig(source=str(path), format="preference")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: " + message) as caught:
        read_checked(str(path), cfg, REPO)
    assert "\n" not in str(caught.value)  # one line, no traceback of ours
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: "):  # the ranks' and the controller's checks agree
        training_data(cfg, REPO, seed=0, check=True)


UNPAIRED = {"prompt": QUESTION, "completion": CHOSEN, "label": True}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": QUESTION, "completion": CHOSEN},
         r"'label' is missing: write true \(a desirable completion\) or false .*; data.format 'unpaired' needs "
         r"'prompt' and 'completion'"),
        (UNPAIRED | {"label": "maybe"}, r"'label' is 'maybe': write true .* a CSV's true, false, 1 and 0 are read"),
        (UNPAIRED | {"label": 2}, r"'label' is 2: write true"),
        ({"prompt": QUESTION, "label": True}, r"'completion' is missing or empty"),
        ({"completion": CHOSEN, "label": True}, r"'prompt' is missing or empty"),
        ({"messages": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c")], "label": False},
         r"'messages' ends with a user turn: its last turn is the completion the 'label' judges"),
        ({"messages": [_msg("assistant", "b")], "label": False},
         r"'messages' has no turn: a prompt ends with the user"),
    ],
)  # fmt: skip
def test_a_bad_unpaired_example_is_one_error_naming_its_line_and_key(
    tmp_path: Path, row: dict[str, Any], message: str
) -> None:
    path = _file(tmp_path, [UNPAIRED, row], "bad.jsonl")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: " + message):
        read_checked(str(path), DataConfig(source=str(path), format="unpaired"), REPO)


def test_unpaired_shapes_and_labels_read_alike(tmp_path: Path) -> None:
    prompt, completion = PAIR[0], PAIR[1]
    rows = [
        {"system": SYSTEM, "prompt": QUESTION, "completion": CHOSEN, "label": True},  # TRL's standard shape
        {"prompt": prompt, "completion": completion, "label": 1},  # TRL's conversational shape
        {"messages": [*prompt, *completion], "label": "true"},  # LLaMA-Factory's
        {
            "system": SYSTEM,
            "conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": CHOSEN}],
            "label": "True",
        },
    ]
    path = _file(tmp_path, rows, "kto.jsonl")
    records = read_checked(str(path), DataConfig(source=str(path), format="unpaired"), REPO)
    assert [pairs.unpaired(r)[1:] for r in records] == [(prompt, completion, True)] * 4
    csv = tmp_path / "kto.csv"
    csv.write_text(f"prompt,completion,label\n{QUESTION},{CHOSEN},true\n{QUESTION},{REJECTED},0\nq,a,FALSE\n")
    labels = [
        pairs.unpaired(r).desirable
        for r in read_checked(str(csv), DataConfig(source=str(csv), format="unpaired"), REPO)
    ]
    assert labels == [True, False, False]


def test_kto_reads_the_pairs_as_their_desirable_then_their_undesirable_examples(tmp_path: Path) -> None:
    """As TRL unpairs them: every chosen answer, then every rejected one, so that no example's KL row (the previous
    example's completion) is its own pair's other answer."""
    path = _file(tmp_path, [GOOD, {"prompt": "q2", "chosen": "c2", "rejected": "r2"}])
    job = _job(path, method="kto")
    records = training_data(job.data, REPO, seed=0).records
    found = pairs.items(records, job)
    assert [
        (e.where.rsplit(":", 1)[1], e.completion[0]["content"], e.desirable) for e in found if isinstance(e, Unpaired)
    ] == [("1", CHOSEN, True), ("2", "c2", True), ("1", REJECTED, False), ("2", "r2", False)]
    assert pairs.item_count(len(records), job) == 4 == len(found)
    assert pairs.item_count(len(records), _job(path)) == 2  # dpo: a pair an item


def _rows(blocks: PairBlocks, item: int, side: int) -> tuple[list[int], list[int]]:
    n = int(blocks.attention_mask[item, side].sum())
    return blocks.input_ids[item, side, :n].tolist(), blocks.labels[item, side, :n].tolist()


def test_pair_rows_label_only_the_answers_and_their_eos(tmp_path: Path, tokenizer: Any) -> None:
    path = _file(
        tmp_path, [SHAPES["trl standard, axolotl's system"], {"prompt": "q2", "chosen": "c2", "rejected": "r2"}]
    )
    job = _job(path, seq_len=48)
    blocks = prepare_pairs(job, tokenizer, REPO)
    assert blocks.input_ids.shape == blocks.labels.shape == blocks.attention_mask.shape == (2, 2, 48)
    assert blocks.input_ids.dtype == blocks.labels.dtype == blocks.attention_mask.dtype == torch.long
    assert len(blocks) == 2 and blocks.desirable is None and blocks.records == 2
    assert blocks.sets == ({"source": str(path), "weight": 1.0, "read": 2, "used": 2},)
    prompt_ids = [
        tokenizer.bos_token_id,
        *tokenizer(
            prompt_text(SHAPES["trl standard, axolotl's system"], job.data, tokenizer), add_special_tokens=False
        )["input_ids"],
    ]
    for side, answer in enumerate((CHOSEN, REJECTED)):
        ids, labels = _rows(blocks, 0, side)
        answer_ids = [*tokenizer(answer + "\n", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        assert ids == prompt_ids + answer_ids  # the prompt, then the answer tokenized on its own, then EOS
        assert labels == [IGNORE] * len(prompt_ids) + answer_ids  # EOS trained, the prompt never
        assert tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE]).startswith(answer)
        assert blocks.input_ids[0, side, len(ids) :].eq(tokenizer.pad_token_id).all()
        assert blocks.labels[0, side, len(ids) :].eq(IGNORE).all()
    assert tokenizer.decode(prompt_ids) == f"<s><|system|>\n{SYSTEM}\n<|user|>\n{QUESTION}\n<|assistant|>\n"


def test_a_long_answer_is_cut_at_seq_len_and_a_prompt_that_fills_it_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    long = " ".join(["word"] * 80)
    path = _file(tmp_path, [{"prompt": "q", "chosen": long, "rejected": "no"}])
    blocks = prepare_pairs(_job(path, seq_len=32), tokenizer, REPO)
    ids, labels = _rows(blocks, 0, 0)
    assert len(ids) == 32 and labels[-1] != IGNORE and tokenizer.eos_token_id not in ids  # keep_start: the end cut
    first = next(i for i, label in enumerate(labels) if label != IGNORE)  # the prompt's tokens: never labelled
    assert 0 < first < 32 and labels[first:] == ids[first:] and set(labels[:first]) == {IGNORE}
    path = _file(
        tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": long, "chosen": "a", "rejected": "b"}]
    )
    with pytest.raises(
        ConfigError,
        match=r"pairs.jsonl:2: its prompt takes \d+ tokens, so no token of an answer fits "
        r"in data.seq_len \(32\): raise data.seq_len or shorten the prompt",
    ):
        prepare_pairs(_job(path, seq_len=32), tokenizer, REPO)


def test_a_chat_template_renders_the_prompt_and_the_answer_is_what_the_conversation_adds(
    tmp_path: Path, tokenizer: Any
) -> None:
    chatml = load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)
    path = _file(tmp_path, [SHAPES["trl conversational"]])
    job = _job(path, template="chatml", seq_len=128)
    templates.apply(chatml, job.data, REPO)
    blocks = prepare_pairs(job, chatml, REPO)
    ids, labels = _rows(blocks, 0, 0)
    trained = chatml.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])
    assert trained == "29500/tcp.<|im_end|></s>\n"  # the answer and its end, as for SFT (tests/test_templates.py)
    prompt = chatml.decode(ids[: labels.index(next(x for x in labels if x != IGNORE))])
    assert prompt == prompt_text(SHAPES["trl conversational"], job.data, chatml)
    assert prompt.endswith("<|im_start|>assistant\n") and ids[0] != chatml.bos_token_id  # the template's own start


def test_kto_rows_are_each_example_and_its_kl_row_rotated_by_one(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"prompt": f"q{i}", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(3)]
    path = _file(tmp_path, rows, "kto.jsonl")
    job = _job(path, method="kto", fmt="unpaired")
    blocks = prepare_pairs(job, tokenizer, REPO)
    assert blocks.input_ids.shape == (3, 2, 64)
    assert blocks.desirable is not None and blocks.desirable.tolist() == [True, False, True]

    def answer(item: int, side: int) -> str:
        ids, labels = _rows(blocks, item, side)
        return str(tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE]))

    def prompt(item: int, side: int) -> list[int]:
        ids, labels = _rows(blocks, item, side)
        return ids[: next(i for i, label in enumerate(labels) if label != IGNORE)]

    # TRL's rotation over the data set: (x_0, y_2), (x_1, y_0), (x_2, y_1); its labels on its completion.
    assert [answer(i, 0) for i in range(3)] == ["answer 0\n</s>", "answer 1\n</s>", "answer 2\n</s>"]
    assert [answer(i, 1) for i in range(3)] == ["answer 2\n</s>", "answer 0\n</s>", "answer 1\n</s>"]
    assert all(prompt(i, 0) == prompt(i, 1) for i in range(3))

    batch = blocks.batch([2, 0], torch.device("cpu"))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "items", "desirable"}
    assert batch["items"].tolist() == [2, 0] and batch["desirable"].tolist() == [True, True]
    assert batch["desirable"].dtype == torch.bool and batch["items"].dtype == torch.long
    width = max(int(blocks.attention_mask[i, s].sum()) for i in (2, 0) for s in (0, 1))
    assert batch["input_ids"].shape == (4, width) and width < 64  # padding in every row is dropped
    # The items' row 0 in the order given, then their row 1.
    for row, (item, side) in enumerate([(2, 0), (0, 0), (2, 1), (0, 1)]):
        assert torch.equal(batch["input_ids"][row], blocks.input_ids[item, side, :width])
        assert torch.equal(batch["labels"][row], blocks.labels[item, side, :width])
        assert torch.equal(batch["attention_mask"][row], blocks.attention_mask[item, side, :width])


def test_dpo_batches_and_held_out_pairs_are_one_item_a_record(tmp_path: Path, tokenizer: Any) -> None:
    path = _file(tmp_path, [GOOD, {"prompt": "q2", "chosen": "c2", "rejected": "r2"}])
    job = _job(path)
    records, blocks = prepare_eval_pairs(str(path), job, tokenizer, REPO)
    assert [r.where for r in records] == [f"{path}:1", f"{path}:2"] and len(blocks) == 2
    batch = blocks.batch([1], torch.device("cpu"))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "items"} and batch["input_ids"].shape[0] == 2
    kto_records, kto = prepare_eval_pairs(str(path), _job(path, method="kto"), tokenizer, REPO)
    assert len(kto_records) == 2 and len(kto) == 4 and kto.desirable is not None
    assert kto.desirable.tolist() == [True, True, False, False]


def test_samples_show_the_last_question_and_the_chosen_answer(tokenizer: Any) -> None:
    cfg = DataConfig(source="x.jsonl", format="preference")
    for row in SHAPES.values():
        record = Record("p.jsonl:1", row)
        assert question(record) == QUESTION and reference(record) == CHOSEN
        assert prompt_text(row, cfg, tokenizer) == f"<|system|>\n{SYSTEM}\n<|user|>\n{QUESTION}\n<|assistant|>\n"
    unpaired = DataConfig(source="x.jsonl", format="unpaired")
    good, bad = UNPAIRED, UNPAIRED | {"label": False}
    assert question(Record("k:1", good)) == QUESTION and reference(Record("k:1", good)) == CHOSEN
    assert reference(Record("k:2", bad)) == ""  # an undesirable completion is no reference answer
    messages = {"messages": [_msg("user", QUESTION), _msg("assistant", REJECTED)], "label": False}
    assert question(Record("k:3", messages)) == QUESTION and reference(Record("k:3", messages)) == ""
    assert prompt_text(messages, unpaired, tokenizer) == f"<|user|>\n{QUESTION}\n<|assistant|>\n"
    # An SFT record reads as before.
    chat = {"messages": [_msg("user", "hi"), _msg("assistant", "hello")]}
    assert question(Record("c:1", chat)) == "hi" and reference(Record("c:1", chat)) == "hello"


def test_a_held_out_prompt_also_trained_on_is_refused(tmp_path: Path) -> None:
    train = _file(tmp_path, [GOOD, {"prompt": "q2", "chosen": "c2", "rejected": "r2"}], "train.jsonl")
    held = _file(
        tmp_path,
        [
            {"prompt": "other", "chosen": "a", "rejected": "b"},
            {"prompt": [_msg("user", "q2")], "chosen": "x", "rejected": "y"},
        ],
        "eval.jsonl",
    )
    job = JobConfig.model_validate(
        small_job(
            data={"source": str(train), "format": "preference"}, train={"method": "dpo"}, eval={"source": str(held)}
        )
    )
    with pytest.raises(ConfigError, match=r"eval.jsonl:2: this held-out prompt is also trained on \(.*train.jsonl:2\)"):
        jobcheck.check_data(job, REPO)
    fine = _file(tmp_path, [{"prompt": "other", "chosen": "a", "rejected": "b"}], "fine.jsonl")
    ok = job.model_copy(update={"eval": job.eval.model_copy(update={"source": str(fine)})})  # type: ignore[union-attr]
    assert jobcheck.check_data(ok, REPO) == jobcheck.DataSummary(2, 1)
    assert len(held_out_records(str(fine), ok.data, REPO, check=True)) == 1


def test_validate_counts_the_pairs_and_shows_them_with_the_answers_marked(tmp_path: Path) -> None:
    long = " ".join(["word"] * 60)
    path = _file(
        tmp_path,
        [
            SHAPES["trl standard, axolotl's system"],
            {"prompt": "q2", "chosen": long, "rejected": "r2"},
            {"prompt": "q3", "chosen": "c3", "rejected": "r3"},
        ],
    )
    found = datafacts.tokenized(_job(path), REPO)
    assert found is not None and isinstance(found.facts, datafacts.PairFacts)
    facts = found.facts
    assert (facts.records, facts.items, facts.rows, facts.seq_len, facts.cut) == (3, 3, 6, 64, 1)
    assert facts.steps_per_epoch == 3 / 8  # train.global_batch_size counts pairs
    line = facts.line()
    assert "3 records -> 3 pairs (chosen and rejected)" in line and "1 of 6 answers cut at data.seq_len" in line
    shown = [text.plain for text in datafacts.show(found, 2)]
    assert len(shown) == 2
    assert shown[0].startswith(f"pair 0 ({path}:1): prompt (")
    assert SYSTEM in shown[0] and QUESTION in shown[0]
    marked = [part.split(datafacts.CLOSE)[0] for part in shown[0].split(datafacts.OPEN)[1:]]
    assert marked == [f"{CHOSEN}\n</s>", f"{REJECTED}\n</s>"]  # the answers trained, never the prompt
    assert "tokens cut at data.seq_len" in shown[1] and "tokens cut" not in shown[0]

    kto = datafacts.tokenized(_job(path, method="kto"), REPO)
    assert kto is not None and isinstance(kto.facts, datafacts.PairFacts) and kto.facts.items == 6
    assert "6 examples (3 desirable, 3 undesirable; each with its KL row)" in kto.facts.line()
    (first,) = datafacts.show(kto, 1)
    assert "example 0" in first.plain and "KL row: the prompt with example 5's completion" in first.plain


def test_ugro_validate_shows_a_preference_job_and_refuses_a_bad_row_first(tmp_path: Path) -> None:
    path = _file(tmp_path, [SHAPES["sharegpt / llama-factory"], GOOD])
    job = small_job(
        name="pairs",
        data={"source": str(path), "format": "preference", "seq_len": 64},
        train={"method": "dpo", "global_batch_size": 2},
    )
    job_file = tmp_path / "pairs.yaml"
    job_file.write_text(yaml.safe_dump(job))
    shown = cli("validate", "--job", str(job_file), "--show", "1", timeout=300, env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "2 training records" in out and "data: 2 records -> 2 pairs (chosen and rejected)" in out, out
    assert "1.00 steps an epoch of 2 pairs" in out and "pair 0 (" in out and "pair 1" not in out, out
    assert f"{datafacts.OPEN}{CHOSEN}" in out and f"{datafacts.OPEN}{REJECTED}" in out, out

    _file(tmp_path, [GOOD, {"prompt": QUESTION, "chosen": CHOSEN}])  # the same file, now with a bad row
    refused = cli("validate", "--job", str(job_file), "--show", "1", timeout=300, env={"COLUMNS": "200"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{path}:2: 'rejected' is missing or empty" in " ".join(refused.stderr.split())
    assert refused.stdout == ""  # the one error, before anything else


def test_several_preference_sets_train_together_weighted_each_with_its_own_columns(
    tmp_path: Path, tokenizer: Any
) -> None:
    """data.sources as for SFT: a TRL-shaped file at weight 2 and an Axolotl-shaped one (question / good / bad) at
    weight 0.5, its columns its own."""
    trl = _file(tmp_path, [{"prompt": f"q{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(3)], "a.jsonl")
    axolotl = _file(tmp_path, [{"question": f"Q{i}", "good": f"G{i}", "bad": f"B{i}"} for i in range(4)], "b.jsonl")
    raw = small_job(data={"source": None, "sources": [{"source": str(trl), "weight": 2},
                                      {"source": str(axolotl), "weight": 0.5,
                                       "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"}}],
                          "format": "preference", "seq_len": 64}, train={"method": "dpo"})  # fmt: skip
    job = JobConfig.model_validate(raw)
    blocks = prepare_pairs(job, tokenizer, REPO)
    assert len(blocks) == 3 * 2 + 2 and [s["used"] for s in blocks.sets] == [6, 2]
    found = pairs.items(training_data(job.data, REPO, job.train.seed).records, job)
    assert {p.chosen[0]["content"] for p in found if isinstance(p, Preference)} >= {"c0", "c1", "c2"}
    assert sum(1 for p in found if isinstance(p, Preference) and p.chosen[0]["content"].startswith("G")) == 2
