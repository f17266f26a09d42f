"""`ugro k8s-manifest`: the job as Kubernetes objects of the core API (no operator, no custom resource).

* a ConfigMap with the job file and the memory profiles the pods use;
* a headless Service whose name is the main host's DNS subdomain (``publishNotReadyAddresses``:
  the rendezvous runs before any pod is ready);
* one indexed Job (``completionMode: Indexed``) per memory profile, since a node selector belongs to a
  pod template: all of a Job's pods share its profile, its node selector and its GPU request. Every pod
  runs torchrun with a static rendezvous on pod 0 of the first Job (``<job>-0.<service>``) and its node
  rank from its completion index (``JOB_COMPLETION_INDEX``, plus the pods of the Jobs before it).

The run directory lives on a PersistentVolumeClaim (ReadWriteMany: every pod writes its log there, the
main pod its checkpoints), so deleting the Jobs and applying the manifest again resumes from the newest
checkpoint (``--resume auto``). The image holds this repository at ``code_dir`` with the node lock
installed in ``<code_dir>/.venv`` and the job's base model converted (`make export` of the model is not
needed: ``python -m ugro.model.basemodel ensure <dir>`` before building the image).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.config import ConfigError, JobConfig
from ugro.checks import ranks
from ugro.schedulers import profile_map

RUNS_MOUNT = "/runs"
JOB_MOUNT = "/etc/ugro/job"
LABEL = "ugro.io/job"
# What every pod runs: bash computes the node rank (Kubernetes substitutes variables but does no
# arithmetic) and execs torchrun; "$0" is the Python, "$@" torchrun's other arguments.
ENTRY = (
    "rank=$((UGRO_NODE_RANK_OFFSET + JOB_COMPLETION_INDEX)); export UGRO_MAIN_HOST=$((rank == 0)); "
    'exec "$0" -m torch.distributed.run --node-rank="${rank}" "$@"'
)


@dataclass(frozen=True)
class K8sOptions:
    groups: list[tuple[str, int]] = field(default_factory=lambda: [("", 2)])  # (profile, pods); "": map default
    gpus_per_node: int = 0
    cpu_procs_per_node: int = 1
    image: str = "ugro-node:latest"
    pvc: str = "ugro-runs"
    namespace: str = "default"
    port: int = 29500
    code_dir: str = "/opt/ugro"

    @property
    def nproc(self) -> int:
        """Ranks per pod: one per GPU, or the CPU processes of a job without GPUs."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.cpu_procs_per_node


@dataclass(frozen=True)
class Manifest:
    job_id: str
    objects: list[dict[str, Any]]


def parse_nodes(nodes: str, profile: str = "") -> list[tuple[str, int]]:
    """``3`` (pods of ``profile``, or the map's default) or ``gpu_12gb=1,gpu_8gb=2``."""
    text = nodes.strip()
    if text.isdigit():
        return [(profile, int(text))]
    groups = []
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit():
            raise ConfigError(f"--nodes {nodes!r}: a number, or profile=count pairs such as gpu_12gb=1,gpu_8gb=2")
        groups.append((name.strip(), int(count)))
    return groups


def _dns_label(text: str, limit: int) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].rstrip("-")
    if not label:
        raise ConfigError(f"{text!r} gives no Kubernetes name")
    return label


def _check(opts: K8sOptions, pmap: profile_map.ProfileMap) -> list[tuple[str, int]]:
    groups = [(name or pmap.default, count) for name, count in opts.groups]
    for name, count in groups:
        if name not in pmap.profiles:
            raise ConfigError(
                f"--nodes: {name!r} is not one of the profiles of {pmap.source} ({', '.join(pmap.profiles)})"
            )
        if count < 1:
            raise ConfigError(f"--nodes: {name}={count}: at least one pod per profile")
    if len({n for n, _ in groups}) != len(groups):
        raise ConfigError("--nodes: each profile once")
    if opts.gpus_per_node < 0 or opts.cpu_procs_per_node < 1 or not 1024 <= opts.port <= 65535:
        raise ConfigError("--gpus-per-node >= 0, --cpu-procs-per-node >= 1, --port 1024..65535")
    for what, value in (("--pvc", opts.pvc), ("--namespace", opts.namespace)):
        if not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", value):
            raise ConfigError(f"{what} {value!r}: a Kubernetes name (lowercase letters, digits, '-')")
    if not opts.image or any(c.isspace() for c in opts.image):
        raise ConfigError(f"--image {opts.image!r}: an image reference")
    return groups


