"""`make bench-pipeline-cluster`: the default real model in 3 stages across the 3 test hosts, against data parallel.

Brings up the 3-host test cluster (network namespaces, real SSH, gloo over veth; needs root) and trains the
default job (SmolLM2-135M-Instruct, LoRA) twice through the real controller (`ugro train`), same seed, steps
and data, one CPU rank per host:

* data parallel -- ``parallel: data``: every host holds the whole model;
* pipeline      -- each host's memory profile caps it (``memory_gib``) below what the planner estimates the
                   whole model needs, so ``parallel: auto`` cuts it into three stages, one per host.

Printed: held-out loss before -> after (LoRA dropout draws differ between the layouts, so "equal" means within
a few hundredths), tokens/s after the first steps, every rank's peak memory (its process's peak resident set:
these are CPU hosts) and the bytes each layout puts on the links per step: the stages' hidden states and their
gradients as the ranks counted them, against data parallel's LoRA-gradient all-reduce and the arithmetic of
FSDP's weight gathers. The last line is one JSON object with the figures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from testbed import cluster as testbed_cluster
from train.config import JobConfig
from train.layout import stageplan
from train.metrics import read_metrics
from ugro.hosts.playbook import runs_dir
from ugro.model import basemodel

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.10.0/24"  # its own: `make test`, `make testbed-up` and `make bench-recovery` use others
PROFILE = "/opt/ugro-profile-bench.yaml"  # on each test host (its own /opt)
console = Console(width=160, soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


def _job(name: str, steps: int, parallel: str) -> dict[str, Any]:
    job = yaml.safe_load((REPO / "jobs" / "default.yaml").read_text())
    job |= {"name": name, "parallel": parallel, "balance": "equal"}
    job["train"] |= {"max_steps": steps, "log_every": 1}
    job["schedule"]["warmup_steps"] = min(job["schedule"]["warmup_steps"], steps - 1)
    job["checkpoint"] |= {"every": steps}
    job["eval"] |= {"every": steps, "samples": 1, "max_new_tokens": 16}
    return job


def _train(name: str, job: dict[str, Any], inventory: Path) -> Path:
    job_file = REPO / "jobs" / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    try:
        argv = [sys.executable, "-m", "ugro.cli", "train", "--job", str(job_file), "--inventory", str(inventory),
                "--poll", "2"]  # fmt: skip
        result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600, check=False)
        if result.returncode != 0:
            raise SystemExit(f"{name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    finally:
        job_file.unlink(missing_ok=True)
    return sorted(runs_dir().glob(f"{name}-*"))[-1]


def _figures(run: Path, skip: int) -> dict[str, Any]:
    status = json.loads((run / "run.json").read_text())
    rows = [r for r in read_metrics(run) if r["step"] >= skip]  # the first timed step starts at row ``skip``
    logs = {p.name: p.read_text() for p in (run / "logs").glob("tb*-rank*.log")}
    peaks: dict[str, tuple[float, str]] = {}
    sent: dict[str, float] = {}
    trainable = 0
    for name, text in sorted(logs.items()):
        host = name.split("-")[0]
        if found := re.search(r"peak memory of this rank: ([\d.]+) GiB \(([^)]*)\)", text):
            peaks[host] = (float(found[1]), found[2])
        if found := re.search(r"per step this stage sent ([\d.]+) MB", text):
            sent[host] = float(found[1])
        if found := re.search(r"trainable=(\d+)", text):
            trainable = int(found[1])
    return {
        "before": status.get("eval_loss_before"),
        "after": status.get("eval_loss_after"),
        "tokens_per_s": sum(r["tokens"] for r in rows[1:]) / max(1e-9, rows[-1]["time"] - rows[0]["time"]),
        "peaks": peaks,
        "sent_mb": sent,
        "trainable": trainable,
        "layout": status.get("layout"),
    }


def _capped(inventory: Path, directory: Path, bed: Any, cap: float) -> Path:
    data = yaml.safe_load(inventory.read_text())
    for name, host in data["all"]["children"]["ugro_cluster"]["hosts"].items():
        (bed.dir / name / "opt" / Path(PROFILE).name).write_text(yaml.safe_dump({"memory_gib": cap}))
        host["ugro_profile_file"] = PROFILE
    path = directory / "cluster-capped.yml"
    path.write_text(yaml.safe_dump(data))
    return path


@app.command()
def run(steps: int = 12, skip: int = 2) -> None:
    """Train the default job in both layouts on the test cluster and print the comparison."""
    directory = Path(tempfile.mkdtemp(prefix="ugro-bench-pipeline-"))
    bed = testbed_cluster.up(directory, hosts=3, subnet=SUBNET, session_env={"UGRO_NCCL_LIKE": "1"})  # as the tests
    try:
        inventory = testbed_cluster.one_rank_per_host(bed, directory / "cluster.yml")

        pp_job = _job("bench-pp", steps, "auto")
        config = JobConfig.model_validate(pp_job)
        basemodel.ensure(REPO / config.model.source)  # its config.json sizes the plan (a fresh clone has none yet)
        shape = stageplan.read_shape(config, REPO)
        whole = stageplan.estimate(shape, config, stageplan.Span(shape.layers), "cpu")
        cap = round(whole.total * 0.92, 2)  # below the whole model's estimated need
        members = [stageplan.Member(f"tb{i}", cap, device="cpu", rank_local=config.rank_local) for i in (1, 2, 3)]
        planned = stageplan.plan(config, shape, members)
        console.print(f"whole model ~{whole.total:.2f} GiB ({whole.parts()}); each host capped at {cap} GiB; "
                      f"plan: {planned.describe()}", highlight=False)  # fmt: skip

        dp = _figures(_train("bench-dp", _job("bench-dp", steps, "data"), inventory), skip)
        pp = _figures(_train("bench-pp", pp_job, _capped(inventory, directory, bed, cap)), skip)
    finally:
        testbed_cluster.down(directory)

    world = 3
    lora_bytes = dp["trainable"] * 2  # bf16-compressed gradients across hosts (grad_compression: auto)
    dp_mb = 2 * (world - 1) / world * lora_bytes / 1e6  # ring all-reduce: what each rank sends per step
    weights_mb = shape.layers * shape.layer_linear_params * 4 / 1e6  # fp32 decoder weights FSDP would shard
    micro_batches = -(-config.train.global_batch_size // (world * config.micro_batch_cap))
    fsdp_mb = 2 * (world - 1) / world * weights_mb * micro_batches  # gathered before forward and before backward

    estimates = {s["host"]: s["peak_gib"] for r in pp["layout"]["replicas"] for s in r["stages"]}
    table = Table(title=f"default job, {steps} steps, 3 test hosts x 1 CPU rank (load {os.getloadavg()[0]:.1f})")
    for column in ("layout", "held-out before -> after", "tokens/s", "peak GiB per host: measured (planner)",
                   "MB/step/rank"):  # fmt: skip
        table.add_column(column)
    stages_mb = " / ".join(f"{v:.2f}" for v in pp["sent_mb"].values())
    for label, fig, sent in (("data parallel", dp, f"{dp_mb:.2f} (LoRA grads)"), ("3-stage pipeline", pp, stages_mb)):
        expected = estimates if fig is pp else dict.fromkeys(fig["peaks"], whole.total)
        peaks = ", ".join(f"{h} {v:.2f} ({expected[h]:.2f}) {what}" for h, (v, what) in fig["peaks"].items())
        table.add_row(label, f"{fig['before']:.4f} -> {fig['after']:.4f}", f"{fig['tokens_per_s']:.1f}", peaks, sent)
    table.add_row("FSDP (arithmetic)", "", "", "", f"{fsdp_mb:.0f} (weights gathered twice per micro-batch)")
    console.print(table)
    whole_peak = max(v for v, _ in dp["peaks"].values())
    stage_peak = max(v for v, _ in pp["peaks"].values())
    print(json.dumps({
        "dp_eval_after": round(dp["after"], 4), "pp_eval_after": round(pp["after"], 4),
        "dp_tokens_per_s": round(dp["tokens_per_s"], 1), "pp_tokens_per_s": round(pp["tokens_per_s"], 1),
        "whole_peak_gib": round(whole_peak, 2), "whole_estimate_gib": round(whole.total, 2),
        "largest_stage_peak_gib": round(stage_peak, 2), "largest_stage_estimate_gib": round(max(estimates.values()), 2),
        "stage_over_whole": round(stage_peak / whole_peak, 3),
        "pp_mb_per_step": pp["sent_mb"], "dp_mb_per_step": round(dp_mb, 2), "fsdp_mb_per_step": round(fsdp_mb, 1),
        "cap_gib": cap, "load": round(os.getloadavg()[0], 2),
    }))  # fmt: skip


if __name__ == "__main__":
    app()
