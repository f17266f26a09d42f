"""Does a GGUF file hold the merged model? Checked by two real readers of GGUF, against transformers.

- transformers' own GGUF loader reads each file back; every tensor is compared with the merged model's. An f16
  file must hold exactly the merged weights rounded to f16 (norms stay f32: exactly equal); a quantized file
  is reported by its relative error.
- llama.cpp (the cached build, ugro/model/llamacpp.py) loads each file and answers the held-out questions
  greedily from the same prompt tokens as transformers on the merged model: the first tokens must agree. Where
  they part, the point is reported with transformers' margin between its top two tokens there: a near tie
  that f16 arithmetic can flip, or a real difference.
- llama.cpp's held-out loss (mean over answer tokens, the run's own held-out rows) against transformers' on
  the merged model, for every file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.config import JobConfig
from train.data import evaluate
from train.data.blocks import IGNORE, Blocks, prepare_eval, prompt_text
from train.dist.distributed import RankInfo
from ugro.model.llamacpp import LlamaCpp

# f16: llama.cpp's answers must equal transformers' for at least this many tokens (or the divergence is a near tie).
SAME_TOKENS = 16
NEAR_TIE = 0.05  # logits: a top-two margin below this is a tie that f16 rounding may break either way
UNQUANTIZED = ("f32", "f16", "bf16")  # read back tensor by tensor; a quantized file is judged by its loss
# Held-out loss of a file against the merged model (relative): f16 is the merged model up to rounding, q8_0 is
# 8-bit; q4_k_m is reported, not held to a bound.
LOSS_TOLERANCE = {"f32": 0.001, "f16": 0.002, "bf16": 0.01, "q8_0": 0.01}


@dataclass
class TensorReport:
    tensors: int
    exact: int  # equal to the merged model's fp32 value
    rounded: int  # equal to the merged value rounded to f16
    other: int  # anything else (quantized, or wrong)
    max_rel_error: float  # max over tensors of ||gguf - merged|| / ||merged||
    missing: list[str] = field(default_factory=list)

    @property
    def faithful_f16(self) -> bool:
        return not self.missing and self.other == 0


@dataclass
class Divergence:
    question: int
    position: int
    llama_cpp: int
    transformers: int
    margin: float  # transformers' top-1 minus top-2 logit at that position

    @property
    def near_tie(self) -> bool:
        return self.margin < NEAR_TIE


@dataclass
class AnswerReport:
    questions: int
    same_tokens_min: int  # the fewest first tokens that agree, over the questions (a whole answer counts as max_new)
    identical: int  # questions whose whole answer agrees
    prompt_tokens_agree: bool  # llama.cpp's tokenizer gives transformers' prompt tokens
    divergences: list[Divergence] = field(default_factory=list)


@dataclass
class FileReport:
    kind: str
    path: str
    size_mb: float
    loss: float
    loss_rel_diff: float
    loss_tolerance: float | None
    answers: AnswerReport
    tensors: TensorReport | None = None
    chat_template_kept: bool = False

    @property
    def passed(self) -> bool:
        tensors_ok = self.tensors is None or self.kind not in ("f16", "f32") or self.tensors.faithful_f16
        loss_ok = self.loss_tolerance is None or abs(self.loss_rel_diff) <= self.loss_tolerance
        answers_ok = self.kind not in ("f16", "f32") or all(
            d.near_tie or d.position >= SAME_TOKENS for d in self.answers.divergences
        )
        return tensors_ok and loss_ok and answers_ok and self.chat_template_kept and self.answers.prompt_tokens_agree

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FileReport:
        fields = {k: v for k, v in data.items() if k != "passed"}
        answers = dict(fields.pop("answers"))
        answers["divergences"] = [Divergence(**d) for d in answers.get("divergences", [])]
        tensors = fields.pop("tensors")
        return cls(**fields, answers=AnswerReport(**answers), tensors=TensorReport(**tensors) if tensors else None)


def compare_tensors(gguf: Path, merged: dict[str, torch.Tensor]) -> TensorReport:
    """transformers' GGUF loader reads the file back; each tensor against the merged model's."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = loaded.state_dict()
    exact = rounded = other = 0
    worst = 0.0
    missing = [name for name in merged if name not in state or state[name].shape != merged[name].shape]
    for name, want in merged.items():
        if name in missing:
            continue
        got = state[name].float()
        if torch.equal(got, want):
            exact += 1
        elif torch.equal(got, want.half().float()):
            rounded += 1
        else:
            other += 1
        worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
    return TensorReport(len(merged), exact, rounded, other, worst, missing)


