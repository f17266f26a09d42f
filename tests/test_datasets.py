"""Data as people bring it: their own column and speaker names (data.columns, data.roles), and several data sets in
one job, each with a weight (data.sources). The records are the sample data (data/sample/) written in other shapes;
one real run trains on a ShareGPT file and a mapped file together, weighted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO, cli, small_job

from train.config import ConfigError, DataConfig, ModelConfig, load_job
from train.data.blocks import tokenize
from train.data.records import Record, training_data, weighted
from train.metrics import read_metrics
from train.model.load import load_tokenizer
from ugro.model.card import render_card

SAMPLE = [json.loads(line) for line in (REPO / "data" / "sample" / "train.jsonl").read_text().splitlines()]
HELD_OUT = [json.loads(line) for line in (REPO / "data" / "sample" / "eval.jsonl").read_text().splitlines()]


def _sharegpt(row: dict[str, str]) -> dict[str, Any]:
    return {"conversations": [{"from": "human", "value": row["instruction"]}, {"from": "gpt", "value": row["output"]}]}


def _their_chat(row: dict[str, str]) -> dict[str, Any]:
    """A support desk's export: its own key for the conversation, its speakers' names and its text key."""
    return {"ticket": 7, "dialog": [{"speaker": "Customer", "text": row["instruction"]},
                                    {"speaker": "agent", "text": row["output"]}]}  # fmt: skip


def _openai(row: dict[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": row["instruction"]},
                         {"role": "assistant", "content": row["output"]}]}  # fmt: skip


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


MAPPED = {"columns": {"messages": "dialog", "role": "speaker", "content": "text"},
          "roles": {"customer": "user", "agent": "assistant"}}  # fmt: skip


def test_a_mapped_file_trains_exactly_as_the_same_records_in_the_usual_shape(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)
    rows = SAMPLE[:20]
    usual = _write(tmp_path / "usual.jsonl", [_openai(r) for r in rows])
    theirs = _write(tmp_path / "theirs.jsonl", [_their_chat(r) for r in rows])
    questions = _write(tmp_path / "qa.csv", [])
    questions.write_text("question,answer\n" + "".join(f'"{r["instruction"]}","{r["output"]}"\n' for r in rows[:5]))

    def examples(**data: Any) -> list[Any]:
        cfg = DataConfig(**data)
        return tokenize(training_data(cfg, REPO, seed=7, check=True).records, cfg, tokenizer)

    assert examples(source=str(theirs), format="chat", **MAPPED) == examples(source=str(usual), format="chat")
    # An instruction file with its own column names (a CSV of question,answer).
    mapped = examples(source=str(questions), columns={"instruction": "question", "output": "answer"})
    assert mapped == examples(source="data/sample/train.jsonl")[:5]


def test_weights_repeat_records_or_take_a_seeded_share_of_them() -> None:
    records = [Record(f"a.jsonl:{n}", {"n": n}) for n in range(1, 11)]
    assert weighted(records, 2.0, seed=1) == records + records
    half = weighted(records, 0.5, seed=1)
    assert len(half) == 5 and half == sorted(half, key=lambda r: r.fields["n"]) and all(r in records for r in half)
    assert weighted(records, 0.5, seed=1) == half and weighted(records, 0.5, seed=2) != half  # train.seed decides
    assert len(weighted(records, 1.5, seed=1)) == 15


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "a.jsonl", "sources": [{"source": "b.jsonl"}]}, "data.source (one data set) or in data.sources"),
        ({}, "data.source (one data set) or in data.sources"),
        ({"source": "a.jsonl", "columns": {"question": "q"}},
         "data.columns: 'question' is no field of data.format 'instruction' (it reads instruction, input, output)"),
        ({"sources": [{"source": "a.jsonl", "columns": {"role": "speaker"}}]},
         "data.sources[0].columns: 'role' is no field of data.format 'instruction'"),
        ({"sources": [{"source": "a.jsonl", "weight": 0}]}, "greater than 0"),
        ({"source": "a.jsonl", "format": "chat", "roles": {"agent": "bot"}}, "'system', 'user' or 'assistant'"),
    ],
)  # fmt: skip
def test_a_mapping_or_data_set_that_cannot_work_is_refused_naming_its_key(
    tmp_path: Path, data: dict[str, Any], message: str
) -> None:
    job = tmp_path / "job.yaml"
    settings = small_job()
    settings["data"] = data | {"seq_len": 128}
    job.write_text(yaml.safe_dump(settings))
    with pytest.raises(ConfigError) as caught:
        load_job(job)
    assert message in " ".join(str(caught.value).split())


def test_a_record_without_the_mapped_field_is_refused_with_its_line(tmp_path: Path) -> None:
    theirs = _write(tmp_path / "theirs.jsonl", [_their_chat(SAMPLE[0]), {"ticket": 8, "conversation": []}])
    cfg = DataConfig(source=str(theirs), format="chat", **MAPPED)
    with pytest.raises(ConfigError, match=rf"{theirs}:2: no 'dialog' \(data.columns maps it to 'messages'\)"):
        training_data(cfg, REPO, seed=7, check=True)
    unnamed = _write(tmp_path / "unnamed.jsonl", [{"dialog": [{"speaker": "clerk", "text": "hi"}]}])
    cfg = DataConfig(source=str(unnamed), format="chat", **MAPPED)
    with pytest.raises(ConfigError, match=r"unnamed.jsonl:1: message 1 has the role 'clerk'.*or name the role in "):
        training_data(cfg, REPO, seed=7, check=True)


def test_a_sharegpt_file_and_a_mapped_file_train_together_weighted(tmp_path: Path, torchrun: Any) -> None:
    """`ugro validate` counts both sets with their weights; 16 steps on them lower the loss and the held-out
    loss; run.json says what each set gave."""
    sharegpt = _write(tmp_path / "sharegpt.jsonl", [_sharegpt(r) for r in SAMPLE[:120]])
    theirs = _write(tmp_path / "theirs.jsonl", [_their_chat(r) for r in SAMPLE[120:240]])
    held_out = _write(tmp_path / "held-out.jsonl", [_openai(r) for r in HELD_OUT])
    data = {"format": "chat", "seq_len": 128, "sources": [
        {"source": str(sharegpt), "weight": 1.5},
        {"source": str(theirs), "weight": 0.5, **MAPPED},
    ]}  # fmt: skip
    evaluation = {"source": str(held_out), "every": 100, "samples": 1, "max_new_tokens": 8}
    job = tmp_path / "job.yaml"
    settings = small_job(eval=evaluation, train={"max_steps": 16})
    settings["data"] = data
    job.write_text(yaml.safe_dump(settings))
    check = cli("validate", "--job", str(job), timeout=120, env={"COLUMNS": "400"})
    assert check.returncode == 0, check.stdout + check.stderr
    assert "240 training records, 23 held-out" in check.stdout, check.stdout  # 180 + 60 after the weights

    result = torchrun(job, tmp_path / "run", nproc=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert rows[-1]["step"] == 16 and last < 0.85 * first, f"loss went from {first} to {last}"
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    sets = [(s["source"], s["weight"], s["records"], s["used"]) for s in run["data"]["train_sets"]]
    assert sets == [(str(sharegpt), 1.5, 120, 180), (str(theirs), 0.5, 120, 60)], run["data"]
    assert run["data"]["train"]["records"] == 240
    card = render_card(tmp_path / "run", REPO, artifact="adapter")  # the model card names both, with their weights
    assert f"| training | `{sharegpt}` | 120 (weight 1.5: 180) |" in card
    assert f"| training | `{theirs}` | 120 (weight 0.5: 60) |" in card
