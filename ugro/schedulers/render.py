"""A SLURM run's status as `ugro status --run-dir` shows it, read from the run's directory on the shared
filesystem (no inventory, no Ansible): each node's state from its files, the run's state and last metrics, and
SLURM's own view of its jobs where squeue is at hand. The commands that write the scheduler's files are
ugro/commands/slurm_script.py and ugro/commands/k8s_manifest.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ugro.module_utils import ugro_jobstate

err = Console(stderr=True, soft_wrap=True)


def _run_state(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((run_dir / ugro_jobstate.STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _squeue(job_ids: list[str]) -> dict[str, str]:
    """SLURM's own state of the run's jobs, where squeue is at hand (finished jobs have left the queue)."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)],
                             capture_output=True, text=True, timeout=15, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if len(line.split()) == 2)


def node_rows(run_dir: Path, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per node, from its files: the node script's exit code, its last memory profile line."""
    rows = []
    for host_dir in sorted(p for p in (run_dir / "hosts").glob("*") if p.is_dir()):
        try:
            code: int | None = int((host_dir / "exit_code").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            code = None
        if code is None:
            state = "running" if (host_dir / "launch.pid").exists() else "absent"
        elif code == 0:
            state = "finished"
        else:
            state = "stopped" if run.get("state") == "stopped" else "failed"
        rows.append({"host": host_dir.name, "state": state, "exit_code": code})
    return rows


def status(run_dir: Path, out: Console) -> int:
    """Print a SLURM run's state from its directory (no inventory, no Ansible); 1 when it failed."""
    if not run_dir.is_dir():
        err.print(f"[bold red]error:[/] {run_dir}: no such run directory")
        return 2
    run = _run_state(run_dir)
    submissions = []
    with_jobs = run_dir / "slurm" / "submissions"
    if with_jobs.is_file():
        submissions = [line.split() for line in with_jobs.read_text().splitlines() if line.strip()]
    queue = _squeue(sorted({s[0] for s in submissions}))
    table = Table(title=f"run {run_dir.name}")
    for column in ("host", "state", "exit code"):
        table.add_column(column)
    for row in node_rows(run_dir, run):
        table.add_row(row["host"], row["state"], "" if row["exit_code"] is None else str(row["exit_code"]))
    out.print(table)
    last = ugro_jobstate.last_metrics(run_dir) or {}
    step = f"step {last.get('step', run.get('step', 0))}/{run.get('total_steps', '?')}"
    loss = f", loss {last['loss']:.4f}" if "loss" in last else ""
    out.print(f"run: {run.get('state', 'not started')}, {step}{loss}", highlight=False)
    if run.get("error"):
        out.print(f"  cause: {run['error']}", highlight=False)
    for job_id, restart, nodes, when in (s[:4] for s in submissions if len(s) >= 4):
        now = f", now {queue[job_id]}" if job_id in queue else ""
        out.print(f"  SLURM job {job_id} start {int(restart) + 1} on {nodes} at {when}{now}", highlight=False)
    for name in ("adapter", "metrics.jsonl", "loss.png", "checkpoints"):
        if (run_dir / name).exists():
            out.print(f"  [green]ok[/] {name}")
    return 1 if run.get("state") == "failed" else 0
