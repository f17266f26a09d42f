"""`make bench-recovery`: how long a job takes to start, and to get going again after it loses a host.

Brings up the 3-host test cluster (network namespaces, real SSH, gloo over veth; needs root) and runs one
job through the real controller (`ugro train`): launch -> first optimizer step; then every job process on
tb2 is SIGKILLed (a host that died) -> first step on the survivors; then tb1's link is cut inside its
namespace (the rendezvous host, with the checkpoints, gone silent) -> first step on the hosts left, from
the controller's copy of the checkpoint. Step times come from the ranks' own metrics.jsonl (wall clock of
this machine, which all test hosts share); where the time went comes from the run's restart record.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from testbed import cluster as testbed_cluster

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.9.0/24"  # its own: `make test` and `make testbed-up` use others
NAME = "bench-recovery"
console = Console(width=170)


def _rows(bed: Any, job_id: str) -> list[dict[str, Any]]:
    """Every metrics row any host wrote for the run (each host that was main holds its part)."""
    rows: list[dict[str, Any]] = []
    for host in bed.hosts:
        path = bed.dir / host.name / "opt" / "ugro" / "runs" / job_id / "metrics.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def _wait_step(bed: Any, step: int, proc: subprocess.Popen[str]) -> str:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the job ended before step {step}:\n{proc.communicate()[0][-3000:]}")
        runs = sorted((REPO / "runs").glob(f"{NAME}-*"))
        if runs and any(r["step"] >= step for r in _rows(bed, runs[-1].name)):
            return runs[-1].name
        time.sleep(0.1)


def _first_step_after(bed: Any, job_id: str, moment: float) -> float:
    return min(r["time"] for r in _rows(bed, job_id) if r["time"] > moment) - moment


def main() -> int:
    tb = testbed_cluster
    directory = Path(tempfile.mkdtemp(prefix="ugro-bench-recovery-"))
    job_file = REPO / "jobs" / f"{NAME}.yaml"
    bed = tb.up(directory, hosts=3, subnet=SUBNET)
    try:
        cluster = tb.one_rank_per_host(bed, directory / "cluster.yml")
        job = yaml.safe_load((REPO / "jobs" / "tiny.yaml").read_text())
        job |= {"name": NAME, "balance": "equal"}
        job["train"] = {**job.get("train", {}), "max_steps": 40, "global_batch_size": 6, "log_every": 10}
        job["checkpoint"] = {"every": 5, "keep_last": 3}
        job["distributed"] = {**job.get("distributed", {}), "timeout_s": 20}
        job.pop("eval", None)
        job_file.write_text(yaml.safe_dump(job, sort_keys=False))
        argv = [sys.executable, "-m", "ugro.cli", "train", "--job", str(job_file), "--inventory", str(cluster),
                "--poll", "2", "--skip-preflight"]  # fmt: skip
        started = time.time()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        job_id = _wait_step(bed, 10, proc)
        killed = time.time()
        tb.kill_processes(bed.dir, "tb2", f"/opt/ugro/runs/{job_id}")
        _wait_step(bed, 25, proc)
        while not any(r["time"] > killed and r["step"] >= 25 for r in _rows(bed, job_id)):
            time.sleep(0.1)
        cut = time.time()
        tb.set_link(bed.dir, "tb1", up=False)
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"the job failed:\n{out[-4000:]}")
        record = json.loads((REPO / "runs" / job_id / "run.json").read_text())
        first = min(r["time"] for r in _rows(bed, job_id)) - started
        figures = [("launch -> first optimizer step (normal start)", first, "goal < 20 s", None)]
        for (what, moment), restart in zip(
            [("SIGKILL of tb2's job -> first step on tb1 + tb3", killed),
             ("tb1 (rendezvous) link cut -> first step on tb2 + tb3", cut)],
            record["restarts"], strict=True,
        ):  # fmt: skip
            figures.append((what, _first_step_after(bed, job_id, moment), "goal < 60 s", restart | {"fault": moment}))
        table = Table(title="recovery on the 3-host test cluster (this machine's load shows in every figure)")
        for column in ("what", "seconds", "goal", "detect", "stop", "checkpoint", "launch", "to first step", "redone"):
            table.add_column(column)
        for what, seconds, goal, restart in figures:
            if restart is None:
                table.add_row(what, f"{seconds:.1f}", goal, *[""] * 6)
                continue
            detect = restart["time"] - restart["fault"]
            rest = seconds - detect - restart["stop_s"] - restart["place_checkpoint_s"] - restart["launch_s"]
            table.add_row(what, f"{seconds:.1f}", goal, f"{detect:.1f}", f"{restart['stop_s']:.1f}",
                          f"{restart['place_checkpoint_s']:.1f}", f"{restart['launch_s']:.1f}", f"{rest:.1f}",
                          str(restart.get("steps_redone")))  # fmt: skip
        console.print(table)
        console.print(f"final hosts {record['hosts']}, rendezvous {record['rendezvous']}; run {REPO / 'runs' / job_id}")
        return 0
    finally:
        tb.set_link(bed.dir, "tb1", up=True)
        tb.down(directory)
        job_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
