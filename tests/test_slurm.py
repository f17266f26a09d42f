"""`ugro slurm-script`: the sbatch script, checked as text and run for real under Debian's SLURM.

The real test starts munged, slurmctld and one slurmd per host of the 3-host test cluster (each host
its own hostname, address and PID namespace), submits the exported script with sbatch and checks:
SLURM's warning before the time limit (SIGUSR1 to the batch script, as ``--signal=B:USR1@...`` sends
it) makes every rank checkpoint and stop and the job requeue and resume; ``scancel`` leaves no process;
a second submission resumes from the newest checkpoint and trains to the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from helpers import REPO, free_port, unavailable, write_job
from typer.testing import CliRunner

from train.config import ConfigError, load_job, load_profile
from train.metrics import read_metrics
from ugro import cli
from ugro.schedulers import slurm

MAP = REPO / "jobs" / "profile-map.yml"
PYTHON = REPO / ".venv" / "bin" / "python"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol", "squeue")


def _export(tmp_path: Path, opts: slurm.SlurmOptions, map_file: Path = MAP, **job: Any) -> slurm.Export:
    job_file = write_job(tmp_path / "job.yaml", **job)
    return slurm.export(job_file, opts, REPO, PYTHON, tmp_path / "runs", map_file, job_id="test-1")


def test_the_sbatch_script_asks_for_nodes_gpus_requeue_and_the_warning(tmp_path: Path) -> None:
    opts = slurm.SlurmOptions(nodes=3, gpus_per_node=2, gpu_type="a100", partition="gpu", time_limit="1-00:00:00",
                              signal_seconds=120, extra=["--account=lab"])  # fmt: skip
    done = _export(tmp_path, opts)
    sbatch, node = done.script.read_text(), done.node_script.read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:a100:2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --account=lab",
                 f"#SBATCH --output={done.run_dir}/slurm/batch.log"):  # fmt: skip
        assert line in sbatch.splitlines(), line
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n1' in sbatch
    assert len(re.findall(r"^srun ", sbatch, re.M)) == 1  # one srun: the node script on every node
    assert 'scontrol requeue "${SLURM_JOB_ID}"' in sbatch
    assert "--nproc-per-node=2" in node and "--resume auto" in node
    assert '--rdzv-endpoint="${UGRO_RDZV_HOST}:${UGRO_RDZV_PORT}"' in node
    for path in (done.script, done.node_script):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    # Every profile is written where the node script picks it, and loads with the trainer's loader.
    assert sorted(p.stem for p in (done.run_dir / "slurm" / "profiles").glob("*.yaml")) == sorted(done.profiles)
    assert load_profile(done.run_dir / "slurm" / "profiles" / "gpu_8gb.yaml", "n1") == {
        "micro_batch_size": 2, "gradient_checkpointing": True, "memory_gib": 7.2}  # fmt: skip
    assert load_job(done.run_dir / "slurm" / "job.yaml").name == "test"

    cpu = _export(tmp_path, slurm.SlurmOptions(nodes=2, cpu_procs_per_node=2))
    assert "--gres" not in cpu.script.read_text() and "--nproc-per-node=2" in cpu.node_script.read_text()


FAKES = {
    # scontrol show node <n> -o: the features and GRES of this test's node
    "scontrol": "#!/bin/sh\n"
    'echo "NodeName=$3 ActiveFeatures=${FAKE_FEATURES:-(null)} Gres=${FAKE_GRES:-(null)} State=ALLOCATED"\n',
    "nvidia-smi": '#!/bin/sh\n[ -n "$FAKE_GPU" ] || exit 9\necho "$FAKE_GPU"\n',
    # the "Python" that would run torchrun: records its arguments and environment
    "python": '#!/bin/sh\necho "$@" > "$FAKE_OUT"\n'
    'echo "main=$UGRO_MAIN_HOST stop=$UGRO_STOP_SIGNAL omp=$OMP_NUM_THREADS" >> "$FAKE_OUT"\n',
}


@pytest.mark.parametrize(
    ("node_env", "profile"),
    [
        ({"FAKE_GRES": "gpu:rtx4070:1(S:0)"}, "gpu_8gb"),
        ({"FAKE_GPU": "NVIDIA GeForce RTX 5070 Ti"}, "gpu_12gb"),
        ({"FAKE_FEATURES": "ib,gpu8g"}, "gpu_8gb"),
        ({"FAKE_FEATURES": "gpu8", "FAKE_GRES": "gpu:a100:4"}, "cpu"),  # no rule matches: the map's default
    ],
)
def test_the_node_script_picks_the_memory_profile_by_gpu_type_or_feature(
    tmp_path: Path, node_env: dict[str, str], profile: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    done = slurm.export(write_job(tmp_path / "job.yaml"), slurm.SlurmOptions(nodes=2), REPO, bin_dir / "python",
                        tmp_path / "runs", MAP, job_id="pick")  # fmt: skip
    out = tmp_path / "torchrun-args"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "42", "SLURM_NODEID": "1",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "4", "UGRO_RDZV_HOST": "n1", "UGRO_RDZV_PORT": "29542",
           "FAKE_OUT": str(out), **node_env}  # fmt: skip
    subprocess.run(["bash", str(done.node_script)], env=env, check=True, timeout=30)
    host_dir = done.run_dir / "hosts" / "n2"
    assert (host_dir / "exit_code").read_text().strip() == "0"
    assert f"memory profile {profile} " in (host_dir / "torchrun.log").read_text()
    args, envs = out.read_text().splitlines()
    assert f"--profile {done.run_dir}/slurm/profiles/{profile}.yaml" in args
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=n1:29542 --rdzv-id=42" in args
    assert envs == "main=0 stop=USR1 omp=4"  # not the main host; 4 CPUs for its one rank


def _map(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "map.yml"
    path.write_text(yaml.safe_dump(data))
    return path


BAD_MAPS = [
    ({"rules": []}, "unknown key 'rules'"),
    ({"profiles": {"big": {"lora": {"r": 8}}}, "default": "big"}, "profiles.big: key 'lora' is cluster-wide"),
    (
        {"profiles": {"big": {"micro_batch_tokens": 64}}, "default": "big"},
        "profiles.big: rank_local.micro_batch_tokens (64) is smaller than one sequence",
    ),
    (
        {"match": [{"gpu": "A100", "profile": "gpu_80gb"}]},
        "key 'match[0].profile': 'gpu_80gb' is not one of the profiles",
    ),
    (
        {"match": [{"gpu": "A100", "feature": "x", "profile": "cpu"}]},
        "key 'match[0]': a rule matches on exactly one of gpu or feature",
    ),
    ({"match": [{"gpu": "A100"}]}, "missing key 'match[0].profile'"),
    ({"default": "huge"}, "key 'default': 'huge' is not one of the profiles"),
    (
        {"node_selectors": {"cpu": {"bad key!": "x"}}},
        "key 'node_selectors.cpu': 'bad key!' is not a Kubernetes label key",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD_MAPS)
def test_a_bad_profile_map_fails_the_export_naming_file_and_key(tmp_path: Path, data: Any, message: str) -> None:
    path = _map(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        _export(tmp_path, slurm.SlurmOptions(), path)
    assert message in str(caught.value)
    assert str(caught.value).startswith(f"{path}: ")
    assert not (tmp_path / "runs" / "test-1" / "slurm" / "job.sbatch").exists()


def test_the_command_takes_every_option_under_both_names(tmp_path: Path) -> None:
    """`ugro slurm-script` (and `export-slurm`, its old name): each option lands in the script; a bad --resume is
    refused (exit 2) before anything is written."""
    job_file = write_job(tmp_path / "job.yaml", train={"global_batch_size": 12})
    argv = ["--job", str(job_file), "--nodes", "3", "--gpus-per-node", "4", "--gpu-type", "a100", "--cpus-per-task",
            "8", "--partition", "gpu", "--time", "2:00:00", "--constraint", "ib", "--signal-seconds", "120", "--port",
            "29600", "--ifname", "ib0", "--sbatch-option", "--account=lab", "--sbatch-option", "--qos=long",
            "--code-dir", str(REPO), "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    for name in ("slurm-script", "export-slurm"):
        result = CliRunner().invoke(cli.app, [name, *argv])
        assert result.exit_code == 0, result.output
    scripts = sorted((tmp_path / "runs").glob("*/slurm/job.sbatch"))
    assert scripts, result.output
    text = scripts[-1].read_text()
    for line in ("--nodes=3", "--gres=gpu:a100:4", "--cpus-per-task=8", "--partition=gpu", "--time=2:00:00",
                 "--constraint=ib", "--signal=B:USR1@120", "--account=lab", "--qos=long"):  # fmt: skip
        assert f"#SBATCH {line}" in text, (line, text)
    refused = CliRunner().invoke(cli.app, ["slurm-script", "--job", str(job_file), "--resume", "later"])
    assert refused.exit_code == 2 and "--resume must be 'none' or 'auto', not 'later'" in refused.output


def test_bad_options_are_refused(tmp_path: Path) -> None:
    for opts, message in [
        (slurm.SlurmOptions(signal_seconds=5), "between 10 (a step and a checkpoint)"),
        (slurm.SlurmOptions(time_limit="soon"), "--time 'soon'"),
        (slurm.SlurmOptions(time_limit="2", signal_seconds=75), "more than half of --time 2"),
        (slurm.SlurmOptions(extra=["-A lab"]), "one long sbatch option"),
        # small_job's global batch of 8 on 3 nodes x 4 GPUs: refused before any file is written
        (
            slurm.SlurmOptions(nodes=3, gpus_per_node=4),
            "train.global_batch_size is 8, but --nodes 3 with 4 "
            "process(es) each start 12 ranks, and every rank needs at least one sequence of each step. Raise "
            "train.global_batch_size to 12 or more",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            _export(tmp_path, opts)
    with pytest.raises(ConfigError, match="letters, digits and"):
        slurm.export(write_job(tmp_path / "j.yaml"), slurm.SlurmOptions(), REPO, PYTHON, tmp_path / "my runs", MAP)


# --------------------------------------------------------------------------------------------------
# A real SLURM on the test cluster.


@dataclass
class SlurmCluster:
    """munged + slurmd on every test host, slurmctld on tb1; commands run on tb1 over SSH (a login node)."""

    bed: Any
    shared: Path  # on every host at the same path: /var/tmp is not one of a host's private directories
    pids: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, daemon) -> pid inside the host

    @property
    def conf(self) -> Path:
        return self.shared / "slurm.conf"

    def ssh(self, host: str, command: str, timeout: float = 60, check: bool = True) -> str:
        env = f"export SLURM_CONF={self.conf} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; "
        proc = subprocess.run(["ssh", "-F", str(self.bed.ssh_config), host, env + command],
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"{host}: `{command}` failed ({proc.returncode}): {proc.stderr}{proc.stdout}")
        return proc.stdout

    def write_config(self) -> None:
        hosts = self.bed.hosts
        (self.shared / "state").mkdir()
        key = self.shared / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port = free_port()
        slurmd_port = next(p for p in iter(free_port, None) if p != ctld_port)
        nodes = "\n".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs={os.cpu_count()} Features=ugro-{h.name} State=UNKNOWN"
            for h in hosts
        )
        self.conf.write_text(f"""\
