"""`ugro k8s-manifest`: a Kubernetes manifest for the job (ugro/schedulers/k8s.py); `export-k8s`, its old name,
is kept hidden for users' scripts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from train.config import ConfigError, load_job
from ugro.checks import jobcheck
from ugro.commands.common import DEFAULT_JOB, JobOpt, MapOpt, fail, say, shown
from ugro.commands.options import command
from ugro.hosts.playbook import REPO
from ugro.schedulers import k8s

NodesOpt = Annotated[
    str, typer.Option(help="pods: a number (all with --profile), or per profile: gpu_12gb=1,gpu_8gb=2")
]
ImageOpt = Annotated[
    str, typer.Option(help="image with this repository at --code-dir and its node lock in <code-dir>/.venv")
]
PvcOpt = Annotated[str, typer.Option(help="PersistentVolumeClaim (ReadWriteMany) for the run directory")]
OutOpt = Annotated[Path | None, typer.Option(help="manifest file (default: runs/<job-id>/k8s/job.yaml)")]


@dataclass(frozen=True)
class K8sManifest:
    """The options of `ugro k8s-manifest`, in the order of its --help."""

    job_file: JobOpt = DEFAULT_JOB
    nodes: NodesOpt = "2"
    profile: Annotated[str, typer.Option(help="the memory profile of the pods when --nodes is a number")] = ""
    gpus_per_node: Annotated[int, typer.Option(help="nvidia.com/gpu per pod; 0: a CPU job")] = 0
    cpu_procs_per_node: Annotated[int, typer.Option(help="ranks per pod of a CPU job")] = 1
    image: ImageOpt = k8s.K8sOptions.image
    pvc: PvcOpt = k8s.K8sOptions.pvc
    namespace: Annotated[str, typer.Option(help="namespace of the Job and Service")] = k8s.K8sOptions.namespace
    port: Annotated[int, typer.Option(help="rendezvous port")] = k8s.K8sOptions.port
    code_dir: Annotated[str, typer.Option(help="where the image holds the repository")] = k8s.K8sOptions.code_dir
    profile_map: MapOpt = Path("jobs/profile-map.yml")
    out: OutOpt = None

    def k8s_options(self) -> k8s.K8sOptions:
        return k8s.K8sOptions(
            groups=k8s.parse_nodes(self.nodes, self.profile), gpus_per_node=self.gpus_per_node,
            cpu_procs_per_node=self.cpu_procs_per_node, image=self.image, pvc=self.pvc, namespace=self.namespace,
            port=self.port, code_dir=self.code_dir,
        )  # fmt: skip


def k8s_manifest(args: K8sManifest) -> None:
    """Write a Kubernetes manifest for the job: a headless Service and an indexed Job per memory profile."""
    try:
        job = load_job(args.job_file)
        jobcheck.check_data(job, REPO)
        manifest = k8s.manifest(job, args.job_file, args.k8s_options(), args.profile_map)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    target = args.out or REPO / "runs" / manifest.job_id / "k8s" / "job.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(k8s.dump(manifest.objects))
    kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in manifest.objects)
    say(f"job [bold]{manifest.job_id}[/]: {shown(target)} ({kinds})")
    say(f"  apply:   kubectl apply -f {shown(target)}    (not run on a real cluster here: see README)")


def register(app: typer.Typer) -> None:
    parsed = command(K8sManifest, k8s_manifest)
    app.command(name="k8s-manifest")(parsed)
    app.command(name="export-k8s", hidden=True)(parsed)  # its name before "export" came to mean the model only
