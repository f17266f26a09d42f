"""Live progress of a run, read from rank 0's metrics.jsonl while the launch playbook waits."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from train.launcher import PlaybookRun
from train.metrics import read_metrics


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def follow(run: PlaybookRun, run_dir: Path, console: Console, poll_s: float = 0.5) -> None:
    """Show step, loss, tokens/s and ETA until the playbook ends (Ctrl-C propagates to the caller)."""
    if console.is_terminal:
        _follow_live(run, run_dir, console, poll_s)
    else:
        _follow_plain(run, run_dir, console, poll_s)


def _follow_live(run: PlaybookRun, run_dir: Path, console: Console, poll_s: float) -> None:
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=None, loss="-", tps="-", eta="--:--")
        while run.running:
            rows = read_metrics(run_dir)
            if rows:
                last = rows[-1]
                progress.update(
                    task,
                    completed=last["step"],
                    total=last["total_steps"],
                    loss=f"{last['loss']:.4f}",
                    tps=f"{last['tokens_per_s']:.0f}",
                    eta=_eta(last["eta_s"]),
                )
            time.sleep(poll_s)


def _follow_plain(run: PlaybookRun, run_dir: Path, console: Console, poll_s: float) -> None:
    shown = 0
    next_report = 0.0
    while run.running:
        rows = read_metrics(run_dir)
        now = time.monotonic()
        if rows and len(rows) > shown and now >= next_report:
            last = rows[-1]
            console.print(
                f"step {last['step']}/{last['total_steps']}  loss {last['loss']:.4f}  "
                f"{last['tokens_per_s']:.0f} tok/s  ETA {_eta(last['eta_s'])}"
            )
            shown, next_report = len(rows), now + 5
        time.sleep(poll_s)