class LlamaModel:
    """One GGUF file loaded by llama.cpp for scoring (every position's logits) and greedy answers."""

    def __init__(self, llama: LlamaCpp, path: Path, n_ctx: int) -> None:
        lib = llama.binding()
        # The prompt and held-out rows are evaluated as batches, whose threads llama-cpp-python sets to every core
        # unless told: torch's thread count for both, as the merged model beside it runs (OMP_NUM_THREADS). Its
        # threads wait for each other by spinning: two of them on a core that another process also wants made
        # the check ~4 times as long (docs/results.md "CI time").
        threads = torch.get_num_threads()
        self.model = lib.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, seed=0,
            n_threads=threads, n_threads_batch=threads,
        )  # fmt: skip
        self.metadata: dict[str, str] = dict(self.model.metadata)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        self.model.reset()
        self.model.eval(list(ids))
        return np.array(self.model.scores[: len(ids)], dtype=np.float64)

    def greedy(self, ids: Sequence[int], max_new: int, eos: set[int]) -> list[int]:
        self.model.reset()
        out: list[int] = []
        for token in self.model.generate(list(ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if token in eos:
                break
            out.append(int(token))
            if len(out) >= max_new:
                break
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self.model.tokenize(text.encode(), add_bos=False, special=True))

    def close(self) -> None:
        self.model.close()


def held_out_loss_llama(model: LlamaModel, blocks: Blocks) -> float:
    """Mean next-token loss over the answer tokens of every held-out row, from llama.cpp's logits."""
    total, count = 0.0, 0
    for row in range(len(blocks)):
        width = int(blocks.attention_mask[row].sum())
        ids = blocks.input_ids[row, :width].tolist()
        labels = blocks.labels[row, :width]
        logits = model.logits(ids)
        for t in range(width - 1):
            target = int(labels[t + 1])
            if target == IGNORE:
                continue
            scores = logits[t]
            top = scores.max()
            total += float(top + np.log(np.exp(scores - top).sum()) - scores[target])
            count += 1
    return total / count


@torch.no_grad()
def greedy_hf(model: Any, ids: Sequence[int], max_new: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    current = torch.tensor([list(ids)])
    past = None
    for _ in range(max_new):
        result = model(input_ids=current if past is None else current[:, -1:], past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        current = torch.cat([current, torch.tensor([[token]])], dim=1)
    return out


@torch.no_grad()
def margin_at(model: Any, ids: Sequence[int]) -> float:
    """transformers' top-1 minus top-2 logit for the token after ``ids``."""
    logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def compare_answers(
    llama_model: LlamaModel,
    hf_model: Any,
    prompts: list[tuple[str, list[int]]],
    answers_hf: list[list[int]],
    max_new: int,
    eos: set[int],
) -> AnswerReport:
    """llama.cpp's greedy answers against transformers' (``answers_hf``), from the same prompt tokens."""
    agree: list[int] = []
    divergences: list[Divergence] = []
    for index, ((_, ids), want) in enumerate(zip(prompts, answers_hf, strict=True)):
        got = llama_model.greedy(ids, max_new, eos)
        if got == want:
            agree.append(max_new)  # the whole answer, however short (it ended at the same end-of-turn)
            continue
        same = 0
        while same < min(len(got), len(want)) and got[same] == want[same]:
            same += 1
        agree.append(same)
        mine, theirs = (got[same], want[same]) if same < min(len(got), len(want)) else (-1, -1)  # -1: ended here
        divergences.append(Divergence(index, same, mine, theirs, margin_at(hf_model, [*ids, *want[:same]])))
    tokens_agree = all(llama_model.tokenize(text) == ids for text, ids in prompts)
    return AnswerReport(len(prompts), min(agree), agree.count(max_new), tokens_agree, divergences)


def check(
    files: dict[str, Path],
    merged_dir: Path,
    held: evaluate.HeldOut,
    prompts: list[tuple[str, list[int]]],
    llama: LlamaCpp,
    max_new: int = 2 * SAME_TOKENS,
) -> tuple[float, list[FileReport]]:
    """Every GGUF file against the merged model: its tensors, held-out loss and greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    eos_ids = GenerationConfig.from_pretrained(str(merged_dir)).eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [eos_ids]) | {tokenizer.eos_token_id}
    state = merged.state_dict()
    blocks = held.blocks
    assert isinstance(blocks, Blocks)  # held_out: rows of answers, also for a preference run's chosen ones
    # The run's own held-out loss, computed as the run computes it, on one process of the controller.
    reference_loss, _ = evaluate.loss(merged, held, RankInfo(0, 0, 1, "controller", torch.device("cpu")), 1)
    answers_hf = [greedy_hf(merged, ids, max_new, eos) for _, ids in prompts]
    n_ctx = max([int(blocks.attention_mask.sum(dim=1).max())] + [len(ids) + max_new for _, ids in prompts])
    reports = []
    for kind, path in files.items():
        model = LlamaModel(llama, path, n_ctx)
        try:
            loss = held_out_loss_llama(model, blocks)
            answers = compare_answers(model, merged, prompts, answers_hf, max_new, eos)
            template_kept = model.metadata.get("tokenizer.chat_template") == tokenizer.chat_template
        finally:
            model.close()
        reports.append(
            FileReport(
                kind=kind,
                path=path.name,
                size_mb=round(path.stat().st_size / 1e6, 1),
                loss=round(loss, 6),
                loss_rel_diff=round((loss - reference_loss) / reference_loss, 6),
                loss_tolerance=LOSS_TOLERANCE.get(kind),
                answers=answers,
                tensors=compare_tensors(path, state) if kind in UNQUANTIZED else None,
                chat_template_kept=template_kept,
            )
        )
    return reference_loss, reports


def held_out(job: JobConfig, tokenizer: Any, repo: Path) -> tuple[evaluate.HeldOut, list[tuple[str, list[int]]]]:
    """The rows the run's held-out loss was measured on, and each record's question as the model is prompted."""
    source = job.eval.source if job.eval is not None else job.data.sets()[0].source
    records, blocks = prepare_eval(source, job.data, tokenizer, repo)
    prompts = []
    for record in records:
        text = prompt_text(record.fields, job.data, tokenizer)
        prompts.append((text, list(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return evaluate.HeldOut(records, blocks), prompts


def main(argv: list[str]) -> int:
    """``python -m ugro.model.gguf_check SPEC.json``: the checks in a process of their own, so that llama.cpp
    failing hard on a file (it aborts on some malformed ones) ends this process, not the export. SPEC names the
    files, the merged model, the job and the repository; the report goes to stdout as one JSON line."""
    from transformers import AutoTokenizer

    spec = json.loads(Path(argv[0]).read_text())
    merged = Path(spec["merged"])
    job = JobConfig.model_validate(spec["job"])
    held, prompts = held_out(job, AutoTokenizer.from_pretrained(str(merged)), Path(spec["repo"]))
    if spec.get("questions"):
        prompts = prompts[: int(spec["questions"])]
    files = {kind: Path(path) for kind, path in spec["files"].items()}
    reference, reports = check(files, merged, held, prompts, LlamaCpp(Path(spec["llama"])))
    print(json.dumps({"reference_loss": reference, "files": [r.to_dict() for r in reports]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
