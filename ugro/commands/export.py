"""`ugro export`: the run's model merged into its base (safetensors), or as GGUF files for llama.cpp and Ollama,
each with a model card (ugro/model/)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from train.config import ConfigError
from ugro.commands.common import JobIdOpt, console, fail, job_id_or_latest, load
from ugro.hosts.playbook import REPO, runs_dir

if TYPE_CHECKING:
    from ugro.model.gguf_export import GgufExport
    from ugro.model.merge import Exported


def _gguf(result: GgufExport) -> None:
    table = Table(title=f"GGUF files in {result.out} (held-out loss of the merged model: {result.reference_loss:.4f})")
    for column in ("type", "MB", "held-out loss", "vs merged", "answers identical", "first tokens agree", "passed"):
        table.add_column(column)
    for r in result.reports:
        a = r.answers
        passed = "yes" if r.passed else "[red]NO[/]"
        table.add_row(r.kind, f"{r.size_mb:.0f}", f"{r.loss:.4f}", f"{r.loss_rel_diff:+.2%}",
                      f"{a.identical}/{a.questions}", str(a.same_tokens_min), passed)  # fmt: skip
    console.print(table)
    if result.modelfile is not None:
        console.print(f"Ollama: ollama create NAME -f {result.modelfile}; ollama run NAME")
    else:
        console.print(f"[yellow]no Modelfile:[/] {result.modelfile_note}")
    console.print(f"model card: {result.out / 'README.md'}")
    if not result.passed:
        raise fail(f"a GGUF file does not hold the fine-tuned model (see {result.out / 'check.json'})", 1)


def _merged(merged: Exported) -> None:
    console.print(
        f"merged model in {merged.out}: logits equal base + adapter (max difference "
        f"{merged.max_diff_vs_adapter:.1e}), differ from the base (max {merged.max_diff_vs_base:.2f}); "
        f"model card {merged.out / 'README.md'}"
    )


def export(
    job_id: JobIdOpt = None,
    out: Annotated[Path | None, typer.Option(help="merged model directory (default: runs/<job-id>/merged)")] = None,
    fmt: Annotated[str, typer.Option("--format", help="merged (safetensors) | gguf (llama.cpp, Ollama)")] = "merged",
    quant: Annotated[str, typer.Option(help="GGUF types, comma-separated (f16, q8_0, q4_k_m, f32, bf16, q5_k_m)")] = (
        "f16,q8_0,q4_k_m"
    ),
    job: Annotated[Path | None, typer.Option("--job", help="the job file, for a run that did not record it")] = None,
    questions: Annotated[int | None, typer.Option(min=1, help="GGUF: ask only the first N held-out questions")] = None,
) -> None:
    """The run's model: merged into its base (safetensors), or as GGUF files with an Ollama Modelfile, each with a
    model card."""
    from ugro.model import card, gguf_export, merge
    from ugro.model.basemodel import ModelError

    if fmt not in ("merged", "gguf"):
        raise fail(f"FORMAT={fmt}: choose merged (safetensors, the default) or gguf (llama.cpp and Ollama)")
    try:
        types = gguf_export.parse_types(quant)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    run_dir = runs_dir() / job_id_or_latest(job_id)
    adapter = run_dir / "adapter"
    if not adapter.is_dir():
        raise fail(f"{adapter}: no adapter here (did the run finish? `make logs JOB_ID=...` collects it)")
    try:
        if fmt == "gguf":
            job_config = load(job) if job else None
            result = gguf_export.export(run_dir, REPO, types, job_config, log=console.print, questions=questions)
        else:
            target = out or run_dir / "merged"
            merged = merge.export(adapter, target, REPO)
            card.write_card(target, run_dir, REPO, artifact="merged", files=merge.listing(target))
    except (ConfigError, ModelError) as exc:
        raise fail(str(exc)) from None
    if fmt == "merged":
        _merged(merged)
    else:
        _gguf(result)


def register(app: typer.Typer) -> None:
    app.command(name="export")(export)
