"""Preference records (data.format preference and unpaired, for train.method dpo, orpo and kto), each normalized to
one shape whatever shape it came in, or refused with one error naming its file and line and the key.

A pair (``Preference``) is a prompt, a list of turns ({role, content}: system, user, assistant) that ends with a
user turn, and two answers, ``chosen`` and ``rejected``, each a list of assistant turns (usually one). The shapes
read (after data.columns and data.roles, train/data/records.py ``map_record``):

* TRL's standard shape: {"prompt": str, "chosen": str, "rejected": str}, optionally with a "system" string (as
  Axolotl writes it): a string prompt is one user turn, a string answer one assistant turn;
* TRL's conversational shape: "prompt", "chosen" and "rejected" lists of messages ({role, content} or {from,
  value}); answers that repeat the prompt's turns first (UltraFeedback's full conversations) have them removed;
* TRL's implicit prompt: "chosen" and "rejected" whole conversations and no "prompt": the prompt is the turns both
  begin with (it must end with a user turn), the answers what follows;
* ShareGPT's (LLaMA-Factory's): "conversations" of {from, value} as the prompt, "chosen" and "rejected" one
  {from, value} message (or a list of them), optionally a "system" string.

An unpaired example (``Unpaired``, data.format unpaired, train.method kto) is a prompt, one completion and whether it
is desirable: TRL's {"prompt", "completion", "label"} (strings or messages), or LLaMA-Factory's {"messages" (or
"conversations"), "label"} whose last (assistant) turn is the completion. A label is true or false; a CSV's
"true"/"false" and 1/0 are read so too. train.method kto on data.format preference reads each pair as two examples,
(prompt, chosen, desirable) then (prompt, rejected, undesirable), pair after pair.

No torch here: the controller checks the data and counts the items before a launch without it;
train/data/pairblocks.py tokenizes the items on the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from train.config import ConfigError, JobConfig
from train.data.records import _KNOWN_ROLES, ROLES, Record, is_chat

__all__ = [
    "NEEDS", "PAIR_FORMATS", "Preference", "Turn", "Unpaired", "check", "examples", "item_count", "items",
    "preference", "prompt_of", "question", "reference", "unpaired",
]  # fmt: skip

Turn = dict[str, str]  # {"role": system | user | assistant, "content": str}
PAIR_FORMATS = ("preference", "unpaired")

NEEDS = {
    "preference": "'prompt', 'chosen' and 'rejected', each a string or a list of {role, content} messages (TRL's "
    "shapes; without 'prompt', 'chosen' and 'rejected' whole conversations that begin with the same prompt), or "
    "ShareGPT's 'conversations' of {from, value} with 'chosen' and 'rejected' {from, value} answers; optionally a "
    "'system' string (docs/data.md, Preference data)",
    "unpaired": "'prompt' and 'completion', each a string or a list of {role, content} messages, and a 'label' "
    "(true: a desirable completion, false: an undesirable one), or 'messages' (ShareGPT's 'conversations') whose "
    "last turn, an assistant's, is the completion the 'label' judges (docs/data.md, Preference data)",
}
_LABELS = {"true": True, "false": False, "1": True, "0": False}


class Preference(NamedTuple):
    """A preference pair: the prompt's turns (ending with a user turn) and two answers of assistant turns."""

    where: str
    prompt: list[Turn]
    chosen: list[Turn]
    rejected: list[Turn]


class Unpaired(NamedTuple):
    """One example of train.method kto: a prompt, a completion of assistant turns, and whether it is desirable."""

    where: str
    prompt: list[Turn]
    completion: list[Turn]
    desirable: bool


