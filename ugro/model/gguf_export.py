"""``make export FORMAT=gguf``: the run's merged model as GGUF files, written by llama.cpp's own tools.

f16 and q8_0 come from llama.cpp's converter (``convert_hf_to_gguf.py``, from the cached build of
ugro/model/llamacpp.py) run on the merged safetensors; q4_k_m is quantized from the f16 file by llama.cpp's
``llama_model_quantize`` through its Python binding. The converter writes the tokenizer and the chat template
into the GGUF metadata. An architecture the converter does not know is refused before anything is merged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from train.config import ConfigError, JobConfig
from ugro.model import gguf_check, llamacpp
from ugro.model.basemodel import ModelError
from ugro.model.llamacpp import LlamaCpp

# What the converter writes itself, and what llama.cpp's quantizer makes from the f16 file.
CONVERTED = ("f32", "f16", "bf16", "q8_0")
QUANTIZED = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}
TYPES = (*CONVERTED, *QUANTIZED)
DEFAULT_TYPES = ("f16", "q8_0", "q4_k_m")

# Lists the architectures the vendored converter registers (run with its source tree first on sys.path).
_LIST_ARCHITECTURES = """
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
from conversion import TEXT_MODEL_MAP
print(json.dumps(sorted(TEXT_MODEL_MAP)))
"""


def parse_types(text: str) -> tuple[str, ...]:
    """``f16,q8_0`` -> the types, each checked against what ugro can write."""
    types = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    unknown = [t for t in types if t not in TYPES]
    if not types or unknown:
        raise ConfigError(
            f"QUANT={text!r}: {', '.join(unknown) or 'no type'} is not a GGUF type ugro writes; "
            f"choose from {', '.join(TYPES)} (comma-separated)"
        )
    return types


def _converter_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter uses the gguf-py it was written against
    return env


def supported_architectures(llama: LlamaCpp) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _LIST_ARCHITECTURES, str(llama.source)],
        capture_output=True, text=True, timeout=300, env=_converter_env(), check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise ModelError(f"llama.cpp's converter in {llama.source} does not load: {done.stderr.strip()[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def check_architecture(model_dir: Path, llama: LlamaCpp) -> str:
    """The model's architecture, if llama.cpp's converter knows it; else a ConfigError saying so."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = model_dir / "config.json"
    facts = json.loads(config.read_text())
    # A merged model's config names its class; a base converted from a GGUF names only its model_type.
    named = (facts.get("architectures") or [""])[0]
    arch = str(named or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(facts.get("model_type")))
    if arch == "None":
        raise ConfigError(f"{config}: neither 'architectures' nor a known 'model_type': which model is this?")
    known = supported_architectures(llama)
    if arch not in known:
        near = [k for k in known if k.lower().startswith(arch.lower()[:5])][:6]
        raise ConfigError(
            f"{config}: llama.cpp's converter (llama-cpp-python {llama.root.name.split('-')[0]}) does not support "
            f"the architecture {arch}, so there is no GGUF export for this model"
            + (f" (it knows {', '.join(near)}, ...)" if near else "")
            + "; `make export` without FORMAT still writes the merged safetensors model"
        )
    return arch


def convert(model_dir: Path, target: Path, kind: str, llama: LlamaCpp) -> Path:
    """One GGUF file of ``kind`` (f16, q8_0, ...) from a transformers model directory, by llama.cpp's converter."""
    partial = target.with_suffix(".partial")
    cmd = [sys.executable, str(llama.converter), str(model_dir), "--outfile", str(partial), "--outtype", kind]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=_converter_env(), check=False)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise ModelError(f"llama.cpp's converter failed on {model_dir} ({kind}):\n{tail}")
    os.replace(partial, target)
    return target


def quantize(source: Path, target: Path, kind: str, llama: LlamaCpp) -> Path:
    """``kind`` (q4_k_m, ...) from an f16 GGUF, by llama.cpp's quantizer."""
    lib = llama.binding()
    from llama_cpp._utils import suppress_stdout_stderr

    partial = target.with_suffix(".partial")
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANTIZED[kind])
    params.nthread = os.cpu_count() or 1
    with suppress_stdout_stderr(disable=False):  # a line per tensor, and one per fallback type
        status = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise ModelError(f"llama.cpp's quantizer failed ({kind} from {source.name}, status {status})")
    os.replace(partial, target)
    return target


