"""An Ollama Modelfile for an exported GGUF file: its chat template, stop tokens and generation defaults.

Ollama renders a conversation with a Go ``text/template`` over ``.Messages``; a Hugging Face model carries a Jinja
chat template. Rather than a table of known families, the Go template is derived from the model's own Jinja
template: it is rendered (transformers' ``apply_chat_template``) on conversations whose contents are sentinels, and
each role's text before and after its content, the generation prompt, and the default system block (what a
template adds when a conversation has no system message) are read off the renderings. The result is checked
against more renderings before it is used; a template these pieces cannot reproduce (its wrappers differ from turn
to turn, it rewrites the contents) is refused with an error that says the Modelfile needs a hand-written TEMPLATE.

The Go template follows Ollama's own convention for a conversation that ends with an assistant message: that turn
is left open (no end-of-turn, no generation prompt), so the model continues it, as transformers'
``continue_final_message`` does. Every other conversation ends with the generation prompt, as
``add_generation_prompt=True``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ugro.model.jsonfile import read_object

NUM_CTX_CAP = 4096  # the context Ollama is given unless the model's own is smaller: a KV cache small GPUs hold
SAMPLING = (  # generation_config.json key -> Ollama PARAMETER
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("repetition_penalty", "repeat_penalty"),
)
ROLES = ("system", "user", "assistant")
HAND_WRITTEN = "https://github.com/ollama/ollama/blob/main/docs/template.md"

Message = dict[str, str]


class TemplateError(ValueError):
    """The chat template cannot be written as an Ollama TEMPLATE over .Messages; the message says why."""


class _Unrendered(TemplateError):
    """The Jinja template raised on a conversation (a role it does not take, an order it refuses)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template as text around each message's content.

    A conversation renders as: ``opening_system`` before the content of a first system message, or else
    ``opening_default`` (the default system block, if the template has one) followed by the first message;
    every other message as ``prefix[role] + content + suffix[role]`` (the last assistant message without its
    suffix); then ``generation`` unless the last message is the assistant's.
    """

    name: str  # where the template comes from, for messages
    opening_system: str
    opening_default: str
    prefix: dict[str, str]  # the system one: for a system message that is not the first
    suffix: dict[str, str]
    generation: str
    default_system: bool  # opening_default holds a system block of the template's own
    # How it takes system messages: "system" anywhere; "first" only first (a later one is rendered like a first
    # one here); "user" not at all (rendered as a user turn here, as Ollama's own Gemma templates do).
    system_role: Literal["system", "first", "user"]
    strips_content: bool  # the template trims the whitespace around a message's content

    def render(self, messages: Sequence[Message]) -> str:
        """What the Go template renders (the same rules, in Python): the reference the derivation is checked with."""
        out = []
        if not messages or messages[0]["role"] != "system":
            out.append(self.opening_default)
        for i, message in enumerate(messages):
            role, last = message["role"], i == len(messages) - 1
            if role not in ROLES:
                continue
            out.append(self.opening_system if role == "system" and i == 0 else self.prefix[role])
            out.append(message["content"])
            if not (last and role == "assistant"):
                out.append(self.suffix[role])
            if last and role != "assistant":
                out.append(self.generation)
        return "".join(out)

    def go(self) -> str:
        """The Go text/template Ollama executes with ``.Messages``; literal text is always inside ``{{ "..." }}``
        actions, so the ``{{-`` trim markers that lay the template out never eat a newline of the model's."""

        def text(value: str) -> str:
            return "{{ " + _go_string(value) + " }}" if value else ""

        def closing(role: str) -> str:
            return text(self.suffix[role])

        first_system = text(self.opening_system)
        other_system = text(self.prefix["system"])
        system_prefix = (
            first_system
            if first_system == other_system
            else f"{{{{ if eq $i 0 }}}}{first_system}{{{{ else }}}}{other_system}{{{{ end }}}}"
        )
        assistant_end = closing("assistant")
        lines = [
            '{{- if or (not .Messages) (ne (index .Messages 0).Role "system") }}'
            + text(self.opening_default)
            + "{{ end }}",
            "{{- range $i, $_ := .Messages }}",
            "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
            '{{- if eq .Role "system" }}' + system_prefix + "{{ .Content }}" + closing("system"),
            '{{- else if eq .Role "user" }}' + text(self.prefix["user"]) + "{{ .Content }}" + closing("user"),
            '{{- else if eq .Role "assistant" }}'
            + text(self.prefix["assistant"])
            + "{{ .Content }}"
            + (f"{{{{ if not $last }}}}{assistant_end}{{{{ end }}}}" if assistant_end else ""),
            "{{- end }}",
            '{{- if and $last (ne .Role "assistant") }}' + text(self.generation) + "{{ end }}",
            "{{- end }}",
        ]
        return "\n".join(lines)


def derive(tokenizer: Any, name: str) -> ChatTemplate:
    """The tokenizer's chat template as a ChatTemplate; TemplateError when it cannot be one."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(f"{name}: the tokenizer has no chat template, so there is no TEMPLATE to write")

    def render(messages: Sequence[Message], generation: bool = False, **kwargs: Any) -> str:
        try:
            return str(tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation, **kwargs
            ))  # fmt: skip
        except Exception as exc:  # jinja2's errors, and the template's own raise_exception
            raise _Unrendered(_refusal(name, f"it does not render {_shape(messages)}: {exc}")) from None

    def gaps(messages: Sequence[Message], generation: bool = False) -> list[str]:
        return _gaps(render(messages, generation), [m["content"] for m in messages], name)

    def fail(why: str) -> TemplateError:
        return TemplateError(_refusal(name, why))

    user, assistant, system = _say("user", 1), _say("assistant", 2), _say("system", 0)
    user2, system2 = _say("user", 3), _say("system", 4)

    opening_user, user_end = gaps([user])
    with_prompt = render([user], generation=True)
    without = render([user])
    if not with_prompt.startswith(without):
        raise fail("the generation prompt is not added at the end of the conversation")
    generation = with_prompt[len(without) :]

    first, between, assistant_end = gaps([user, assistant])
    if first != opening_user or not between.startswith(user_end):
        raise fail("a user turn renders differently when an assistant turn follows it")
    assistant_prefix = between[len(user_end) :]
    *_, turn, end = gaps([user, assistant, user2])
    if not turn.startswith(assistant_end) or end != user_end:
        raise fail("an assistant turn renders differently when a user turn follows it")
    user_prefix = turn[len(assistant_end) :]
    if not opening_user.endswith(user_prefix):
        raise fail("the first user turn is wrapped differently from the later ones")
    opening_default = opening_user[: len(opening_user) - len(user_prefix)]

    system_role: Literal["system", "first", "user"] = "system"
    try:
        opening_system, after_system, end = gaps([system, user])
    except _Unrendered:  # a template without a system role (Gemma's raises): a system message goes as a user turn
        system_role = "user"
        opening_system, system_prefix, system_end = opening_user, user_prefix, user_end
    else:
        if not after_system.endswith(user_prefix) or end != user_end:
            raise fail("a user turn after a system message is wrapped differently from the others")
        system_end = after_system[: len(after_system) - len(user_prefix)]
        system_prefix = opening_system  # a system message after the first turn: as a first one, if the template
        try:  # refuses it; else as it renders one
            _, _, middle, after, _ = gaps([user, assistant, system2, user2])
        except _Unrendered:
            system_role = "first"
        else:
            if not middle.startswith(assistant_end) or after != system_end + user_prefix:
                raise fail("a system message after the first turn is wrapped differently from the others")
            system_prefix = middle[len(assistant_end) :]

    template = ChatTemplate(
        name=name,
        opening_system=opening_system,
        opening_default=opening_default,
        prefix={"system": system_prefix, "user": user_prefix, "assistant": assistant_prefix},
        suffix={"system": system_end, "user": user_end, "assistant": assistant_end},
        generation=generation,
        # More than the preamble every conversation starts with (a BOS token): a system block of its own.
        default_system=not opening_system.startswith(opening_default),
        system_role=system_role,
        strips_content=False,
    )
    _check(template, render, fail)
    padded = {"role": "user", "content": f"  {_say('user', 5)['content']}\n"}
    return dataclasses.replace(template, strips_content=padded["content"] not in render([padded], generation=True))


def _check(template: ChatTemplate, render: Callable[..., str], fail: Callable[[str], TemplateError]) -> None:
    """The derived pieces must reproduce the Jinja template on conversations they were not read from."""
    s, u1, a1, u2, a2, u3 = (_say(r, n) for r, n in zip(
        ("system", "user", "assistant", "user", "assistant", "user"), range(10, 16), strict=True
    ))  # fmt: skip
    probes = [[u1], [u1, a1, u2], [u1, a1, u2, a2, u3]]
    if template.system_role != "user":
        probes += [[s, u1], [s, u1, a1, u2], [s, u1, a1, u2, a2, u3]]
    if template.system_role == "system":
        probes.append([u1, a1, s, u2])
    for messages in probes:
        if template.render(messages) != render(messages, generation=True):
            raise fail(f"its rendering of {_shape(messages)} is not the same wrappers around each message")
    try:
        expected = render([u1, a1], continue_final_message=True)
    except _Unrendered:
        return  # a template that cannot continue a final message: nothing to compare the open assistant turn with
    if template.render([u1, a1]) != expected:
        raise fail("a conversation that ends with the assistant's turn does not end with that turn's content")


def _say(role: str, n: int) -> Message:
    """A message whose content appears nowhere in any template."""
    return {"role": role, "content": f"ugro-{role}-sentinel-{n}-c0ffee"}


def _shape(messages: Sequence[Message]) -> str:
    return "a conversation of " + (" + ".join(m["role"] for m in messages) or "no messages")


def _gaps(rendered: str, contents: Sequence[str], name: str) -> list[str]:
    """The text between the contents, in order: before the first, between each two, after the last."""
    out, at = [], 0
    for content in contents:
        found = rendered.find(content, at)
        if found < 0 or rendered.count(content) != 1:
            why = "it does not render each message's content once and as it is (it rewrites or repeats them)"
            raise TemplateError(_refusal(name, why))
        out.append(rendered[at:found])
        at = found + len(content)
    out.append(rendered[at:])
    return out


def _refusal(name: str, why: str) -> str:
    return (
        f"the chat template of {name} cannot be written as an Ollama TEMPLATE over .Messages: {why}. "
        f"The Modelfile needs a hand-written TEMPLATE ({HAND_WRITTEN})"
    )


def _go_string(value: str) -> str:
    """``value`` as a Go interpreted string literal (JSON's escapes are Go's; no ``\\/``, no surrogate pairs)."""
    return json.dumps(value, ensure_ascii=False)


def template_name(model_dir: Path) -> str:
    """Where the directory's chat template is kept, for messages."""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            return str(model_dir / name)
    return str(model_dir)


# --------------------------------------------------------------------------------------------------
# The Modelfile


def _special_tokens(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = [str(t) for t in added.values() if getattr(t, "special", False)]
    return sorted({*tokens, *map(str, getattr(tokenizer, "all_special_tokens", []) or [])}, key=len, reverse=True)


def _leading_special(text: str, specials: Sequence[str]) -> str | None:
    stripped = text.lstrip()
    return next((t for t in specials if t and stripped.startswith(t)), None)


def stop_tokens(tokenizer: Any, template: ChatTemplate, generation_config: dict[str, Any]) -> list[tuple[str, str]]:
    """(stop string, why): the end of an assistant turn and the start of the next one in the chat template (their
    special token, or the end's text where it is no special token), the eos tokens of generation_config.json and the
    tokenizer's eos token; each once, with every reason it has."""
    specials = _special_tokens(tokenizer)
    found: dict[str, list[str]] = {}
    end = _leading_special(template.suffix["assistant"], specials) or template.suffix["assistant"].strip()
    if end:
        found.setdefault(end, []).append("ends an assistant turn in the chat template")
    start = _leading_special(template.prefix["user"], specials)
    if start:
        found.setdefault(start, []).append("starts the next user turn in the chat template")
    eos = generation_config.get("eos_token_id")
    ids = [int(i) for i in (eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])]
    for token in tokenizer.convert_ids_to_tokens(ids) if ids else []:
        if token:
            found.setdefault(str(token), []).append("eos_token_id of generation_config.json")
    if getattr(tokenizer, "eos_token", None):
        found.setdefault(str(tokenizer.eos_token), []).append("the tokenizer's eos_token")
    return [(token, "; ".join(why)) for token, why in found.items()]


def _quoted(value: str) -> str:
    return f'"""{value}"""' if '"' in value else f'"{value}"'


def modelfile(gguf_name: str, model_dir: Path, *, num_ctx: int | None = None, greedy: bool = False) -> str:
    """The Modelfile text for ``gguf_name`` (a file beside the Modelfile) of the model in ``model_dir``: the
    directory the GGUF file was converted from, holding the tokenizer with its chat template, config.json and
    generation_config.json (the merged model). ``num_ctx``: the context length to give Ollama; by default
    min(4096, the model's max_position_embeddings). ``greedy``: the job answers greedily (its held-out samples,
    ``make chat``), so Ollama's temperature is 0 whatever generation_config.json says. Raises TemplateError where
    the chat template cannot be derived (the caller may then write the Modelfile without a TEMPLATE and say so)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    template = derive(tokenizer, template_name(model_dir))
    config = read_object(model_dir / "config.json")
    generation = read_object(model_dir / "generation_config.json")
    lines = [
        f"# Ollama Modelfile for {gguf_name}, written by ugro (ugro/model/modelfile.py).",
        "# Use: ollama create <name> -f Modelfile  (in this directory), then ollama run <name>",
        "",
        f"FROM ./{gguf_name}",
        "",
        f"# The model's own chat template, {_shown(Path(template.name), model_dir)},",
        "# translated into Ollama's Go template over .Messages (ugro derives it from renderings of the template and",
        "# checks it against them). A conversation that ends with an assistant message leaves that turn open for",
        "# the model to continue.",
    ]
    if template.default_system:
        lines += [
            "# When a conversation has no system message, the template's default system prompt is rendered, as the",
            "# chat template does; there is no SYSTEM line, so a system message of your own replaces it.",
        ]
    if template.system_role == "first":
        lines.append("# The chat template takes a system message only first; a later one is wrapped like a first one.")
    elif template.system_role == "user":
        lines.append("# The chat template has no system role (it refuses one); a system message goes as a user turn.")
    if template.strips_content:
        lines.append("# The chat template trims the whitespace around each message's content; here it is kept.")
    lines += [f'TEMPLATE """{template.go()}"""', ""]
    for stop, why in stop_tokens(tokenizer, template, generation):
        lines += [f"# stop: {why}", f"PARAMETER stop {_quoted(stop)}"]
    lines.append("")
    lines += _generation_defaults(generation, config, num_ctx, greedy)
    return "\n".join(lines).rstrip() + "\n"


def _shown(path: Path, model_dir: Path) -> str:
    """The template's file as seen from beside the model directory (merged/chat_template.jinja)."""
    return str(path.relative_to(model_dir.parent)) if path.is_relative_to(model_dir.parent) else str(path)


def _generation_defaults(
    generation: dict[str, Any], config: dict[str, Any], num_ctx: int | None, greedy: bool
) -> list[str]:
    lines = []
    if greedy:
        lines += ["# temperature 0: the job answers greedily (its held-out samples, make chat)"]
        lines += ["PARAMETER temperature 0"]
    elif generation.get("do_sample") is False:
        lines += ["# temperature 0: generation_config.json sets do_sample false (greedy)", "PARAMETER temperature 0"]
    carried = [(key, param) for key, param in SAMPLING if generation.get(key) is not None]
    for key, param in carried:
        if param == "temperature" and (greedy or generation.get("do_sample") is False):
            continue
        lines += [f"# {param}: generation_config.json {key}", f"PARAMETER {param} {generation[key]}"]
    if not carried and generation.get("do_sample") is not False and not greedy:
        lines.append("# generation_config.json sets no sampling defaults (temperature, top_p, top_k, "
                     "repetition_penalty): Ollama's own apply")  # fmt: skip
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    longest = config.get("max_position_embeddings") or (text_config or {}).get("max_position_embeddings")
    if num_ctx is not None:
        lines.append(f"# num_ctx: as asked (config.json max_position_embeddings: {longest or 'not given'})")
        value = num_ctx
    elif isinstance(longest, int):
        value = min(NUM_CTX_CAP, longest)
        lines.append(f"# num_ctx: the smaller of {NUM_CTX_CAP} and config.json max_position_embeddings ({longest})")
    else:
        value = NUM_CTX_CAP
        lines.append(f"# num_ctx: {NUM_CTX_CAP}, config.json gives no max_position_embeddings")
    lines.append(f"PARAMETER num_ctx {value}")
    return lines
