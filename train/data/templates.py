"""Chat templates a job can name for a base model that has none (data.template: chatml, or a Jinja file).

The template is set on the run's tokenizer before any record is rendered, and the tokenizer is saved with the
adapter: `make chat`, the merged model, its GGUF file and the Ollama Modelfile's TEMPLATE (ugro/model/modelfile.py
derives it from the Jinja) all use it. ChatML's turns end with ``<|im_end|>``; where the tokenizer has no such
token (a base model's), the tokenizer's own end-of-sequence token follows it, so that generation stops at the
end of an answer everywhere, without new tokens and embeddings to train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.config import ConfigError, DataConfig

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% if message['role'] == 'assistant' and eos_token and eos_token != '<|im_end|>' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML}
# data.template's values that name no template of their own: the tokenizer's (chat, auto) or none (plain).
OWN = ("auto", "chat", "plain")


def named(template: str, base_dir: Path) -> str | None:
    """The Jinja text data.template names (a known name, or a .jinja file relative to the job's checkout), or None
    where it names none."""
    if template in OWN:
        return None
    if template in NAMED:
        return NAMED[template]
    path = Path(template) if Path(template).is_absolute() else base_dir / template
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"data.template: cannot read the chat template {path} ({exc})") from None
    if "messages" not in text:
        raise ConfigError(f"data.template: {path} is no chat template: it never reads `messages`")
    return text


def apply(tokenizer: Any, cfg: DataConfig, base_dir: Path) -> None:
    """Give ``tokenizer`` the chat template data.template names (unchanged where it names none)."""
    text = named(cfg.template, base_dir)
    if text is not None:
        tokenizer.chat_template = text