def write(
    model_dir: Path, out: Path, stem: str, types: Sequence[str], llama: LlamaCpp, log: Callable[[str], object] = print
) -> dict[str, Path]:
    """``out/<stem>-<type>.gguf`` for every requested type; quantized ones from the f16 file (written too)."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    needs_f16 = "f16" in types or any(t in QUANTIZED for t in types)
    for kind in [t for t in CONVERTED if t in types or (t == "f16" and needs_f16)]:
        log(f"converting to {kind} with llama.cpp's convert_hf_to_gguf.py")
        files[kind] = convert(model_dir, out / f"{stem}-{kind}.gguf", kind, llama)
    for kind in [t for t in QUANTIZED if t in types]:
        log(f"quantizing to {kind} with llama.cpp's llama_model_quantize")
        files[kind] = quantize(files["f16"], out / f"{stem}-{kind}.gguf", kind, llama)
    return files


@dataclass
class GgufExport:
    out: Path
    files: dict[str, Path]
    reference_loss: float
    reports: list[gguf_check.FileReport]
    modelfile: Path | None
    modelfile_note: str | None  # why there is no Modelfile (a chat template Ollama's syntax cannot express)

    @property
    def passed(self) -> bool:
        return all(report.passed for report in self.reports)


def job_of(run_dir: Path) -> JobConfig:
    """The job the run trained with, as its main rank recorded it in run.json."""
    status = run_dir / "run.json"
    recorded = json.loads(status.read_text()).get("job") if status.is_file() else None
    if not recorded:
        raise ConfigError(
            f"{status}: the run did not record its job (runs before the GGUF export did not), so its held-out data "
            "for the checks is unknown; pass --job with the job file it trained with"
        )
    try:
        return JobConfig.model_validate(recorded)
    except ValidationError as exc:
        raise ConfigError(f"{status}: its 'job' is not a job this version reads: {exc}") from None


def run_checks(
    files: dict[str, Path], merged: Path, job: JobConfig, repo: Path, llama: LlamaCpp, questions: int | None = None
) -> tuple[float, list[gguf_check.FileReport]]:
    """ugro/model/gguf_check.py on every file, in a process of its own (llama.cpp aborts on a malformed file)."""
    spec = {"files": {k: str(v) for k, v in files.items()}, "merged": str(merged), "repo": str(repo),
            "job": job.model_dump(mode="json"), "llama": str(llama.root), "questions": questions}  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=merged.parent) as fh:
        fh.write(json.dumps(spec))
        fh.flush()
        # GGML_NO_BACKTRACE: on an abort, ggml would otherwise attach gdb to print a backtrace (minutes).
        env = os.environ | {"GGML_NO_BACKTRACE": "1"}
        done = subprocess.run([sys.executable, "-m", "ugro.model.gguf_check", fh.name],
                              capture_output=True, text=True, timeout=3600, env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        raise ModelError(
            f"llama.cpp could not use the GGUF files (the checks ended with exit {done.returncode}); nothing was "
            f"removed from {next(iter(files.values())).parent}:\n{tail}"
        )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return float(report["reference_loss"]), [gguf_check.FileReport.from_dict(r) for r in report["files"]]


def _current(merged: Path, adapter: Path) -> bool:
    weights = merged / "model.safetensors"
    newest = max(p.stat().st_mtime for p in adapter.iterdir())
    return weights.is_file() and weights.stat().st_mtime >= newest


def export(
    run_dir: Path,
    repo: Path,
    types: Sequence[str] = DEFAULT_TYPES,
    job: JobConfig | None = None,
    log: Callable[[str], object] = print,
    questions: int | None = None,
) -> GgufExport:
    """runs/<id>/gguf: the GGUF files, their checks (check.json), an Ollama Modelfile and the model card."""
    from ugro.model import card, merge, modelfile

    adapter = run_dir / "adapter"
    base = merge.base_of(adapter, repo)  # refusals first, before anything slow
    job = job or job_of(run_dir)
    llama = llamacpp.ensure(log)
    check_architecture(base, llama)
    merged = run_dir / "merged"
    if not _current(merged, adapter):
        log(f"merging the adapter into its base: {merged}")
        merge.export(adapter, merged, repo)
    if not (merged / "README.md").is_file():
        card.write_card(merged, run_dir, repo, artifact="merged", files=merge.listing(merged))
    out = run_dir / "gguf"
    files = write(merged, out, run_dir.name, types, llama, log)
    log("checking every file with transformers' GGUF loader and with llama.cpp")
    reference, reports = run_checks(files, merged, job, repo, llama, questions)
    record = {"reference_loss": reference, "files": [r.to_dict() for r in reports]}
    (out / "check.json").write_text(json.dumps(record, indent=1) + "\n")
    chosen = next(files[kind] for kind in (*PREFERRED, *files) if kind in files)
    path = out / "Modelfile"
    target: Path | None = path
    note: str | None = None
    try:
        path.write_text(modelfile.modelfile(chosen.name, merged, greedy=True))  # as the run judged its samples
    except modelfile.TemplateError as exc:  # the GGUF files stand; only Ollama's TEMPLATE needs a hand
        path.unlink(missing_ok=True)
        target, note = None, str(exc)
    result = GgufExport(out, files, reference, reports, target, note)
    listing = [(path.name, DESCRIBE.get(kind, kind)) for kind, path in files.items()]
    listing += [("check.json", "the checks below, every figure"), ("README.md", "this card")]
    if target is not None:
        listing.append(("Modelfile", f"Ollama: `ollama create <name> -f Modelfile` (FROM the {chosen.name})"))
    card.write_card(out, run_dir, repo, artifact="gguf", files=listing, extra=[("GGUF checks", table(result))])
    return result


PREFERRED = ("q8_0", "q4_k_m", "f16")  # what the Modelfile loads: the smallest file that answers like the model
DESCRIBE = {
    "f32": "32-bit float, exactly the merged model",
    "f16": "16-bit float: the merged weights rounded to f16 (norms f32)",
    "bf16": "bfloat16",
    "q8_0": "8-bit (Q8_0): half of f16's size, held-out loss within 1 %",
    "q4_k_m": "4-bit (Q4_K_M, llama.cpp's quantizer)",
    "q5_k_m": "5-bit (Q5_K_M, llama.cpp's quantizer)",
}


def table(result: GgufExport) -> str:
    """The checks as a markdown table (the model card's and the docs')."""
    lines = [
        f"Against transformers on the merged model (held-out loss {result.reference_loss:.4f}): llama.cpp loads "
        "every file, scores the held-out rows and answers the held-out questions greedily from the same prompt "
        "tokens; transformers' GGUF loader reads each unquantized file back, tensor by tensor.",
        "",
        "| file | MB | held-out loss (llama.cpp) | vs merged | tensors as merged | greedy answers identical "
        "| first tokens that agree (fewest) | passed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result.reports:
        t = r.tensors
        tensors = "(quantized)" if t is None else f"{t.exact} exact + {t.rounded} f16-rounded of {t.tensors}"
        if t is not None and t.other:
            tensors = f"{t.other} of {t.tensors} differ (rel. error ≤ {t.max_rel_error:.3f})"
        a = r.answers
        lines.append(
            f"| {r.path} | {r.size_mb:.0f} | {r.loss:.4f} | {r.loss_rel_diff:+.2%} | {tensors} | "
            f"{a.identical} of {a.questions} | {a.same_tokens_min} | {'yes' if r.passed else 'NO'} |"
        )
    for r in result.reports:
        parted = r.answers.divergences
        if not parted:
            continue
        if r.kind in gguf_check.UNQUANTIZED:
            for d in parted:
                kind = "a near tie" if d.near_tie else "not a near tie"
                lines.append(
                    f"\n{r.kind}: question {d.question + 1} parts at token {d.position}; transformers' top-two margin "
                    f"there is {d.margin:.3f} ({kind})."
                )
        else:
            ties = sum(d.near_tie for d in parted)
            at = sorted(d.position for d in parted)
            lines.append(
                f"\n{r.kind}: {len(parted)} answers part from the merged model's, at token {at[len(at) // 2]} "
                f"(median); {ties} of them at a near tie (top-two margin < {gguf_check.NEAR_TIE})."
            )
    return "\n".join(lines)
