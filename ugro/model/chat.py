"""``make chat [JOB_ID=...]``: talk to a run's model in the terminal.

Runs on the controller over a collected run: the adapter (runs/<job-id>/adapter) on its base with transformers +
peft, on the controller's GPU when it has one, else its CPU. Each line typed is answered greedily, the whole
conversation so far in the model's chat template, and the answer is streamed as it is produced. ``/base`` switches
the adapter off, so the same question can be put to the base model alone; ``/tuned`` switches it back on.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import torch

from train.config import ConfigError
from ugro.model.merge import base_of, load_tuned

COMMANDS = """\
  /base   the base model alone (adapter off)    /tuned  the fine-tuned model (adapter on)
  /reset  forget the conversation               /quit   end (Ctrl-D too)"""


class _Stop:
    """A stopping criterion generate checks after every token: ``event.set()`` ends the answer (Ctrl-C)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class Conversation:
    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, system: str | None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.system = [{"role": "system", "content": system}] if system else []
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        self.history: list[dict[str, str]] = []
        self.tuned = True
        self.dropped = False  # whether the user was told that the oldest turns are left out

    def prompt(self, question: str) -> Any:
        """The chat-templated conversation and question, its oldest exchanges dropped until the answer fits the
        model's context; None (and the conversation left as it is) when the question alone does not fit."""
        kept = self.history
        while True:
            messages = [*self.system, *kept, {"role": "user", "content": question}]
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
            )
            length = prompt["input_ids"].shape[1]
            if self.context is None or length + self.max_new_tokens <= self.context:
                break
            if not kept:
                print(f"(too long: {length} tokens of prompt + {self.max_new_tokens} to answer > {self.context})")
                return None
            kept = kept[2:]  # without the oldest question and its answer
        if len(kept) < len(self.history) and not self.dropped:
            print(
                f"(the conversation outgrew the model's context of {self.context} tokens: its oldest turns "
                "are left out from now on; /reset starts afresh)"
            )
            self.dropped = True
        self.history = kept
        return prompt.to(self.model.device)

    def answer(self, question: str) -> None:
        """Stream the answer to ``question`` to stdout and keep both in the history; Ctrl-C stops it, unkept."""
        from transformers import StoppingCriteriaList, TextIteratorStreamer

        prompt = self.prompt(question)
        if prompt is None:
            return
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        stop = _Stop()
        failed: list[Exception] = []

        def generate() -> None:
            try:
                with contextlib.nullcontext() if self.tuned else self.model.disable_adapter():
                    self.model.generate(
                        **prompt,
                        streamer=streamer,
                        max_new_tokens=self.max_new_tokens,
                        do_sample=False,
                        stopping_criteria=StoppingCriteriaList([stop]),
                    )
            except Exception as exc:  # re-raised below; end the stream so the reader is not left waiting
                failed.append(exc)
                streamer.end()

        thread = threading.Thread(target=generate, daemon=True)
        print("tuned> " if self.tuned else "base> ", end="", flush=True)
        text = ""
        thread.start()
        try:
            for piece in streamer:
                print(piece, end="", flush=True)
                text += piece
        except KeyboardInterrupt:
            stop.event.set()
            thread.join()
            print("\n(stopped; this question and its answer are not kept)")
            return
        thread.join()
        print()
        if failed:
            raise failed[0]
        self.history += [{"role": "user", "content": question}, {"role": "assistant", "content": text.strip()}]

    def command(self, line: str) -> bool:
        """Carry out a /command; False when it ends the chat."""
        if line in ("/quit", "/exit"):
            return False
        if line in ("/base", "/tuned"):
            self.tuned = line == "/tuned"
            print("(the base model alone: adapter off)" if line == "/base" else "(the fine-tuned model: adapter on)")
        elif line == "/reset":
            self.history.clear()
            self.dropped = False
            print("(conversation forgotten)")
        else:
            print(f"unknown command {line}; the commands:\n{COMMANDS}")
        return True


def _load(adapter: Path, base: Path) -> tuple[Any, Any]:
    from transformers.utils import logging

    logging.set_verbosity_error()  # the terminal is the chat's: no loading bars, no tokenizer notices
    logging.disable_progress_bar()
    model, tokenizer = load_tuned(adapter, base)
    return model.to("cuda" if torch.cuda.is_available() else "cpu"), tokenizer


def _shown(path: Path, repo: Path) -> str:
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def chat(run_dir: Path, repo: Path, *, max_new_tokens: int, system: str | None) -> int:
    """The chat with the run's model, until /quit, Ctrl-D or Ctrl-C at the prompt; the exit code."""
    adapter = run_dir / "adapter"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run (the runs are in {run_dir.parent})")
    if not adapter.is_dir():
        raise ConfigError(
            f"{adapter}: no adapter here: the run has not finished, or its results are still on its hosts "
            f"(`make logs JOB_ID={run_dir.name}` collects them)"
        )
    base = base_of(adapter, repo)  # before the slow imports: a refusal comes at once
    print(f"loading run {run_dir.name}: its adapter on {_shown(base, repo)} ...", flush=True)
    model, tokenizer = _load(adapter, base)
    conversation = Conversation(model, tokenizer, max_new_tokens, system)
    where = f"{_shown(base, repo)} + its adapter on {model.device.type}"
    print(f"run {run_dir.name}: {where}, greedy answers of {max_new_tokens} tokens at most")
    print(COMMANDS)
    with contextlib.suppress(ImportError):  # a Python built without readline: plain input()
        import readline  # noqa: F401  (its import gives input() line editing and history)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line.startswith("/"):
            if not conversation.command(line):
                return 0
            continue
        conversation.answer(line)
