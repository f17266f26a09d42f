"""A chat template for a base model that has none (data.template: chatml, or a Jinja file): the records are
rendered with it, answers end where generation stops, and the tokenizer the run saves carries it, so that `make
chat`, the GGUF export and the Ollama Modelfile's TEMPLATE (derived from it) use it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, small_job
from transformers import AutoTokenizer

from train.config import ConfigError, DataConfig, ModelConfig, load_job
from train.data import templates
from train.data.blocks import IGNORE, tokenize
from train.data.records import Record
from train.model.load import load_tokenizer
from ugro.model import modelfile

CONVERSATION = {"messages": [{"role": "system", "content": "You run a GPU cluster."},
                             {"role": "user", "content": "Which port?"},
                             {"role": "assistant", "content": "29500."}]}  # fmt: skip


def _tokenizer(template: str, base_dir: Path = REPO) -> object:
    tokenizer = load_tokenizer(ModelConfig(source="models/tiny-llama"), REPO)
    assert not getattr(tokenizer, "chat_template", None)  # the base model's tokenizer has none
    templates.apply(tokenizer, DataConfig(source="x.jsonl", format="chat", template=template), base_dir)
    return tokenizer


def test_chatml_renders_the_turns_and_ends_each_answer_with_the_tokenizers_end_of_sequence() -> None:
    tokenizer = _tokenizer("chatml")
    cfg = DataConfig(source="x.jsonl", format="chat", template="chatml")
    ((ids, labels),) = tokenize([Record("c.jsonl:1", CONVERSATION)], cfg, tokenizer)
    text = tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert text == ("<|im_start|>system\nYou run a GPU cluster.<|im_end|>\n<|im_start|>user\nWhich port?<|im_end|>\n"
                    "<|im_start|>assistant\n29500.<|im_end|></s>\n")  # fmt: skip
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE])  # type: ignore[attr-defined]
    assert trained == "29500.<|im_end|></s>\n"  # the answer and its end: generation stops at </s>


def test_the_saved_tokenizer_carries_the_template_and_the_modelfile_derives_from_it(tmp_path: Path) -> None:
    jinja = tmp_path / "turns.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}[assistant] {% endif %}")  # fmt: skip
    for template, opening in (("chatml", "<|im_start|>user\n"), (str(jinja), "[user] ")):
        tokenizer = _tokenizer(template)
        tokenizer.save_pretrained(str(tmp_path / "adapter"))  # type: ignore[attr-defined]
        saved = AutoTokenizer.from_pretrained(str(tmp_path / "adapter"))
        assert saved.chat_template == tokenizer.chat_template  # type: ignore[attr-defined]
        derived = modelfile.derive(saved, "run")
        assert derived.prefix["user"] == opening
        assert "{{ .Content }}" in derived.go()


def test_a_template_that_cannot_be_used_is_refused_naming_the_key(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    for template, message in (
        ("vicuna", "'vicuna' is no template: use auto, chat, plain, chatml or a .jinja file's path"),
        (str(tmp_path / "missing.jinja"), "data.template: cannot read the chat template"),
    ):
        settings = small_job()
        settings["data"]["template"] = template
        job.write_text(yaml.safe_dump(settings))
        with pytest.raises(ConfigError, match=message):
            templates.named(load_job(job).data.template, REPO)
