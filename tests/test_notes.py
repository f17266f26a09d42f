"""Text as people have it: notes files of paragraphs, a folder of notes, .json and .csv records, every data error
naming a line the user can open (train/data/sources.py), long documents cut to data.seq_len, and a notes file that
trains under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, Run, cli, small_job

from train.config import ConfigError, DataConfig, JobConfig, ModelConfig
from train.data.blocks import build_blocks, prepare, prepare_eval, tokenize
from train.data.records import load_records, read_checked
from train.metrics import read_metrics
from train.model.load import load_tokenizer

NOTES = (
    "\n"
    "node4070 hangs at the rendezvous.   \n"
    "Cause: the firewall drops port 29500.\n"
    "\n"
    "\n"
    "  \t\n"
    "Fix: open 29500/tcp on every host.\n"
    "\n"
    "\n"
)
EXPECTED = [
    (2, "node4070 hangs at the rendezvous.\nCause: the firewall drops port 29500."),
    (7, "Fix: open 29500/tcp on every host."),
]


def _documents(path: Path, fmt: str = "text") -> list[tuple[int, str]]:
    records = read_checked(str(path), DataConfig(source=str(path), format=fmt), REPO)  # type: ignore[arg-type]
    found = []
    for record in records:
        where, _, line = record.where.rpartition(":")
        assert where == str(path)
        found.append((int(line), record.fields["text"]))
    return found


@pytest.mark.parametrize(("name", "newline"), [("notes.txt", "\n"), ("notes.txt", "\r\n"), ("notes.md", "\n")])
def test_a_notes_file_is_documents_separated_by_blank_lines(tmp_path: Path, name: str, newline: str) -> None:
    path = tmp_path / name
    path.write_bytes(NOTES.replace("\n", newline).encode())
    assert _documents(path) == EXPECTED


def test_a_folder_of_notes_is_one_document_per_file_sorted_by_path(tmp_path: Path) -> None:
    (tmp_path / "notes" / "b").mkdir(parents=True)
    (tmp_path / "notes" / "b" / "nccl.md").write_text("# NCCL\n\nSet NCCL_SOCKET_IFNAME.\n")
    (tmp_path / "notes" / "a.txt").write_text("\n\nOOM on node3070.\nLower micro_batch_size.\n\n")
    (tmp_path / "notes" / "empty.txt").write_text("\n")
    (tmp_path / "notes" / "skip.jsonl").write_text('{"text": "not a note"}\n')
    records = load_records(str(tmp_path / "notes"), REPO, fmt="text")
    assert [r.where for r in records] == [f"{tmp_path}/notes/a.txt:3", f"{tmp_path}/notes/b/nccl.md:1"]
    assert [r.fields["text"] for r in records] == [
        "OOM on node3070.\nLower micro_batch_size.",
        "# NCCL\n\nSet NCCL_SOCKET_IFNAME.",
    ]
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match=r"data.source: .*/none: no text: it holds no .txt or .md file"):
        load_records(str(tmp_path / "none"), REPO, fmt="text")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"ok\n" * 40 + b"caf\xe9 au lait\n", r"notes.txt:41: not UTF-8 text \(byte 0xe9 at byte offset 123\)"),
        (b"one\n\ntwo\x00\x01\n", r"notes.txt:3: a NUL byte \(byte offset 8\): this is a binary file"),
        (b"", r"notes.txt: no text: the file is empty or holds only blank lines"),
        (b"\n  \r\n\t\n", r"notes.txt: no text: the file is empty or holds only blank lines"),
    ],
)
def test_a_notes_file_that_is_not_text_is_refused_naming_the_line(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "notes.txt").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        _documents(tmp_path / "notes.txt")


def test_a_notes_file_needs_format_text(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(NOTES)
    with pytest.raises(ConfigError, match=r"a .txt file is plain text, read as data.format: text"):
        _documents(tmp_path / "notes.txt", fmt="instruction")


JSON_ARRAY = """[
  {"instruction": "Which port?", "output": "29500"},
  {
    "instruction": "Which interface?",
    "output": "enp5s0"
  },

  {"instruction": "Which host?"}
]
"""


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("x.json", JSON_ARRAY, r"x.json:8: missing or empty 'output'"),
        ("x.json", JSON_ARRAY.replace('"enp5s0"', '"enp5s0",'), r"x.json:6: not valid JSON \(Expecting"),
        ("x.json", '[{"instruction": "a", "output": "b"},\n 3]', r"x.json:2: a record must be a JSON object, not int"),
        ("x.json", '{"instruction": "a", "output": "b"}\n\n{"instruction": "c"}\n', r"x.json:3: missing or empty"),
        ("x.json", '{"instruction": "a", "output": "b"}\n{"instruction": \n', r"x.json:2: not valid JSON"),
        ("x.csv", 'instruction,output\n"Which\nport?",29500\n\nWhich host?,\n', r"x.csv:5: missing or empty 'output'"),
        (
            "x.csv",
            "instruction,output\na,b\nc,d,e\n",
            r"x.csv:3: 3 fields where the header has 2 \(instruction, output\)",
        ),
        (
            "x.jsonl",
            b'{"output": "a"}\n{"output": "\xff"}\n',
            r"x.jsonl:2: not UTF-8 text \(byte 0xff at byte offset 28\)",
        ),
    ],
)
def test_json_and_csv_records_are_named_by_their_line(
    tmp_path: Path, name: str, content: str | bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message):
        read_checked(str(path), DataConfig(source=str(path), format="instruction"), REPO)


def test_json_and_csv_records_keep_their_fields_and_lines(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text(JSON_ARRAY.replace('"Which host?"', '"Which host?", "output": "master"'))
    (tmp_path / "x.csv").write_text('instruction,input,output\r\n"Which\r\nport?",,29500\r\n')
    json_records = load_records(str(tmp_path / "x.json"), REPO)
    assert [(r.where.rpartition(":")[2], r.fields["output"]) for r in json_records] == [
        ("2", "29500"), ("3", "enp5s0"), ("8", "master"),
    ]  # fmt: skip
    (csv_record,) = load_records(str(tmp_path / "x.csv"), REPO)
    assert csv_record.where.endswith("x.csv:2")
    assert csv_record.fields == {"instruction": "Which\r\nport?", "input": "", "output": "29500"}


def test_packing_off_cuts_a_long_document_into_seq_len_pieces() -> None:
    long = list(range(100, 121))  # 21 tokens: 8 + 8 + 5
    examples = [(long, long), ([1, 5, 2], [1, 5, 2]), (list(range(17)), list(range(17)))]  # 17 = 8 + 8 + 1
    text = build_blocks(examples, DataConfig(source="x", format="text", seq_len=8, packing=False), pad_id=0)
    assert text.input_ids.tolist() == [
        long[:8],
        long[8:16],
        [*long[16:], 0, 0, 0],
        [1, 5, 2, 0, 0, 0, 0, 0],
        list(range(8)),
        list(range(8, 16)),
    ]  # fmt: skip  (the 1-token tail of the last one trains nothing)
    assert text.attention_mask.sum(dim=1).tolist() == [8, 8, 5, 3, 8, 8]
    assert text.labels[2].tolist() == [-100, *long[17:], -100, -100, -100]  # a piece's first token: no target
    instruction = build_blocks(examples, DataConfig(source="x", seq_len=8, packing=False), pad_id=0)
    assert instruction.input_ids.tolist()[0] == long[:8] and len(instruction) == 3  # truncated, as before


def test_held_out_notes_count_every_token(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)
    (tmp_path / "notes.txt").write_text(_notes(6))
    cfg = DataConfig(source=str(tmp_path / "notes.txt"), format="text", seq_len=16)
    records, blocks = prepare_eval(cfg.source, cfg, tokenizer, REPO)
    lengths = [len(ids) for ids, _ in tokenize(records, cfg, tokenizer)]
    assert len(records) == 6 and len(blocks) == sum(n // 16 + (n % 16 > 1) for n in lengths) > 6
    assert int(blocks.attention_mask.sum()) == sum(n - (n % 16 == 1) for n in lengths)  # a 1-token tail is dropped
    # Packed: the same pieces, whole, several to a row.
    packed = prepare(cfg, tokenizer, REPO)
    assert int(packed.attention_mask.sum()) == int(blocks.attention_mask.sum()) and len(packed) < len(blocks)


def _notes(count: int) -> str:
    """Cluster notes, a paragraph each, varied enough to be text and alike enough to be learnt."""
    hosts = ["master", "node4070", "node3070"]
    faults = [
        ("hangs at the rendezvous", "the firewall drops port {port}", "open {port}/tcp on every host"),
        ("runs out of memory at step {step}", "micro_batch_size is too large", "lower micro_batch_size to 2"),
        ("is slower than the others", "it trains on the wrong interface", "set NCCL_SOCKET_IFNAME to enp5s0"),
        ("cannot find the model", "the model directory was not synced", "run make train again to copy it"),
    ]
    paragraphs = []
    for i in range(count):
        symptom, cause, fix = faults[i % len(faults)]
        values = {"port": 29500 + i % 3, "step": 10 * (i + 1)}
        paragraphs.append(
            f"Note {i + 1}: {hosts[i % 3]} {symptom.format(**values)}.\n"
            f"Cause: {cause.format(**values)}.\nFix: {fix.format(**values)}, then resume from the last checkpoint."
        )
    return "\n\n".join(paragraphs) + "\n"


def test_validate_refuses_a_notes_file_with_a_bad_byte(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_bytes(_notes(20).encode().replace(b"Note 11:", b"Note \xa711:"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(small_job(data={"source": str(tmp_path / "notes.txt"), "format": "text"})))
    result = cli("validate", "--job", str(job), timeout=120, env={"COLUMNS": "400"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{tmp_path / 'notes.txt'}:41: not UTF-8 text (byte 0xa7 at byte offset" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_a_notes_file_trains(tmp_path: Path, torchrun: Run) -> None:
    """`ugro validate` accepts a job on a notes file (and held-out notes in .md), and 16 steps on it lower the loss;
    the held-out sample goes on from a note's first line."""
    (tmp_path / "notes.txt").write_text(_notes(48))
    (tmp_path / "held-out.md").write_text(_notes(52).split("\n\n", 48)[-1])  # notes 49-52, never trained on
    data = {"source": str(tmp_path / "notes.txt"), "format": "text", "seq_len": 64}
    held_out = {"source": str(tmp_path / "held-out.md"), "every": 100, "samples": 1, "max_new_tokens": 8}
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(small_job(data=data, eval=held_out, train={"max_steps": 16}, checkpoint={"every": 100}))
    )
    check = cli("validate", "--job", str(job), timeout=120, env={"COLUMNS": "400"})
    assert check.returncode == 0 and "48 training records, 4 held-out" in check.stdout, check.stdout + check.stderr

    result = torchrun(job, tmp_path / "run", nproc=1)  # one rank: the data path is what is tested here (~3 s less)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert rows[-1]["step"] == 16 and last < 0.85 * first, f"loss went from {first} to {last}"
    assert "Note 49:" in (tmp_path / "run" / "samples.md").read_text()


