"""A running job planted on one host without a cluster: the run directory as the launch and the ranks leave it.

For what reads a host's runs/ (the node exporter, the dashboard's sources) in the tests and in
``make bench-exporter``: ``runs/active-job`` naming the job and a live process of it, run.json, metrics and
eval rows, and two ranks' own figures (written by the trainer's own ``RankStatus``).
"""

from __future__ import annotations

import json
from pathlib import Path

from train.metrics import RankStatus, rank_figures

JOB_ID = "plant-20260101-000000"


def plant_run(
    runs: Path,
    host: str,
    worker_pid: int,
    *,
    job_id: str = JOB_ID,
    step: int = 7,
    total_steps: int = 50,
    rows: int = 1,
    loss: float = 6.5,
) -> Path:
    """Plant job ``job_id`` in ``runs`` on ``host``, at ``step`` with the last ``rows`` metrics rows; two ranks
    whose recorded worker is ``worker_pid`` (a process whose command line names the run, as a rank's does)."""
    run = runs / job_id
    host_dir = run / "hosts" / host
    host_dir.mkdir(parents=True)
    (runs / "active-job").write_text(f"{job_id} {worker_pid}\n")
    (run / "run.json").write_text(
        json.dumps({"state": "running", "world_size": 2, "step": step, "total_steps": total_steps})
    )
    metrics = (
        json.dumps({"step": s, "total_steps": total_steps, "loss": loss, "tokens_per_s": 2100.0, "eta_s": 30.5})
        for s in range(step - rows + 1, step + 1)
    )
    (run / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 7.25, "tokens": 10, "model": "base"}) + "\n")
    figures = rank_figures([host, host], [5, 3], [0.5, 0.25], [1000, 600])
    for rank in (0, 1):
        (host_dir / f"worker-rank{rank}.pid").write_text(f"{worker_pid}\n")
        RankStatus(
            host,
            rank,
            step,
            total_steps,
            loss,
            figures,
            f"stage {rank + 1}/2, layers {rank * 15}-{rank * 15 + 14}",
            f"cuda: NVIDIA GeForce RTX 4070, 7.6 GiB (GPU {rank})",
        ).write(run)
    return run
