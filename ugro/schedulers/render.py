"""The command line of the batch-scheduler exports: `ugro slurm-script`, `ugro k8s-manifest`, and the
status of a SLURM run read from its directory (`ugro status --run-dir`). ugro/cli.py registers them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from train.config import ConfigError, load_job
from ugro.checks import jobcheck
from ugro.hosts.playbook import REPO
from ugro.module_utils import ugro_jobstate
from ugro.schedulers import k8s, slurm

console = Console()
err = Console(stderr=True)

JobOpt = Annotated[Path, typer.Option("--job", help="job file (YAML)")]
MapOpt = Annotated[
    Path, typer.Option("--profile-map", help="which memory profile a node gets (GPU type / node feature -> profile)")
]
ResumeOpt = Annotated[str, typer.Option(help="'auto': write into the newest earlier export of this job")]


def say(text: str) -> None:
    """A line with paths and commands to copy: never wrapped."""
    console.print(text, highlight=False, soft_wrap=True)


def _fail(message: str) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(2)


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def slurm_script(
    job_file: JobOpt = Path("jobs/default.yaml"),
    nodes: Annotated[int, typer.Option(help="nodes of the allocation (#SBATCH --nodes)")] = 2,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (--gres=gpu:N); 0: a CPU job")] = 0,
    gpu_type: Annotated[str, typer.Option(help="GRES type of the GPUs (--gres=gpu:TYPE:N)")] = "",
    cpu_procs_per_node: Annotated[int, typer.Option(help="ranks per node of a CPU job")] = 1,
    cpus_per_task: Annotated[int, typer.Option(help="CPUs per node's task (0: the partition's default)")] = 0,
    partition: Annotated[str, typer.Option(help="#SBATCH --partition")] = "",
    time: Annotated[str, typer.Option("--time", help="#SBATCH --time, e.g. 24:00:00")] = "",
    constraint: Annotated[str, typer.Option(help="#SBATCH --constraint (node features)")] = "",
    signal_seconds: Annotated[
        int, typer.Option(help="seconds before the time limit when the ranks checkpoint, stop and requeue")
    ] = slurm.SlurmOptions.signal_seconds,
    port: Annotated[int, typer.Option(help="rendezvous port (0: 29500 + SLURM job id % 1000)")] = 0,
    ifname: Annotated[str, typer.Option(help="GLOO/NCCL_SOCKET_IFNAME on every node (default: unset)")] = "",
    sbatch_option: Annotated[
        list[str] | None, typer.Option(help="another #SBATCH option, verbatim (repeatable): --account=abc")
    ] = None,
    code_dir: Annotated[Path, typer.Option(help="this repository on the shared filesystem")] = REPO,
    python: Annotated[Path, typer.Option(help="the nodes' Python (relative: to --code-dir)")] = Path(
        ".venv/bin/python"
    ),
    runs_dir: Annotated[Path | None, typer.Option(help="where runs go, shared (default: <code-dir>/runs)")] = None,
    profile_map: MapOpt = Path("jobs/profile-map.yml"),
    resume: ResumeOpt = "none",
) -> None:
    """Write an sbatch script for the job (runs/<job-id>/slurm/job.sbatch): submit it with sbatch."""
    if resume not in ("none", "auto"):
        raise _fail(f"--resume must be 'none' or 'auto', not '{resume}'")
    opts = slurm.SlurmOptions(
        nodes=nodes, gpus_per_node=gpus_per_node, gpu_type=gpu_type, cpu_procs_per_node=cpu_procs_per_node,
        cpus_per_task=cpus_per_task, partition=partition, time_limit=time, constraint=constraint,
        signal_seconds=signal_seconds, port=port, ifname=ifname, extra=list(sbatch_option or []),
    )  # fmt: skip
    runs = runs_dir or code_dir / "runs"
    try:
        job = load_job(job_file)
        jobcheck.prepare_model(job, code_dir, lambda line: console.print(f"[dim]{line}[/]", highlight=False))
        job_id = slurm.job_id_for(job, runs.resolve(), resume == "auto")
        done = slurm.export(job_file, opts, code_dir, python, runs, profile_map, job_id)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    python_path = python if python.is_absolute() else code_dir / python
    if not python_path.exists():
        err.print(f"[yellow]warning:[/] {python_path} does not exist here: the nodes need it on the shared filesystem")
    say(f"job [bold]{done.run_dir.name}[/]: {_show(done.script)} (+ node.sh, profiles {', '.join(done.profiles)})")
    say(f"  submit:  sbatch {_show(done.script)}    (again, or requeued: it resumes from the newest checkpoint)")
    say(f"  follow:  ugro status --run-dir {_show(done.run_dir)}    tail -f {_show(done.run_dir)}/hosts/*/torchrun.log")


def k8s_manifest(
    job_file: JobOpt = Path("jobs/default.yaml"),
    nodes: Annotated[
        str, typer.Option(help="pods: a number (all with --profile), or per profile: gpu_12gb=1,gpu_8gb=2")
    ] = "2",
    profile: Annotated[str, typer.Option(help="the memory profile of the pods when --nodes is a number")] = "",
    gpus_per_node: Annotated[int, typer.Option(help="nvidia.com/gpu per pod; 0: a CPU job")] = 0,
    cpu_procs_per_node: Annotated[int, typer.Option(help="ranks per pod of a CPU job")] = 1,
    image: Annotated[
        str, typer.Option(help="image with this repository at --code-dir and its node lock in <code-dir>/.venv")
    ] = k8s.K8sOptions.image,
    pvc: Annotated[str, typer.Option(help="PersistentVolumeClaim (ReadWriteMany) for the run directory")] = (
        k8s.K8sOptions.pvc
    ),
    namespace: Annotated[str, typer.Option(help="namespace of the Job and Service")] = k8s.K8sOptions.namespace,
    port: Annotated[int, typer.Option(help="rendezvous port")] = k8s.K8sOptions.port,
    code_dir: Annotated[str, typer.Option(help="where the image holds the repository")] = k8s.K8sOptions.code_dir,
    profile_map: MapOpt = Path("jobs/profile-map.yml"),
    out: Annotated[Path | None, typer.Option(help="manifest file (default: runs/<job-id>/k8s/job.yaml)")] = None,
) -> None:
    """Write a Kubernetes manifest for the job: a headless Service and an indexed Job per memory profile."""
    try:
        job = load_job(job_file)
        jobcheck.check_data(job, REPO)
        opts = k8s.K8sOptions(
            groups=k8s.parse_nodes(nodes, profile), gpus_per_node=gpus_per_node,
            cpu_procs_per_node=cpu_procs_per_node, image=image, pvc=pvc, namespace=namespace, port=port,
            code_dir=code_dir,
        )  # fmt: skip
        manifest = k8s.manifest(job, job_file, opts, profile_map)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    target = out or REPO / "runs" / manifest.job_id / "k8s" / "job.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(k8s.dump(manifest.objects))
    kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in manifest.objects)
    say(f"job [bold]{manifest.job_id}[/]: {_show(target)} ({kinds})")
    say(f"  apply:   kubectl apply -f {_show(target)}    (not run on a real cluster here: see README)")


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