def test_a_held_out_note_is_asked_by_its_first_line_and_answered_by_the_rest() -> None:
    from train.data.evaluate import question, reference
    from train.data.records import Record

    note = Record("notes.md:3", {"text": "node3070 drops out of the job.\nCause: its link renegotiates to 100 Mbps."})
    assert question(note) == "node3070 drops out of the job."
    assert reference(note) == "Cause: its link renegotiates to 100 Mbps."
    assert reference(Record("notes.md:9", {"text": "A one-line note."})) == ""


def test_a_repeated_heading_is_not_leakage_but_a_repeated_note_is(tmp_path: Path) -> None:
    from ugro.checks import jobcheck

    long_note = "Fix: open 29500/tcp on every host of the cluster, then launch again."
    (tmp_path / "train.txt").write_text(f"## Network\n\n{long_note}\n\nNote 1: the exporter listens on 9400.\n")
    (tmp_path / "ok.md").write_text("## Network\n\nNote 2: the dashboard polls every 2 s.\n")
    (tmp_path / "leak.md").write_text(f"## Network\n\n{long_note}\n")

    def job(held_out: str) -> JobConfig:
        data = {"source": str(tmp_path / "train.txt"), "format": "text"}
        return JobConfig.model_validate(small_job(data=data, eval={"source": str(tmp_path / held_out)}))

    assert jobcheck.check_data(job("ok.md"), REPO).eval_records == 2
    with pytest.raises(ConfigError, match=r"leak.md:3: this held-out question is also trained on \(.*train.txt:3\)"):
        jobcheck.check_data(job("leak.md"), REPO)
