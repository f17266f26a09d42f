"""`ugro k8s-manifest`: the manifest, validated offline against Kubernetes' own schemas, checked where it
matters (torchrun, the node rank from the completion index, the main host), and its pods' command
run by bash with a stand-in Python. It has not run on a real Kubernetes cluster."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helpers import REPO, write_job
from typer.testing import CliRunner

from train.config import ConfigError, load_job, load_profile
from ugro import cli
from ugro.schedulers import k8s, profile_map

MAP = REPO / "jobs" / "profile-map.yml"
DEFAULT_JOB = REPO / "jobs" / "default.yaml"


def _manifest(job_file: Path = DEFAULT_JOB, **opts: Any) -> k8s.Manifest:
    options = k8s.K8sOptions(**{"groups": [("gpu_12gb", 1), ("gpu_8gb", 2)], "gpus_per_node": 1, **opts})
    return k8s.manifest(load_job(job_file), job_file, options, MAP, job_id="default-20261124-120000")


def _by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_the_manifest_validates_against_the_kubernetes_schemas_offline(tmp_path: Path) -> None:
    cpu_job = write_job(tmp_path / "job.yaml")
    manifests = [_manifest(), _manifest(cpu_job, groups=[("", 2)], gpus_per_node=0)]
    versions = sorted(set(kubernetes_validate.utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    for manifest in manifests:
        text = k8s.dump(manifest.objects)
        objects = list(yaml.safe_load_all(text))
        assert [o["kind"] for o in objects] == ["ConfigMap", "Service"] + ["Job"] * (len(objects) - 2)
        for version in (versions[0], versions[-1]):  # strict: an unknown field is an error too
            for obj in objects:
                kubernetes_validate.validate(obj, version, strict=True)
    # The validator does catch a misspelt field (so a pass above means something).
    broken = copy.deepcopy(_by_kind(manifests[0].objects, "Job")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, versions[-1], strict=True)


def test_indexed_jobs_run_torchrun_with_the_rank_from_the_completion_index(tmp_path: Path) -> None:
    manifest = _manifest()
    (service,) = _by_kind(manifest.objects, "Service")
    (config,) = _by_kind(manifest.objects, "ConfigMap")
    jobs = _by_kind(manifest.objects, "Job")
    assert [j["spec"]["completions"] for j in jobs] == [1, 2]
    svc = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    offsets = []
    for job, profile in zip(jobs, ("gpu_12gb", "gpu_8gb"), strict=True):
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
        pod = spec["template"]["spec"]
        assert pod["subdomain"] == svc  # the pods' DNS names live under the headless Service
        labels = spec["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
        (container,) = pod["containers"]
        assert container["command"][:2] == ["/bin/bash", "-c"] and "JOB_COMPLETION_INDEX" in container["command"][2]
        assert '--node-rank="${rank}"' in container["command"][2]
        args = container["args"]
        assert args[0] == "/opt/ugro/.venv/bin/python"
        for arg in ("--nnodes=3", "--nproc-per-node=1", "--rdzv-backend=static", "--master-port=29500",
                    "--max-restarts=0"):  # fmt: skip
            assert arg in args, arg
        master = next(a.split("=", 1)[1] for a in args if a.startswith("--master-addr="))
        assert master == f"{jobs[0]['metadata']['name']}-0.{svc}"  # pod 0 of the first Job, node rank 0
        flags = dict(zip(args[1::2], args[2::2], strict=False)) | dict(zip(args[2::2], args[3::2], strict=False))
        assert flags["--module"] == "train.worker" and flags["--resume"] == "auto"
        assert flags["--run-dir"] == f"/runs/{manifest.job_id}"
        assert flags["--profile"] == f"/etc/ugro/job/profile-{profile}.yaml"
        env = {e["name"]: e["value"] for e in container["env"]}
        offsets.append(int(env["UGRO_NODE_RANK_OFFSET"]))
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == yaml.safe_load(MAP.read_text())["node_selectors"][profile]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "ugro-runs"
        assert volumes["job"]["configMap"]["name"] == config["metadata"]["name"]
    assert offsets == [0, 1]  # node ranks 0 | 1, 2: every rank once
    assert config["data"]["job.yaml"] == DEFAULT_JOB.read_text()
    for name in ("gpu_12gb", "gpu_8gb"):  # the profiles the pods mount load with the trainer's own loader
        (tmp_path / name).write_text(config["data"][f"profile-{name}.yaml"])
        assert load_profile(tmp_path / name, "pod") == profile_map.lan_profiles()[name]  # the map names none


def test_bad_pod_groups_and_names_are_refused() -> None:
    for opts, message in [
        ({"groups": [("gpu_80gb", 1)]}, "'gpu_80gb' is not one of the profiles"),
        ({"groups": [("cpu", 0)]}, "at least one pod"),
        ({"pvc": "Runs_Volume"}, "--pvc 'Runs_Volume'"),
        # the default job's global batch of 4 on 3 pods x 2 GPUs
        ({"gpus_per_node": 2}, r"global_batch_size is 4, but 3 pod\(s\) with 2 process\(es\) each start 6 ranks"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _manifest(**opts)
    with pytest.raises(ConfigError, match="profile=count"):
        k8s.parse_nodes("gpu_12gb:1")
    assert k8s.parse_nodes("gpu_12gb=1, gpu_8gb=2") == [("gpu_12gb", 1), ("gpu_8gb", 2)]


def test_each_pod_computes_its_node_rank_from_its_completion_index(tmp_path: Path) -> None:
    """The pods' real command line run by bash, with a stand-in Python that records what torchrun would get."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "main=$UGRO_MAIN_HOST $*"\n')
    fake.chmod(0o755)
    jobs = _by_kind(_manifest().objects, "Job")
    seen = []
    for job in jobs:
        (container,) = job["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        for index in range(job["spec"]["completions"]):
            args = [str(fake), *container["args"][1:]]
            out = subprocess.run([*container["command"], *args], env=env | {"JOB_COMPLETION_INDEX": str(index)},
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            main, module, run, rank, *rest = out.split()
            assert (module, run) == ("-m", "torch.distributed.run") and rest == container["args"][1:]
            seen.append((rank, main))
    assert seen == [("--node-rank=0", "main=1"), ("--node-rank=1", "main=0"), ("--node-rank=2", "main=0")]


def test_the_command_takes_every_option_under_both_names(tmp_path: Path) -> None:
    """`ugro k8s-manifest` (and `export-k8s`, its old name): each option lands in the manifest."""
    argv = ["--job", str(DEFAULT_JOB), "--nodes", "gpu_12gb=1,gpu_8gb=1", "--gpus-per-node", "1", "--image",
            "lab/ugro:1", "--pvc", "runs-rwx", "--namespace", "ml", "--port", "29700", "--code-dir", "/srv/ugro",
            "--profile-map", str(MAP)]  # fmt: skip
    for name in ("k8s-manifest", "export-k8s"):
        out = tmp_path / f"{name}.yaml"
        result = CliRunner().invoke(cli.app, [name, *argv, "--out", str(out)])
        assert result.exit_code == 0, result.output
        objects = list(yaml.safe_load_all(out.read_text()))
        jobs = _by_kind(objects, "Job")
        assert sorted(j["metadata"]["name"].rsplit("-", 1)[1] for j in jobs) == ["12gb", "8gb"], jobs
        assert all(o["metadata"]["namespace"] == "ml" for o in objects if o)
        text = out.read_text()
        for value in ("lab/ugro:1", "runs-rwx", "29700", "/srv/ugro"):
            assert value in text, value
    refused = CliRunner().invoke(cli.app, ["k8s-manifest", "--nodes", "gpu_12gb:1", "--out", str(tmp_path / "x.yaml")])
    assert refused.exit_code == 2 and "profile=count" in refused.output, refused.output
    assert not (tmp_path / "x.yaml").exists()
