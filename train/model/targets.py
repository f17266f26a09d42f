"""Which layers of the base get LoRA: the job's ``lora.target_modules`` made concrete for one model.

The ranks resolve it on the loaded base before peft or unsloth sees it; the controller runs the same
function on the model built from its config on the meta device (no weights), so a misspelt name is
refused before launch. A name matches as peft matches a list entry: a module's full dotted name equals
it or ends with ``.`` + it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from torch import nn

from train.config import ConfigError

ALL_LINEAR = "all-linear"
FIX = "fix the name or leave lora.target_modules out to adapt every linear layer but the head"


def _linear_classes() -> tuple[type[nn.Module], ...]:
    """nn.Linear (bitsandbytes' Linear4bit is one) and transformers' Conv1D (GPT-2's fused layers)."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _wrappable_classes() -> tuple[type[nn.Module], ...]:
    """The layers peft's LoRA can wrap when a job names them."""
    return (*_linear_classes(), nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def matches(name: str, target: str) -> bool:
    """Whether the module called ``name`` is one that the list entry ``target`` names, as peft decides it."""
    return name == target or name.endswith("." + target)


def _head_name(model: nn.Module) -> str | None:
    """The dotted name of the output head (``model.get_output_embeddings()``), when the model has one."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return next((name for name, module in model.named_modules() if module is head), None)


def linear_layers(model: nn.Module) -> list[str]:
    """The dotted names of every linear layer of ``model`` but its output head."""
    head = _head_name(model)
    linear = _linear_classes()
    return [name for name, module in model.named_modules() if isinstance(module, linear) and name != head]


def _suffixes(names: list[str], every: Iterable[str]) -> list[str]:
    """Short names for exactly ``names``: the last part of each dotted name where that part names no other
    module of ``every`` (all module names), else the full dotted name."""
    chosen = set(names)
    others = [n for n in every if n not in chosen]
    short: set[str] = set()
    for name in names:
        last = name.rsplit(".", 1)[-1]
        short.add(last if not any(matches(other, last) for other in others) else name)
    return sorted(short)


def _where(model: nn.Module, source: str) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return f"{source} (model_type {model_type})" if model_type else source


def _problems(model: nn.Module, targets: list[str]) -> tuple[list[str], list[str]]:
    """Every named target that no module matches, and every one that matches a layer LoRA cannot wrap."""
    modules = dict(model.named_modules())
    wrappable = _wrappable_classes()
    missing: list[str] = []
    unwrappable: list[str] = []
    for target in targets:
        found = [module for name, module in modules.items() if name and matches(name, target)]
        if not found:
            missing.append(repr(target))
        bad = sorted({type(m).__name__ for m in found if not isinstance(m, wrappable)})
        if bad:
            unwrappable.append(f"{target!r} is a {'/'.join(bad)}")
    return missing, unwrappable


def _refusal(model: nn.Module, named: list[str], where: str) -> str | None:
    """Why the job's list of target modules does not fit ``model`` (every bad name in one line), or None."""
    missing, unwrappable = _problems(model, named)
    problems = []
    if missing:
        verb = "is not a module" if len(missing) == 1 else "are not modules"
        problems.append(f"{', '.join(missing)} {verb} of {where}")
    if unwrappable:
        within = "" if missing else f" in {where}"  # the model is named once
        problems.append(f"{', '.join(unwrappable)}{within}, not a layer LoRA can wrap (linear, embedding, conv)")
    return "; ".join(problems) or None


def resolve(model: nn.Module, targets: list[str] | Literal["all-linear"], source: str) -> list[str]:
    """The concrete, sorted module names LoRA goes on in ``model``; ConfigError naming every bad target.

    ``all-linear`` is every linear layer (nn.Linear, Conv1D) but the output head, like peft's shorthand, as the
    shortest names that match exactly those layers; a list is checked: every name must match a module, and each
    module it matches must be one LoRA can wrap (the head named explicitly is one).
    """
    layers = linear_layers(model)
    known = _suffixes(layers, (name for name, _ in model.named_modules() if name))
    where = _where(model, source)
    if targets == ALL_LINEAR:
        if not layers:
            raise ConfigError(f"lora.target_modules: {where} has no linear layer but its head; name the modules")
        return known
    problem = _refusal(model, list(targets), where)
    if problem:
        head = _head_name(model)
        listing = ", ".join(known) + (f" (and the head, {head})" if head else "")
        raise ConfigError(f"lora.target_modules: {problem}; its linear layers are: {listing}; {FIX}")
    return sorted(set(targets))