class _Reader:
    """One record of ``fmt`` read into turns; every problem is one ConfigError naming the record and the key."""

    def __init__(self, record: Record, fmt: str) -> None:
        self.record, self.fmt, self.row = record, fmt, record.fields

    def bad(self, what: str) -> ConfigError:
        return ConfigError(f"{self.record.where}: {what}; data.format '{self.fmt}' needs {NEEDS[self.fmt]}")

    def turns(self, key: str, default: str) -> list[Turn]:
        """The field ``key`` as turns ([] where it is missing or empty): a string is one ``default`` turn, a message
        object one turn, a list of message objects its turns."""
        value = self.row.get(key)
        if value is None:
            return []
        if isinstance(value, str):
            return [{"role": default, "content": value}] if value.strip() else []
        if isinstance(value, dict):
            return [self.turn(value, f"'{key}'")]
        if not isinstance(value, list):
            raise self.bad(f"'{key}' must be a string or a list of messages, not {type(value).__name__}")
        return [self.turn(turn, f"'{key}' message {n}") for n, turn in enumerate(value, 1)]

    def turn(self, turn: object, what: str) -> Turn:
        if isinstance(turn, dict):
            role_key, content_key = ("role", "content") if "role" in turn or "content" in turn else ("from", "value")
            role, content = turn.get(role_key), turn.get(content_key)
            if isinstance(role, str) and isinstance(content, str):
                name = ROLES.get(role.strip().lower())
                if name is None:
                    raise self.bad(f"{what} has the {role_key} '{role}', which names no chat role ({_KNOWN_ROLES})")
                return {"role": name, "content": content}
        raise self.bad(f"{what} is not an object with string 'role' and 'content' (or ShareGPT's 'from' and 'value')")

    def prompt(self) -> tuple[str, list[Turn]]:
        """The prompt's key ('prompt', or ShareGPT's 'conversations') and its turns ([] where there is none)."""
        for key in ("prompt", "conversations"):
            turns = self.turns(key, "user")
            if turns:
                return key, turns
        return "prompt", []

    def answer(self, key: str, turns: list[Turn]) -> list[Turn]:
        """``turns`` checked as an answer: assistant turns, not all empty."""
        if not any(t["content"].strip() for t in turns):
            raise self.bad(f"'{key}' is missing or empty")
        for n, turn in enumerate(turns, 1):
            if turn["role"] != "assistant":
                where = f"'{key}' message {n}" if len(turns) > 1 else f"'{key}'"
                raise self.bad(f"{where} is a {turn['role']} turn: an answer holds assistant turns only (the "
                               "conversation before it belongs in the prompt)")  # fmt: skip
        return turns

    def finish(self, key: str, prompt: list[Turn]) -> list[Turn]:
        """The prompt with the record's 'system' first, checked to end with a user turn."""
        system = self.row.get("system")
        if system is not None and not isinstance(system, str):
            raise self.bad(f"'system' must be a string (the system prompt), not {type(system).__name__}")
        if system and system.strip():
            if prompt and prompt[0]["role"] == "system":
                raise self.bad(f"'system' and the system turn that begins '{key}' both give the system prompt: keep "
                               "one of the two")  # fmt: skip
            prompt = [{"role": "system", "content": system}, *prompt]
        if not prompt or prompt[-1]["role"] != "user":
            ends = f"ends with {_a(prompt[-1]['role'])} turn" if prompt else "has no turn"
            raise self.bad(f"'{key}' {ends}: a prompt ends with the user turn the answer replies to")
        return prompt

    def label(self) -> bool:
        value = self.row.get("label")
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _LABELS:
            return _LABELS[value.strip().lower()]
        if value is None or value == "":
            raise self.bad("'label' is missing: write true (a desirable completion) or false (an undesirable one)")
        raise self.bad(f"'label' is {value!r}: write true (a desirable completion) or false (an undesirable one); a "
                       "CSV's true, false, 1 and 0 are read so too")  # fmt: skip


def _a(role: str) -> str:
    return f"an {role}" if role == "assistant" else f"a {role}"


def _starts_with(turns: list[Turn], prefix: list[Turn]) -> bool:
    return len(turns) > len(prefix) and turns[: len(prefix)] == prefix


def _common(a: list[Turn], b: list[Turn]) -> int:
    """How many leading turns ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def preference(record: Record) -> Preference:
    """A record of data.format preference as a pair; ConfigError naming the record and the key where it is none."""
    read = _Reader(record, "preference")
    chosen, rejected = read.turns("chosen", "assistant"), read.turns("rejected", "assistant")
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if not turns:
            raise read.bad(f"'{key}' is missing or empty")
    key, prompt = read.prompt()
    asks = [any(t["role"] != "assistant" for t in turns) for turns in (chosen, rejected)]
    if prompt and all(asks) and _starts_with(chosen, prompt) and _starts_with(rejected, prompt):
        chosen, rejected = chosen[len(prompt) :], rejected[len(prompt) :]  # answers that repeat the prompt first
    elif not prompt:
        if not all(asks):  # no conversations to find the prompt in
            raise read.bad("'prompt' is missing or empty")
        shared = _common(chosen, rejected)
        if shared == 0:
            raise read.bad("'prompt' is missing and 'chosen' and 'rejected' begin with different turns, so they share "
                           "no prompt: give the 'prompt', or begin both conversations with it")  # fmt: skip
        if shared == len(chosen) or shared == len(rejected):
            raise read.bad("'chosen' and 'rejected' are the same conversation (or one begins the other): a pair needs "
                           "two answers to the same prompt")  # fmt: skip
        if chosen[shared - 1]["role"] != "user":
            raise read.bad(f"'chosen' and 'rejected' begin with the same {shared} turn{'s' * (shared > 1)}, the last "
                           f"{_a(chosen[shared - 1]['role'])} turn: the prompt they share must end with the user turn "
                           "both answers reply to (give the 'prompt' and the answers apart)")  # fmt: skip
        key, prompt = "chosen", chosen[:shared]
        chosen, rejected = chosen[shared:], rejected[shared:]
    prompt = read.finish(key, prompt)
    return Preference(record.where, prompt, read.answer("chosen", chosen), read.answer("rejected", rejected))


def unpaired(record: Record) -> Unpaired:
    """A record of data.format unpaired as a kto example; ConfigError naming the record and the key where it is
    none."""
    read = _Reader(record, "unpaired")
    row = record.fields
    if row.get("completion") is not None or not is_chat(row):
        answer = "completion"
        completion = read.turns("completion", "assistant")
        if not completion:
            raise read.bad("'completion' is missing or empty")
        key, prompt = read.prompt()
        if not prompt:
            raise read.bad("'prompt' is missing or empty")
        if _starts_with(completion, prompt):
            completion = completion[len(prompt) :]  # a completion that repeats the prompt first
    else:
        key = answer = "messages" if "messages" in row else "conversations"
        turns = read.turns(key, "user")
        if not turns:
            raise read.bad(f"'{key}' is missing or empty")
        if turns[-1]["role"] != "assistant":
            raise read.bad(f"'{key}' ends with a {turns[-1]['role']} turn: its last turn is the completion the "
                           "'label' judges, an assistant turn")  # fmt: skip
        prompt, completion = turns[:-1], turns[-1:]
    prompt = read.finish(key, prompt)
    return Unpaired(record.where, prompt, read.answer(answer, completion), read.label())


def check(record: Record, fmt: str) -> None:
    """Raise the one ConfigError naming the record's file and line (and the key) when it is no item of ``fmt``."""
    if fmt == "preference":
        preference(record)
    else:
        unpaired(record)