# A test cluster of ugro's tests/test_slurm.py: private state, logs and sockets, no accounting, no cgroups.
ClusterName=ugrotest
SlurmctldHost={hosts[0].name}({hosts[0].address})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=socket=/run/ugro-slurm/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.shared}/state
SlurmdSpoolDir=/run/ugro-slurm/spool
SlurmctldPidFile=/run/ugro-slurm/slurmctld.pid
SlurmdPidFile=/run/ugro-slurm/slurmd.pid
SlurmctldLogFile={self.shared}/slurmctld.log
SlurmdLogFile={self.shared}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
{nodes}
PartitionName=ugro Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        # slurmd 22.05 always loads a cgroup plugin; v1 only looks for its mounts once a cgroup is used.
        (self.shared / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _start(self, host: str, daemon: str, command: str, pid_file: str) -> None:
        self.ssh(host, "mkdir -p /run/ugro-slurm/spool && chmod 755 /run/ugro-slurm && " + command)
        deadline = time.monotonic() + 20
        while True:
            out = self.ssh(host, f"cat {pid_file} 2>/dev/null; true").strip()
            if out.isdigit():
                self.pids[(host, daemon)] = int(out)
                return
            assert time.monotonic() < deadline, f"{host}: {daemon} wrote no pid file {pid_file}"
            time.sleep(0.2)

    def start(self) -> None:
        for host in self.bed.hosts:
            self._start(host.name, "munged",
                        f"munged --force --key-file={self.shared}/munge.key --socket=/run/ugro-slurm/munge.socket "
                        f"--pid-file=/run/ugro-slurm/munged.pid --log-file={self.shared}/munged-{host.name}.log "
                        "--seed-file=/run/ugro-slurm/munged.seed", "/run/ugro-slurm/munged.pid")  # fmt: skip
        self._start(self.bed.hosts[0].name, "slurmctld", "slurmctld", "/run/ugro-slurm/slurmctld.pid")
        for host in self.bed.hosts:
            self._start(host.name, "slurmd", "slurmd", "/run/ugro-slurm/slurmd.pid")
        self.wait(lambda: self.sinfo() == ["idle"] * len(self.bed.hosts), 60, "every node idle")

    def sinfo(self) -> list[str]:
        return sorted(self.ssh("tb1", "sinfo -h -N -o %T", check=False).split())

    def queue(self) -> dict[str, str]:
        """Job id -> state of every job SLURM still holds (pending, running, completing)."""
        out = self.ssh("tb1", "squeue -h -o '%i %T'")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:.0f} s: {what}\n{self.diagnosis()}")
            time.sleep(1)

    def diagnosis(self) -> str:
        parts = []
        for log in sorted(self.shared.glob("**/*.log")):
            if log.is_file():
                parts.append(f"--- {log.relative_to(self.shared)}\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)[-8000:]

    def stop(self) -> list[str]:
        """Cancel every job, then end exactly the daemons this cluster started; what is left, by name."""
        if ("tb1", "slurmctld") in self.pids:
            self.ssh("tb1", "scancel --full --user=root", check=False)
        left = []
        for (host, daemon), pid in reversed(list(self.pids.items())):
            # Only our own daemon: the pid (inside the host's PID namespace) still runs that program.
            alive = f'[ "$(cat /proc/{pid}/comm 2>/dev/null)" = {daemon} ]'
            self.ssh(host, f"{alive} && kill {pid}; for i in $(seq 50); do {alive} || exit 0; sleep 0.2; done; "
                           f"kill -9 {pid}; sleep 0.5; {alive} && echo left", check=False)  # fmt: skip
            if self.ssh(host, f"{alive} && echo left; true", check=False).strip():
                left.append(f"{daemon} {pid} on {host}")
        return left


@pytest.fixture(scope="module")
def slurm_cluster(testbed: Any) -> Iterator[SlurmCluster]:
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        unavailable(f"SLURM is not installed here (no {', '.join(missing)}): apt-get install slurmctld slurmd "
                    "slurm-client munge")  # fmt: skip
    cluster = SlurmCluster(testbed, Path(tempfile.mkdtemp(prefix="ugro-slurm-", dir="/var/tmp")))
    try:
        cluster.write_config()
        cluster.start()
        yield cluster
    finally:
        left = cluster.stop()
        shutil.rmtree(cluster.shared, ignore_errors=True)
    assert not left, f"SLURM daemons left running: {left}"


def _job_processes(run_dir: Path, job_id: str) -> list[str]:
    """Processes of the job on any test host: naming its run directory, or in its SLURM environment."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            in_job = proc.info["name"] not in ("slurmd", "slurmctld", "slurmstepd", "munged") and (
                proc.environ().get("SLURM_JOB_ID") == job_id
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(run_dir) in cmdline or in_job:
            found.append(f"{proc.info['pid']} {cmdline[:120]}")
    return found


def _log(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run_dir / "logs").glob("*-rank0.log")))


def _step(run_dir: Path) -> int:
    rows = read_metrics(run_dir)
    return int(rows[-1]["step"]) if rows else 0


def test_sbatch_trains_checkpoints_on_the_warning_requeues_and_scancel_leaves_nothing(
    slurm_cluster: SlurmCluster,
) -> None:
    cluster, shared = slurm_cluster, slurm_cluster.shared
    steps = 24
    job_file = write_job(shared / "job.yaml", name="slurm-test", train={"max_steps": steps, "log_every": 4},
                         checkpoint={"every": 4, "keep_last": 10})  # fmt: skip
    # tb1 and tb2 carry the features ugro-tb1 / ugro-tb2 (slurm.conf): the map gives tb2 a profile of its own.
    pmap = _map(shared, {"profiles": {"small": {"micro_batch_size": 1}, "cpu": {"micro_batch_size": 4}},
                         "match": [{"feature": "ugro-tb2", "profile": "small"}], "default": "cpu"})  # fmt: skip
    done = slurm.export(job_file, slurm.SlurmOptions(nodes=2, cpus_per_task=1), REPO, PYTHON, shared / "runs",
                        pmap, job_id="slurm-test-1")  # fmt: skip
    run_dir = done.run_dir
    submit = f"sbatch --parsable {done.script}"
    began, phases = time.monotonic(), {}  # seconds from submission to each milestone (pytest -s shows them)

    # 1. SLURM's warning before the time limit (what --signal=B:USR1@N sends): checkpoint, stop, requeue, resume.
    job_id = cluster.ssh("tb1", submit).strip()
    cluster.wait(lambda: _step(run_dir) >= 5, 240, "the first submission reached step 5")
    phases["first submission at step 5"] = time.monotonic() - began
    cluster.ssh("tb1", f"scancel --batch --signal=USR1 {job_id}")
    cluster.wait(lambda: "checkpoint of step" in _log(run_dir), 60, "the ranks stopped after a checkpoint")
    stopped_at = int(re.findall(r"checkpoint of step (\d+) written", _log(run_dir))[0])
    assert (run_dir / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    cluster.wait(lambda: f"resumed from {run_dir}/checkpoints/step-{stopped_at:06d}" in _log(run_dir), 240,
                 "the requeued job resumed from the warning's checkpoint")  # fmt: skip
    phases["requeued job resumed"] = time.monotonic() - began
    assert "requeueing job" in (run_dir / "slurm" / "batch.log").read_text()
    assert [line.split()[:2] for line in (run_dir / "slurm" / "submissions").read_text().splitlines()] == [
        [job_id, "0"], [job_id, "1"]]  # fmt: skip

    # 2. scancel of the running, requeued job: nothing of it is left on any host.
    cluster.wait(lambda: _step(run_dir) >= stopped_at + 2, 120, "the requeued job trained on")
    assert _job_processes(run_dir, job_id)
    cluster.ssh("tb1", f"scancel {job_id}")
    cluster.wait(lambda: job_id not in cluster.queue(), 60, "scancel ended the job")
    cluster.wait(lambda: not _job_processes(run_dir, job_id), 20, "no process of the job is left")
    phases["scancel: nothing left"] = time.monotonic() - began

    # 3. The same script again: a second submission resumes from the newest checkpoint and finishes.
    newest = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    second = cluster.ssh("tb1", submit).strip()
    cluster.wait(lambda: second not in cluster.queue(), 300, "the second submission finished")
    phases["second submission finished"] = time.monotonic() - began
    print("SLURM test phases (s):", {k: round(v, 1) for k, v in phases.items()})
    assert f"resumed from {run_dir}/checkpoints/step-{newest:06d} at step {newest}" in _log(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["state"] == "finished", run
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1))
    for name in ("adapter/adapter_model.safetensors", "loss.png", "hosts/tb1/torchrun.log", "hosts/tb2/torchrun.log"):
        assert (run_dir / name).is_file(), name
    assert sorted(p.name.split("-")[0] for p in (run_dir / "logs").glob("*-rank*.log")) == ["tb1", "tb2"]
    assert [(run_dir / "hosts" / h / "exit_code").read_text().strip() for h in ("tb1", "tb2")] == ["0", "0"]
    assert "memory profile small (feature ugro-tb2" in (run_dir / "hosts" / "tb2" / "torchrun.log").read_text()
    assert "memory profile cpu (no rule matched" in (run_dir / "hosts" / "tb1" / "torchrun.log").read_text()
    assert not _job_processes(run_dir, second)

    # ugro reads the run like any other: status from the run directory, the adapter loads as peft's.
    result = CliRunner().invoke(cli.app, ["status", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "run: finished, step 24/24" in result.output and "finished" in result.output
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
