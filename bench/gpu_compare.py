"""The trainer against a bare loop on one GPU, and packing on CUDA: parts of ``python -m bench.gpu``.

``compare`` runs cells of (model, 16-bit or 4-bit, backend, shape). Each cell runs, in fresh processes:

- ``bare``: a hand-written LoRA loop (transformers + peft, or unsloth's FastLanguageModel), random token rows with
  every position a label, ``model(input_ids, labels=...)``'s own loss, AdamW, gradient clipping; positions/s from
  the median step after three warm-up steps, peak ``torch.cuda.max_memory_allocated`` after loading;
- ``bare+ours`` (speed cells): the same loop with the trainer's loss (``train.balance.step.summed_loss``: from the
  hidden states, in chunks), which tells the loss's cost from the rest of the trainer's;
- ``trainer``: speed cells run the trainer's worker under torchrun (one rank, NCCL) on full rows of text, the
  same positions a step; memory cells run the preflight's memory probe (train/tools/memprobe.py, the trainer's
  own step), which also prints the stage planner's estimate for the backend it loaded.

``packing`` checks on CUDA that examples packed into one row see only themselves (train/data/blocks.py): the loss of
each example packed with others against alone, and, as the control, with the row's positions dropped (one causal
mask over the row), for transformers' SDPA in fp32 and for unsloth in bf16.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Cell:
    config: str  # models/configs/<name>
    quant: str  # none | 4bit
    backend: str  # hf | unsloth
    seq: int
    batch: int  # sequences a step
    micro: int
    ckpt: bool
    kind: str  # speed: bare, bare+ours, trainer under torchrun; memory: bare and the memory probe
    steps: int = 10
    with_bare: bool = True  # a memory cell without a bare figure to compare (the probe and the estimate only)

    @property
    def name(self) -> str:
        return (f"{Path(self.config).name} {self.quant} {self.backend} seq{self.seq} {self.batch}={self.micro}x"
                f"{self.batch // self.micro}{' ckpt' if self.ckpt else ''}")  # fmt: skip


QWEN = "models/configs/qwen2.5-1.5b"
LLAMA8 = "models/configs/llama-3-8b"
CELLS = [
    Cell(QWEN, "4bit", "hf", 1024, 8, 4, False, "speed"),
    Cell(LLAMA8, "4bit", "unsloth", 1024, 1, 1, True, "memory", steps=5),
    Cell(LLAMA8, "4bit", "hf", 1024, 1, 1, True, "memory", steps=5, with_bare=False),
    Cell(QWEN, "4bit", "unsloth", 1024, 8, 4, False, "speed"),
    Cell(QWEN, "none", "hf", 1024, 8, 4, False, "speed"),
    Cell(QWEN, "none", "unsloth", 1024, 8, 4, False, "speed"),
]


def _load(model_dir: str, backend: str, quant: str, seq: int, ckpt: bool) -> Any:
    import torch

    if backend == "unsloth":
        from unsloth import FastLanguageModel  # type: ignore[import-not-found]

        model, _ = FastLanguageModel.from_pretrained(model_name=model_dir, max_seq_length=seq, dtype=torch.bfloat16,
                                                     load_in_4bit=quant == "4bit")  # fmt: skip
        return FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, bias="none",
            use_gradient_checkpointing="unsloth" if ckpt else False, random_state=1234,
        )  # fmt: skip
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": {"": 0}}
    if quant == "4bit":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if quant == "4bit":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=ckpt,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})  # fmt: skip
    elif ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, bias="none",
                      task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, lora)


def bare(cell: Cell, model_dir: str, ours: bool) -> dict[str, Any]:
    """The bare loop in this process (``ours``: with the trainer's summed loss); one result record."""
    import torch

    from train.balance.step import summed_loss

    started = time.perf_counter()
    model = _load(model_dir, cell.backend, cell.quant, cell.seq, cell.ckpt)
    result: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 1)}
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(model.config.vocab_size), 32000)
    rows = [torch.randint(0, vocab, (cell.micro, cell.seq), generator=generator).cuda()
            for _ in range(cell.batch // cell.micro)]  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(cell.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for x in rows:
            if ours:
                loss = summed_loss(model, {"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)})
                loss = loss / (x.shape[0] * (x.shape[1] - 1))
            else:
                loss = model(input_ids=x, labels=x).loss
            (loss / len(rows)).backward()
            total += loss.detach() / len(rows)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(total))
    step_s = statistics.median(times[3:] or times)
    return result | {"step_s": round(step_s, 4), "positions_per_s": round(cell.batch * cell.seq / step_s),
                     "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss_first": round(losses[0], 4),
                     "loss_last": round(losses[-1], 4)}  # fmt: skip


def text_rows(path: Path, tokenizer_dir: Path, seq: int, documents: int, rows_each: int) -> Path:
    """A text data set whose every document is exactly ``rows_each`` rows of ``seq`` tokens with the tokenizer's
    BOS (if any) and EOS: one example a row, no padding, no packed row (as the bare loop's rows)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    starts = ("\u0120", "\u2581")  # a word-start token, byte-level BPE or sentencepiece
    single = [t for t, i in tokenizer.get_vocab().items()
              if t[:1] in starts and t[1:].isalpha() and len(t) > 3 and i > 300]  # fmt: skip
    chooser = random.Random(0)
    want = rows_each * seq - 1 - (tokenizer.bos_token_id is not None)  # train/data/blocks.py adds EOS, and BOS if any
    with path.open("w") as fh:
        for _ in range(documents):
            words = [w[1:] for w in chooser.choices(single, k=want)]
            for _ in range(8):  # a word that is not one token moves the count: trim to the exact length
                count = len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"])
                if count == want:
                    break
                words = words[: len(words) - max(1, count - want)] if count > want else words + words[: want - count]
            fh.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def _gpu() -> Any:
    """bench/gpu.py, which imports this module: its environment and torchrun for the processes started here."""
    from bench import gpu

    return gpu


def _job_file(cell: Cell, model_dir: Path, work: Path, data: Path, sections: dict[str, Any]) -> Path:
    """The cell's job (the bare loop's model, LoRA and shape, training on ``data``) with ``sections``, written."""
    name = cell.name.replace(" ", "-").replace("=", "-")
    job = {
        "name": name,
        "model": {"source": str(model_dir), "init": "pretrained", "quantization": cell.quant, "dtype": "bfloat16",
                  "backend": cell.backend},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": PROJECTIONS},
        "data": {"source": str(data), "format": "text", "seq_len": cell.seq},
        "rank_local": {"micro_batch_size": cell.micro, "gradient_checkpointing": cell.ckpt},
    } | sections  # fmt: skip
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def trainer(cell: Cell, model_dir: Path, work: Path) -> dict[str, Any]:
    """The trainer's worker under torchrun (one rank, NCCL) on rows like the bare loop's: positions/s from the
    median step after three, peak memory from its log."""
    data, held_out = work / f"rows-{cell.seq}.jsonl", work / f"held-out-{cell.seq}.jsonl"
    if not data.exists():
        text_rows(data, model_dir, cell.seq, documents=cell.batch * cell.steps // 4 + 2, rows_each=4)
        text_rows(held_out, model_dir, cell.seq, documents=2, rows_each=1)
    job_file = _job_file(cell, model_dir, work, data, {
        "eval": {"source": str(held_out), "every": cell.steps, "samples": 0, "max_new_tokens": 8},
        "schedule": {"warmup_steps": 2},
        "train": {"max_steps": cell.steps, "global_batch_size": cell.batch, "log_every": 1, "seed": 1234},
        "checkpoint": {"every": cell.steps, "keep_last": 1},
    })  # fmt: skip
    run_dir = work / job_file.stem
    done = _gpu().torchrun(job_file, run_dir, 1, {})
    if done.returncode != 0:
        return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(rows)]
    step_s = statistics.median(steps[2:])
    logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*rank*.log")))
    peaks = [float(x) for x in re.findall(r"peak memory of this rank: ([0-9.]+) GiB", logs)]
    return {"exit": 0, "step_s": round(step_s, 4), "positions_per_s": round(cell.batch * cell.seq / step_s),
            "peak_gib": max(peaks) if peaks else None, "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "loss_line": next((x for x in logs.splitlines() if "loss: " in x), None)}  # fmt: skip


def _child(what: str, cell: Cell, model_dir: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.gpu_compare", what, json.dumps(asdict(cell)), str(model_dir)]
    done = subprocess.run(
        argv, cwd=REPO, env=_gpu().child_env(), capture_output=True, text=True, timeout=600, check=False
    )
    found = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not found:
        return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}
    return dict(json.loads(found[-1][len("RESULT ") :]))


def compare(out: Path, emit: Any, materialize: Any) -> None:
    from train.tools import memprobe

    work = Path(os.environ.get("UGRO_GPU_SCRATCH", "/tmp/ugro-gpu")) / "compare"
    work.mkdir(parents=True, exist_ok=True)
    only = os.environ.get("UGRO_GPU_CELLS")
    for index, cell in enumerate(CELLS):
        if only and str(index) not in only.split(","):
            continue
        model_dir = materialize(cell.config)
        record: dict[str, Any] = {"what": "compare", "cell": cell.name} | asdict(cell)
        if cell.with_bare:
            record["bare"] = _child("bare", cell, model_dir)
        if cell.kind == "speed":
            record["bare_ours"] = _child("bare-ours", cell, model_dir)
            record["trainer"] = trainer(cell, model_dir, work)
            speeds = [record[k].get("positions_per_s") for k in ("bare", "trainer")]
            if all(speeds):
                record["trainer_over_bare"] = round(speeds[1] / speeds[0], 3)
        else:
            record["trainer"] = _probe(cell, model_dir, work, memprobe.MARK)
        emit(out, record)


def _probe(cell: Cell, model_dir: Path, work: Path, mark: str) -> dict[str, Any]:
    data = text_rows(work / f"probe-{cell.seq}.jsonl", model_dir, cell.seq, documents=4, rows_each=2)
    job_file = _job_file(cell, model_dir, work, data, {
        "schedule": {"warmup_steps": 0}, "train": {"max_steps": cell.steps, "global_batch_size": cell.batch},
    })  # fmt: skip
    argv = [sys.executable, "-m", "train.tools.memprobe", "--job", str(job_file), "--steps", str(cell.steps),
            "--code-dir", str(REPO)]  # fmt: skip
    done = subprocess.run(
        argv, cwd=REPO, env=_gpu().child_env(), capture_output=True, text=True, timeout=600, check=False
    )
    found = [x for x in done.stdout.splitlines() if x.startswith(mark + " ")]
    if not found:
        return {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}
    probe = json.loads(found[-1][len(mark) + 1 :])
    if "config_error" in probe:
        return {"exit": done.returncode, "config_error": probe["config_error"]}
    gib = 2**30
    peak, estimate = probe.get("peak_bytes"), probe.get("estimate_bytes")
    result = {"exit": done.returncode, "backend": probe.get("backend"), "oom": probe.get("oom"),
              "peak_gib": round(peak / gib, 2) if peak else None,
              "estimate_gib": round(estimate / gib, 2) if estimate else None}  # fmt: skip
    if peak and estimate:  # the estimate counts the CUDA context, which max_memory_allocated does not
        from train.layout.stageplan import CUDA_OVERHEAD_GIB

        result["estimate_less_context_over_peak"] = round((estimate / gib - CUDA_OVERHEAD_GIB) / (peak / gib), 3)
    return result


def packing(out: Path, emit: Any, materialize: Any) -> None:
    """Examples packed into one row see only themselves on CUDA: each backend's loss of an example packed and
    alone, and with the row's positions dropped (the control: then the later examples see the earlier ones)."""
    for backend, dtype in (("hf", "float32"), ("unsloth", "bfloat16")):  # unsloth computes in 16 bits
        cell = Cell(QWEN, "none", backend, 1024, 1, 1, False, "packing")
        emit(out, {"what": "packing", "backend": backend, "dtype": dtype} | _child("packing", cell, materialize(QWEN)))


def _packing_check(cell: Cell, model_dir: str) -> dict[str, Any]:
    import torch

    from train.balance.step import summed_loss
    from train.config import DataConfig
    from train.data.blocks import IGNORE, build_blocks
    from train.model.load import pack_by_lengths

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # CPU: a dry run
    model: Any
    if cell.backend == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=model_dir, max_seq_length=cell.seq,
                                                     dtype=torch.bfloat16, load_in_4bit=False)  # fmt: skip
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        model.to(device)
    model.eval()
    generator = torch.Generator().manual_seed(3)
    examples = []
    for length in (400, 300, 250):  # 950 tokens: one row of 1024 packed, three rows alone
        ids = torch.randint(5, min(30000, int(model.config.vocab_size)), (length,), generator=generator).tolist()
        examples.append((ids, [IGNORE, IGNORE, *ids[2:]]))
    packed = build_blocks(examples, DataConfig(source="x", seq_len=cell.seq, packing=True), pad_id=0)
    alone = build_blocks(examples, DataConfig(source="x", seq_len=cell.seq, packing=False), pad_id=0)
    assert packed.position_ids is not None
    starts = [i for i, p in enumerate(packed.position_ids[0].tolist()) if p == 0]

    def only(blocks: Any, row: int, at: int, size: int, positions: bool = True) -> dict[str, torch.Tensor]:
        batch = blocks.batch([row], device)
        labels = torch.full_like(batch["labels"], IGNORE)
        labels[0, at : at + size] = batch["labels"][0, at : at + size]
        if not positions:
            batch.pop("position_ids", None)
        return batch | {"labels": labels}

    found = []
    with torch.no_grad():
        for place, index in enumerate(sorted(range(3), key=lambda i: -len(examples[i][0]))):
            at, size = starts[place], len(examples[index][0])
            apart = float(summed_loss(model, only(alone, index, 0, size)))
            mixed = float(summed_loss(model, only(packed, 0, at, size, positions=False)))
            row: dict[str, Any] = {"place": place, "alone": apart, "no_positions_rel_diff": abs(mixed - apart) / apart}
            if cell.backend == "unsloth":  # as before: restarting positions only (unsloth's attention ignores them)
                row["positions_only_rel_diff"] = (
                    abs(float(summed_loss(model, only(packed, 0, at, size))) - apart) / apart
                )
                pack_by_lengths(
                    model
                )  # as the trainer calls it (train/model/load.py): the row joined, with the lengths
            row["packed_rel_diff"] = abs(float(summed_loss(model, only(packed, 0, at, size))) - apart) / apart
            found.append(row)
    return {"examples": found}


def main() -> int:
    what, cell_json, model_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    cell = Cell(**json.loads(cell_json))
    if cell.backend == "unsloth":
        import unsloth  # type: ignore[import-not-found]  # noqa: F401  (first: it patches transformers and peft)
    if what == "packing":
        result = _packing_check(cell, model_dir)
    else:
        try:
            result = bare(cell, model_dir, ours=what == "bare-ours")
        except Exception as exc:  # a finding, reported
            import torch

            result = {"error": f"{type(exc).__name__}: {str(exc)[:400]}",
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
