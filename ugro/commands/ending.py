"""How `ugro train` and `ugro follow` show a run's end: every restart, and the cause of a run that did not finish
(exit 1), else its summary (loss, held-out loss, a held-out answer, the run's files); and a follower detached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from train.metrics import read_eval, read_metrics, read_samples
from ugro.commands.common import console, err, fail
from ugro.run.supervisor import Outcome

# The run's files, as the summary checks them.
FILES = [
    ("adapter", "LoRA adapter (peft save_pretrained)"),
    ("checkpoints", "resumable checkpoints"),
    ("metrics.jsonl", "per-step metrics"),
    ("tensorboard", "TensorBoard events"),
    ("logs", "one log per rank"),
    ("loss.png", "loss curve"),
    ("samples.md", "held-out answers, base model and fine-tuned"),
]


def detached(job_id: str) -> typer.Exit:
    """Ctrl-C while following: the hosts go on; say how to take the run up again."""
    console.print(f"\ndetached: job {job_id} keeps running on its hosts; `make follow JOB_ID={job_id}` follows it "
                  "again (and relaunches after a fault), `make status`, `make stop`", highlight=False)  # fmt: skip
    return typer.Exit(130)


def restarts(outcome: Outcome) -> None:
    for restart in outcome.restarts:
        console.print(f"[yellow]{escape(restart.line())}[/]", highlight=False)


def report(outcome: Outcome, run_dir: Path) -> None:
    """Every restart, and the cause of a run that did not finish (exit 1), else the run's summary."""
    restarts(outcome)
    if outcome.state != "finished":
        for host, state in outcome.statuses.items():
            code = f" (exit code {state['exit_code']})" if state.get("exit_code") is not None else ""
            err.print(f"[bold red]{host}:[/] {state.get('state')}{code}", highlight=False)
        cause_line = (
            outcome.cause.line()
            if outcome.cause
            else next((s["error"] for s in outcome.statuses.values() if s.get("error")), None)
        )
        if cause_line:
            err.print(f"[bold red]cause:[/] {cause_line}", highlight=False)
        raise fail(f"the run {outcome.state}; logs are in {run_dir / 'logs'} (`make doctor` explains)", code=1)
    summary(run_dir)


def _losses(run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    if rows:
        first, last = rows[0], rows[-1]
        console.print(
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']}), "
            f"{last['tokens_per_s']:.0f} tokens/s"
        )
    evals = read_eval(run_dir)
    base = next((r for r in evals if r.get("model") == "base"), None)
    tuned = evals[-1] if evals and evals[-1].get("model") != "base" else None
    if base and tuned and "logp_margin" in tuned:
        _preference(base, tuned)
    elif base and tuned:
        change = (tuned["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
        console.print(
            f"held-out loss {base['eval_loss']:.4f} (base model) -> {tuned['eval_loss']:.4f} "
            f"(fine-tuned, step {tuned['step']}): [bold]{change:+.1%}[/]"
        )


def _preference(base: dict[str, Any], tuned: dict[str, Any]) -> None:
    """A preference run's held-out pairs, base model against fine-tuned (train/preference/evaluate.py)."""
    step = f"(fine-tuned, step {tuned['step']})"
    if base.get("preference_accuracy") is not None and tuned.get("preference_accuracy") is not None:
        console.print(f"held-out preference accuracy {base['preference_accuracy']:.0%} (base model) -> "
                      f"[bold]{tuned['preference_accuracy']:.0%}[/] {step}: how often the chosen answer is the "
                      "more likely one")  # fmt: skip
    console.print(f"held-out log-prob margin {base['logp_margin']:+.3f} (base model) -> "
                  f"[bold]{tuned['logp_margin']:+.3f}[/] {step}: chosen minus rejected answer")  # fmt: skip
    accuracy = tuned.get("rewards_accuracy")
    console.print(
        f"held-out loss {base['eval_loss']:.4f} (base model) -> {tuned['eval_loss']:.4f} {step}; rewards "
        f"chosen {tuned['rewards_chosen']:+.3f}, rejected {tuned['rewards_rejected']:+.3f}, margin "
        f"{tuned['rewards_margin']:+.3f}" + (f", reward accuracy {accuracy:.0%}" if accuracy is not None else "")
    )


def summary(run_dir: Path) -> None:
    """A finished run: its losses, its first held-out answer, base and fine-tuned, and its files."""
    _losses(run_dir)
    samples = read_samples(run_dir)
    if samples:
        first = samples[0]
        console.print(f"[bold]held-out question:[/] {first['question']}", highlight=False)
        console.print(f"  [dim]base model:[/] {first['before']}", highlight=False)
        console.print(f"  [green]fine-tuned:[/] {first['after']}", highlight=False)
        console.print(f"  [dim]reference:[/]  {first['reference']}", highlight=False)
    console.print(f"[bold green]run finished:[/] {run_dir}")
    for name, what in FILES:
        mark = "[green]ok[/]" if (run_dir / name).exists() else "[red]missing[/]"
        console.print(f"  {mark} {name:<14} {what}")
