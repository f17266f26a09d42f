"""The job's own held-out set as lm-evaluation-harness documents: each record's prompt and answer as the model was
trained on them (train/data: the job's format, columns, roles and template; a preference job's chosen answer).

A document's ``prompt`` is what train/data/blocks.py ``prompt_text`` shows the model; its ``answer`` is the rest of
the rendered record (``render``: the chat template's answer turn with its end-of-turn token, or the answer and the
end-of-sequence token that plain formats end with). ``question`` and ``reference`` are the sample's question and
reference answer (train/data/evaluate.py), for the generation task.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, JobConfig
from train.data import pairs
from train.data.blocks import prompt_text, render, uses_chat_template
from train.data.evaluate import question, reference
from train.data.records import Record, check_record, held_out_records

CHAT_LIKE = ("chat", "instruction", *pairs.PAIR_FORMATS)  # data whose answers a generation task can judge


@dataclass(frozen=True)
class HeldOutDoc:
    """One held-out record as an lm-eval document (a row of the task's jsonl)."""

    where: str  # file:line of the record
    prompt: str
    answer: str
    answer_tokens: int  # the answer's tokens in the run's tokenizer
    answer_bytes: int  # its UTF-8 bytes
    question: str
    reference: str
    stop: list[str]  # where a generated answer ends (the end-of-turn text that follows an answer)

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HeldOutSet:
    docs: list[HeldOutDoc]
    chat_like: bool  # whether the data is chat or instruction data (then there is a generation task too)
    source: str  # eval.source as the job names it


def _stops(answer: str, reference_text: str, eos: str | None) -> list[str]:
    """What follows the answer's text in the trained rendering ('<|im_end|>'), and the end-of-sequence token."""
    tail = answer.split(reference_text, 1)[1].strip() if reference_text and reference_text in answer else ""
    return [s for s in dict.fromkeys([tail, eos or ""]) if s]


def _doc(record: Record, job: JobConfig, tokenizer: Any) -> HeldOutDoc:
    cfg = job.data
    check_record(record, cfg.format)
    chat = uses_chat_template(cfg, tokenizer)
    prompt = prompt_text(record.fields, cfg, tokenizer)
    full = "".join(text for text, _trained in render(record.fields, cfg, tokenizer))
    if not chat:  # plain text, as train/data/blocks.py tokenize has it: BOS first, EOS last
        full += tokenizer.eos_token or ""
        bos = tokenizer.bos_token if tokenizer.bos_token_id is not None else None
        if bos and not prompt.startswith(bos):
            prompt, full = bos + prompt, bos + full
    if not full.startswith(prompt):
        raise ConfigError(f"{record.where}: its prompt is not the start of its rendering; cannot score its answer")
    answer = full[len(prompt) :]
    asked, ref = question(record), reference(record)
    return HeldOutDoc(
        where=record.where,
        prompt=prompt,
        answer=answer,
        answer_tokens=len(tokenizer(answer, add_special_tokens=False)["input_ids"]),
        answer_bytes=len(answer.encode("utf-8")),
        question=asked,
        reference=ref,
        stop=_stops(answer, ref, tokenizer.eos_token),
    )


def held_out_set(job: JobConfig, tokenizer: Any, repo: Path) -> HeldOutSet:
    """The job's eval.source as documents, rendered with ``tokenizer`` (the run's: its template is the trained one)."""
    if job.eval is None:
        raise ConfigError("the job has no eval section (eval.source): it has no held-out set to evaluate on")
    source = job.eval.source
    records = held_out_records(source, job.data, repo)
    if job.data.format in pairs.PAIR_FORMATS:  # the chosen (desirable) answers, as the held-out loss reads them
        records = pairs.chosen_conversations(records, job.data.format)
        job = job.model_copy(
            update={"data": job.data.model_copy(update={"format": "chat", "columns": {}, "roles": {}})}
        )
    docs = [_doc(record, job, tokenizer) for record in records]
    if not docs:
        raise ConfigError(f"eval.source {source}: no held-out records to evaluate on")
    return HeldOutSet(docs, job.data.format in CHAT_LIKE, source)