def _pod_spec(
    opts: K8sOptions,
    names: dict[str, str],
    profile: str,
    offset: int,
    world: int,
    selector: dict[str, str],
    master: str,
) -> dict[str, Any]:
    run_dir = f"{RUNS_MOUNT}/{names['job_id']}"
    python = f"{opts.code_dir}/.venv/bin/python"
    args = [
        python,
        f"--nnodes={world}",
        f"--nproc-per-node={opts.nproc}",
        "--rdzv-backend=static",
        f"--master-addr={master}",
        f"--master-port={opts.port}",
        "--max-restarts=0",
        "--module", "train.worker",
        "--job", f"{JOB_MOUNT}/job.yaml",
        "--run-dir", run_dir,
        "--resume", "auto",
        "--code-dir", opts.code_dir,
        "--profile", f"{JOB_MOUNT}/profile-{profile}.yaml",
    ]  # fmt: skip
    container: dict[str, Any] = {
        "name": "trainer",
        "image": opts.image,
        "workingDir": opts.code_dir,
        "command": ["/bin/bash", "-c", ENTRY],
        "args": args,
        "env": [
            {"name": "UGRO_NODE_RANK_OFFSET", "value": str(offset)},
            {"name": "PYTHONPATH", "value": opts.code_dir},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "HF_DATASETS_OFFLINE", "value": "1"},
        ],
        "ports": [{"name": "rendezvous", "containerPort": opts.port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "runs", "mountPath": RUNS_MOUNT},
            {"name": "job", "mountPath": JOB_MOUNT, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if opts.gpus_per_node > 0:
        container["resources"] = {"limits": {"nvidia.com/gpu": opts.gpus_per_node}}
    spec: dict[str, Any] = {
        "subdomain": names["service"],  # with the pod's hostname <job>-<index>: <job>-<index>.<service> resolves
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": opts.pvc}},
            {"name": "job", "configMap": {"name": names["config"]}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if selector:
        spec["nodeSelector"] = dict(selector)
    return spec


def manifest(job: JobConfig, job_file: Path, opts: K8sOptions, map_file: Path, job_id: str | None = None) -> Manifest:
    """The objects of the job, checked: the profile map against the job, names, counts and options."""
    pmap = profile_map.load(map_file, job)
    groups = _check(opts, pmap)
    job_id = job_id or f"{job.name}-{datetime.datetime.now(datetime.UTC).strftime('%Y%m%d-%H%M%S')}"
    base = "ugro-" + _dns_label(job_id, 40)
    names = {"job_id": job_id, "service": base, "config": base}
    labels = {LABEL: base, "app.kubernetes.io/name": "ugro"}
    world = sum(count for _, count in groups)
    starts = f"{world} pod(s) with {opts.nproc} process(es) each start {world * opts.nproc} ranks"
    problem = ranks.too_few_sequences(job, job_file, world * opts.nproc, starts, "--nodes, --gpus-per-node or "
                                      "--cpu-procs-per-node")  # fmt: skip
    if problem:
        raise ConfigError(problem)
    job_names = [f"{base}-{_dns_label(name, 10)}" for name, _ in groups]  # <= 56: room for "-<index>" in 63
    master = f"{job_names[0]}-0.{base}"

    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": base, "namespace": opts.namespace, "labels": dict(labels)},
        "data": {
            "job.yaml": job_file.read_text(),
            **{f"profile-{name}.yaml": profile_map.profile_text(pmap, name) for name, _ in groups},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": base, "namespace": opts.namespace, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL: base},
            "ports": [{"name": "rendezvous", "port": opts.port, "targetPort": opts.port, "protocol": "TCP"}],
        },
    }
    jobs = []
    offset = 0
    for (name, count), job_name in zip(groups, job_names, strict=True):
        pod_labels = {**labels, "ugro.io/profile": _dns_label(name, 63)}
        spec = _pod_spec(opts, names, name, offset, world, pmap.node_selectors.get(name, {}), master)
        jobs.append({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job_name, "namespace": opts.namespace, "labels": dict(pod_labels)},
            "spec": {
                "completionMode": "Indexed",
                "completions": count,
                "parallelism": count,
                "backoffLimit": 0,  # a lost pod ends the group; apply again to resume from the checkpoint
                "template": {"metadata": {"labels": pod_labels}, "spec": spec},
            },
        })  # fmt: skip
        offset += count
    return Manifest(job_id, [config, service, *jobs])


def dump(objects: list[dict[str, Any]]) -> str:
    header = "# ugro job for Kubernetes, rendered by `ugro k8s-manifest`: kubectl apply -f <this file>\n"
    return header + yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True)
