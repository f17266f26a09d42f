"""The Ollama Modelfile (ugro/model/modelfile.py): its TEMPLATE, executed by Go's own text/template the way Ollama
executes it (tests/fixtures/gotemplate/main.go), renders each conversation exactly as the model's Jinja chat
template does with transformers; the derivation is generic (SmolLM2's ChatML with a default system prompt, a
Llama-3 template, a Gemma template without a system role), and a template it cannot express is refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, unavailable

from ugro.model.modelfile import TemplateError, modelfile

GO_SOURCE = REPO / "tests" / "fixtures" / "gotemplate" / "main.go"
Conversation = list[dict[str, str]]
GoRender = Callable[[str, list[Conversation]], list[str]]

# Contents Go must pass through untouched: template syntax, quotes, a backslash, newlines, non-ASCII.
TRICKY = 'What does `{{ .Content }}` print?\nA "quoted" word, a \\ backslash, {% raw %} and ünïcödé ✓'
SYSTEM = {"role": "system", "content": "You answer in one sentence.\nNo lists."}
CONVERSATIONS: list[Conversation] = [
    [{"role": "user", "content": "Which port does the rendezvous use?"}],
    [SYSTEM, {"role": "user", "content": TRICKY}],
    [
        SYSTEM,
        {"role": "user", "content": "Why does rank 1 hang?"},
        {"role": "assistant", "content": "Its firewall drops 29500."},
        {"role": "user", "content": "And the fix?"},
        {"role": "assistant", "content": "Open 29500 between the hosts."},
        {"role": "user", "content": TRICKY},
    ],
    [
        {"role": "user", "content": "Why does rank 1 hang?"},
        {"role": "assistant", "content": "Its firewall drops 29500."},
        {"role": "user", "content": "And the fix?"},
    ],
]
# A conversation that ends with the assistant's turn: Ollama leaves it open for the model to continue.
PREFILL: Conversation = [{"role": "user", "content": "Name the port."}, {"role": "assistant", "content": "It is"}]

LLAMA3 = (  # Meta-Llama-3-8B-Instruct's chat template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (  # gemma-2-2b-it's: no system role, the assistant is "model"
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3 = (  # gemma-3's (text part): the system message goes into the first user turn
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if "
    "loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)
FIRST_TURN_APART = (  # the first turn wrapped unlike the others
    "{% for m in messages %}{% if loop.first %}[first {{ m['role'] }}]{% else %}[{{ m['role'] }}]{% endif %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
SHOUTING = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}\n{% endfor %}"


@pytest.fixture(scope="session")
def go_render(tmp_path_factory: pytest.TempPathFactory) -> GoRender:
    """Go's text/template over .Messages, as Ollama runs a TEMPLATE: the fixture program, built once, offline."""
    go = shutil.which("go")
    if go is None:
        unavailable("no `go` (Debian: apt-get install golang-go): the Modelfile's TEMPLATE is checked with Go's own "
                    "text/template")  # fmt: skip
    build = tmp_path_factory.mktemp("gotemplate")
    env = {**os.environ, "GOCACHE": str(build / "cache"), "GOPATH": str(build / "gopath"), "GOTOOLCHAIN": "local",
           "GOPROXY": "off", "GOFLAGS": "", "CGO_ENABLED": "0"}  # fmt: skip
    binary = build / "gotemplate"
    done = subprocess.run([go, "build", "-o", str(binary), str(GO_SOURCE)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    count = iter(range(1_000_000))

    def render(template: str, conversations: list[Conversation]) -> list[str]:
        path = build / f"template-{next(count)}"
        path.write_text(template, encoding="utf-8")
        ran = subprocess.run([str(binary), str(path)], input=json.dumps(conversations), capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        return list(json.loads(ran.stdout))

    return render


def template_of(text: str) -> str:
    """The TEMPLATE of a Modelfile, as Ollama's parser reads a triple-quoted value."""
    match = re.search(r'^TEMPLATE """(.*?)"""$', text, re.S | re.M)
    assert match, text
    return match[1]


def parameters(text: str) -> list[tuple[str, str]]:
    return re.findall(r'^PARAMETER (\S+) "?(.*?)"?$', text, re.M)


def jinja(tokenizer: Any, messages: Conversation) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def continued(tokenizer: Any, messages: Conversation) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True))


def tokenizer_dir(tmp_path: Path, template: str, specials: tuple[str, ...] = (), **tokens: str) -> Path:
    """The tiny test tokenizer with another chat template (and special tokens), saved with a config as a model
    directory is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "models" / "tiny-llama"))
    if specials:
        tokenizer.add_tokens(list(specials), special_tokens=True)
    for name, value in tokens.items():
        setattr(tokenizer, name, value)
    tokenizer.chat_template = template
    out = tmp_path / "model"
    tokenizer.save_pretrained(str(out))
    shutil.copy(REPO / "models" / "tiny-llama" / "config.json", out / "config.json")
    return out


def test_smollm2_modelfile_renders_in_go_as_its_chat_template(go_render: GoRender, registry: None) -> None:
    from transformers import AutoTokenizer

    from ugro.model.basemodel import ensure

    model = REPO / "models" / "smollm2-135m-instruct"
    ensure(model)
    text = modelfile("model-q4_k_m.gguf", model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rendered = go_render(template_of(text), [*CONVERSATIONS, PREFILL])
    assert rendered[:-1] == [jinja(tokenizer, c) for c in CONVERSATIONS]
    assert rendered[-1] == continued(tokenizer, PREFILL)
    assert "You are a helpful AI assistant named SmolLM" in rendered[0]  # its default system prompt, kept
    assert "You are a helpful AI assistant named SmolLM" not in rendered[1]  # replaced by the conversation's own
    assert text.splitlines()[3] == "FROM ./model-q4_k_m.gguf"
    assert ("stop", "<|im_end|>") in parameters(text) and ("num_ctx", "4096") in parameters(text)
    assert not re.search(r"^SYSTEM", text, re.M)  # the default system prompt lives in the TEMPLATE


def test_a_llama3_template_is_derived_the_same_way(go_render: GoRender, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = tokenizer_dir(
        tmp_path, LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
    )  # fmt: skip
    eot = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids("<|eot_id|>")
    (model / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": [eot]})
    )
    text = modelfile("model-f16.gguf", model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rendered = go_render(template_of(text), [*CONVERSATIONS, PREFILL])
    assert rendered[:-1] == [jinja(tokenizer, c) for c in CONVERSATIONS]
    assert rendered[-1] == continued(tokenizer, PREFILL)
    assert rendered[0].startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")  # no default
    params = parameters(text)
    assert ("stop", "<|eot_id|>") in params and ("stop", "<|start_header_id|>") in params
    assert ("temperature", "0.6") in params and ("top_p", "0.9") in params
    assert ("num_ctx", "1024") in params  # the tiny model's max_position_embeddings, under 4096
    assert "trims the whitespace around each message" in text  # Llama 3's `| trim`, which Go cannot do


def test_a_template_without_a_system_role_takes_a_system_message_as_a_user_turn(
    go_render: GoRender, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model = tokenizer_dir(tmp_path, GEMMA, ("<start_of_turn>", "<end_of_turn>"))
    text = modelfile("model.gguf", model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    alternating = [c for c in CONVERSATIONS if c[0]["role"] != "system"]
    template = template_of(text)
    assert go_render(template, alternating) == [jinja(tokenizer, c) for c in alternating]
    (with_system,) = go_render(template, [[SYSTEM, {"role": "user", "content": "Hi"}]])
    assert with_system == f"<s><start_of_turn>user\n{SYSTEM['content']}<end_of_turn>\n<start_of_turn>user\nHi" \
                          "<end_of_turn>\n<start_of_turn>model\n"  # fmt: skip
    assert "has no system role" in text and ("stop", "<end_of_turn>") in parameters(text)


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (GEMMA3, "a user turn after a system message is wrapped differently"),
        (FIRST_TURN_APART, "a user turn renders differently|the first user turn is wrapped differently"),
        (SHOUTING, "does not render each message's content once and as it is"),
    ],
)
def test_a_template_that_is_not_wrappers_around_each_message_is_refused(
    tmp_path: Path, template: str, why: str
) -> None:
    model = tokenizer_dir(tmp_path, template)
    with pytest.raises(TemplateError, match=why) as refused:
        modelfile("model.gguf", model)
    message = str(refused.value)
    assert str(model / "chat_template.jinja") in message and "needs a hand-written TEMPLATE" in message
