"""`ugro slurm-script`: an sbatch script for the job (ugro/schedulers/slurm.py); `export-slurm`, its old name, is
kept hidden for users' scripts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from train.config import ConfigError, load_job
from ugro.checks import jobcheck
from ugro.commands.common import DEFAULT_JOB, JobOpt, MapOpt, dim, err, fail, say, shown
from ugro.commands.options import command
from ugro.hosts.playbook import REPO
from ugro.schedulers import slurm

NodesOpt = Annotated[int, typer.Option(help="nodes of the allocation (#SBATCH --nodes)")]
SignalOpt = Annotated[
    int, typer.Option(help="seconds before the time limit when the ranks checkpoint, stop and requeue")
]
SbatchOpt = Annotated[
    list[str] | None, typer.Option(help="another #SBATCH option, verbatim (repeatable): --account=abc")
]
ResumeOpt = Annotated[str, typer.Option(help="'auto': write into the newest earlier export of this job")]
RunsOpt = Annotated[Path | None, typer.Option(help="where runs go, shared (default: <code-dir>/runs)")]


@dataclass(frozen=True)
class SlurmScript:
    """The options of `ugro slurm-script`, in the order of its --help."""

    job_file: JobOpt = DEFAULT_JOB
    nodes: NodesOpt = 2
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (--gres=gpu:N); 0: a CPU job")] = 0
    gpu_type: Annotated[str, typer.Option(help="GRES type of the GPUs (--gres=gpu:TYPE:N)")] = ""
    cpu_procs_per_node: Annotated[int, typer.Option(help="ranks per node of a CPU job")] = 1
    cpus_per_task: Annotated[int, typer.Option(help="CPUs per node's task (0: the partition's default)")] = 0
    partition: Annotated[str, typer.Option(help="#SBATCH --partition")] = ""
    time: Annotated[str, typer.Option("--time", help="#SBATCH --time, e.g. 24:00:00")] = ""
    constraint: Annotated[str, typer.Option(help="#SBATCH --constraint (node features)")] = ""
    signal_seconds: SignalOpt = slurm.SlurmOptions.signal_seconds
    port: Annotated[int, typer.Option(help="rendezvous port (0: 29500 + SLURM job id % 1000)")] = 0
    ifname: Annotated[str, typer.Option(help="GLOO/NCCL_SOCKET_IFNAME on every node (default: unset)")] = ""
    sbatch_option: SbatchOpt = None
    code_dir: Annotated[Path, typer.Option(help="this repository on the shared filesystem")] = REPO
    python: Annotated[Path, typer.Option(help="the nodes' Python (relative: to --code-dir)")] = Path(".venv/bin/python")
    runs_dir: RunsOpt = None
    profile_map: MapOpt = Path("jobs/profile-map.yml")
    resume: ResumeOpt = "none"

    def slurm_options(self) -> slurm.SlurmOptions:
        return slurm.SlurmOptions(
            nodes=self.nodes, gpus_per_node=self.gpus_per_node, gpu_type=self.gpu_type,
            cpu_procs_per_node=self.cpu_procs_per_node, cpus_per_task=self.cpus_per_task, partition=self.partition,
            time_limit=self.time, constraint=self.constraint, signal_seconds=self.signal_seconds, port=self.port,
            ifname=self.ifname, extra=list(self.sbatch_option or []),
        )  # fmt: skip


def slurm_script(args: SlurmScript) -> None:
    """Write an sbatch script for the job (runs/<job-id>/slurm/job.sbatch): submit it with sbatch."""
    if args.resume not in ("none", "auto"):
        raise fail(f"--resume must be 'none' or 'auto', not '{args.resume}'")
    runs = args.runs_dir or args.code_dir / "runs"
    try:
        job = load_job(args.job_file)
        jobcheck.prepare_model(job, args.code_dir, dim)
        job_id = slurm.job_id_for(job, runs.resolve(), args.resume == "auto")
        done = slurm.export(args.job_file, args.slurm_options(), args.code_dir, args.python, runs, args.profile_map,
                            job_id)  # fmt: skip
    except ConfigError as exc:
        raise fail(str(exc)) from None
    python_path = args.python if args.python.is_absolute() else args.code_dir / args.python
    if not python_path.exists():
        err.print(f"[yellow]warning:[/] {python_path} does not exist here: the nodes need it on the shared filesystem")
    say(f"job [bold]{done.run_dir.name}[/]: {shown(done.script)} (+ node.sh, profiles {', '.join(done.profiles)})")
    say(f"  submit:  sbatch {shown(done.script)}    (again, or requeued: it resumes from the newest checkpoint)")
    say(f"  follow:  ugro status --run-dir {shown(done.run_dir)}    tail -f {shown(done.run_dir)}/hosts/*/torchrun.log")


def register(app: typer.Typer) -> None:
    parsed = command(SlurmScript, slurm_script)
    app.command(name="slurm-script")(parsed)
    app.command(name="export-slurm", hidden=True)(parsed)  # its name before "export" came to mean the model only
