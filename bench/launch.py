"""`make bench-launch`: `make train` on the 3-host test cluster, its fast checks included, to the first step.

Brings up the 3-host test cluster (network namespaces, real SSH, gloo over veth; needs root) and launches one
short job three times through the real controller (`ugro train`): on fresh hosts (the code is sent), again on
the same hosts (the fast checks find the controller's code there, and the launch reads their facts instead of
asking again: `ugro_known_facts`), and again without the fast checks (`--skip-preflight`, what the checks cost).
Each run's phases are the controller's own record of its first launch (run.json ``launch_phases``). The last
line is one JSON object with the three totals and the machine's mean 1-minute load average over the runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.cluster_job import tiny_job
from testbed import cluster as testbed_cluster
from ugro.hosts.playbook import runs_dir
from ugro.run import phases

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.10.0/24"  # its own: `make test`, `make testbed-up` and `make bench-recovery` use others
NAME = "bench-launch"
TOTAL = "total: make train -> first step"
console = Console(width=170, soft_wrap=True)


def _launch(job_file: Path, cluster: Path, checks: bool) -> dict[str, Any]:
    """One `ugro train` to its end; the controller's record of its first launch's phases."""
    before = set(runs_dir().glob(f"{NAME}-*"))
    argv = [sys.executable, "-m", "ugro.cli", "train", "--job", str(job_file), "--inventory", str(cluster),
            "--poll", "2", *([] if checks else ["--skip-preflight"])]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{(done.stdout + done.stderr)[-4000:]}")
    (run_dir,) = set(runs_dir().glob(f"{NAME}-*")) - before
    recorded = phases.recorded(run_dir)
    if recorded is None:
        raise SystemExit(f"{run_dir}: the run recorded no launch phases (run.json launch_phases)")
    return recorded


def main() -> int:
    directory = Path(tempfile.mkdtemp(prefix="ugro-bench-launch-"))
    bed = testbed_cluster.up(directory, hosts=3, subnet=SUBNET, session_env={"UGRO_NCCL_LIKE": "1"})  # as the tests
    try:
        cluster = testbed_cluster.one_rank_per_host(bed, directory / "cluster.yml")
        train = {"max_steps": 3, "global_batch_size": 6, "log_every": 1}
        loads = [os.getloadavg()[0]]
        runs: dict[str, dict[str, Any]] = {}
        with tiny_job(NAME, train=train, schedule={"warmup_steps": 1}, checkpoint={"every": 3}) as job_file:
            for label, checks in (("fresh hosts, with the fast checks", True),
                                  ("same hosts, with the fast checks", True),
                                  ("same hosts, --skip-preflight", False)):  # fmt: skip
                runs[label] = _launch(job_file, cluster, checks)
                loads.append(os.getloadavg()[0])
        phases = list(dict.fromkeys(p for seconds in runs.values() for p in seconds))
        table = Table(title="make train -> first step on the 3-host test cluster (seconds; this machine's load shows)")
        table.add_column("phase")
        for label in runs:
            table.add_column(label)
        for phase in phases:
            table.add_row(phase, *(f"{seconds[phase]:.1f}" if phase in seconds else "-" for seconds in runs.values()))
        console.print(table)
        fresh, warm, unchecked = (seconds.get(TOTAL) for seconds in runs.values())
        result = {
            "fresh_with_checks_s": fresh,
            "warm_with_checks_s": warm,
            "warm_without_checks_s": unchecked,
            "load": round(sum(loads) / len(loads), 2),
        }
        print(json.dumps(result), flush=True)
        return 0
    finally:
        testbed_cluster.down(directory)


if __name__ == "__main__":
    sys.exit(main())