def examples(records: Sequence[Record], fmt: str) -> list[Unpaired]:
    """train.method kto's examples: data.format unpaired's records, or the pairs of data.format preference as every
    (prompt, chosen, desirable) first, then every (prompt, rejected, undesirable), as TRL unpairs them: so that the
    KL row of an example (the previous example's completion, train/data/pairblocks.py) is never its own pair's
    other answer."""
    if fmt == "unpaired":
        return [unpaired(r) for r in records]
    pairs = [preference(record) for record in records]
    return [Unpaired(p.where, p.prompt, p.chosen, True) for p in pairs] + [
        Unpaired(p.where, p.prompt, p.rejected, False) for p in pairs
    ]


def items(records: Sequence[Record], job: JobConfig) -> list[Preference] | list[Unpaired]:
    """The job's items in data order: pairs (dpo, orpo) or examples (kto)."""
    if job.train.method == "kto":
        return examples(records, job.data.format)
    return [preference(r) for r in records]


def item_count(records: int, job: JobConfig) -> int:
    """How many items (what train.global_batch_size counts) ``records`` records of the job make: a pair each, or
    for kto on data.format preference two examples each."""
    return records * (2 if job.train.method == "kto" and job.data.format == "preference" else 1)


def prompt_of(record: Record, fmt: str) -> list[Turn]:
    """The prompt's turns of a (checked) record of ``fmt``."""
    return preference(record).prompt if fmt == "preference" else unpaired(record).prompt


def _shape(row: dict[str, Any]) -> str | None:
    """The preference format a record's fields are in, or None (an SFT record)."""
    if "chosen" in row and "rejected" in row:
        return "preference"
    if "label" in row and ("completion" in row or is_chat(row)):
        return "unpaired"
    return None


def _read(record: Record) -> Preference | Unpaired | None:
    shape = _shape(record.fields)
    try:
        return preference(record) if shape == "preference" else unpaired(record) if shape == "unpaired" else None
    except ConfigError:  # not one after all (a chat record with a 'label' of its own): read as SFT
        return None


def question(record: Record) -> str | None:
    """A preference or unpaired record's question, its last user turn; None for another record."""
    found = _read(record)
    return None if found is None else [t["content"] for t in found.prompt if t["role"] == "user"][-1]


def reference(record: Record) -> str | None:
    """A preference or unpaired record's answer to show as the data's: the chosen one, a desirable completion (an
    undesirable one: ""); None for another record."""
    found = _read(record)
    if found is None:
        return None
    if isinstance(found, Preference):
        return "\n".join(t["content"] for t in found.chosen)
    return "\n".join(t["content"] for t in found.completion) if found.desirable else ""


def chosen_conversations(records: Sequence[Record], fmt: str) -> list[Record]:
    """Each pair's prompt and chosen answer (unpaired: each desirable example's) as a chat record, for what reads a
    held-out loss on answers (the GGUF export's check compares it between the merged model and llama.cpp)."""
    if fmt == "unpaired":
        return [Record(e.where, {"messages": e.prompt + e.completion}) for e in map(unpaired, records) if e.desirable]
    return [Record(p.where, {"messages": p.prompt + p.chosen}) for p in map(preference, records)]
