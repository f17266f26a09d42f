"""The host fact module and the job module, run for real through `ansible` against this machine.

What a user relies on: the interface holding the cluster address is found, a host without a GPU says
why it has none, a job starts detached in a session of its own and is recorded, a job counts as running
only while its own recorded processes live, stopping a job signals nothing but those, and bad input or a
missing psutil is one error naming the host and the key.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import run_module

from ugro.module_utils import ugro_jobstate

REPO = Path(__file__).resolve().parent.parent
HOST = "node4070"  # the inventory name the roles pass as `host`

# Every test here runs a host module through the real `ansible` (helpers.run_module).
pytestmark = pytest.mark.usefixtures("ansible_module")


def _facts(**args: Any) -> dict[str, Any]:
    result = run_module("ugro_host_facts", {"host": HOST, **args})
    assert not result.get("failed"), result.get("msg")
    return dict(result["ansible_facts"]["ugro_host"])


def _fake_smi(tmp_path: Path, body: str) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return str(smi)


def test_the_interface_holding_the_cluster_address_is_found() -> None:
    facts = _facts(gather_subset=["network"], cluster_address="127.0.0.1", cluster_interface_required=True)
    assert facts["cluster"] == {
        "address": "127.0.0.1",
        "interface": "lo",
        "prefix": 8,
        "subnet": "127.0.0.0/8",
        "why": None,
    }
    assert "127.0.0.1" in facts["interfaces"]["lo"]


def test_an_address_no_interface_holds_fails_naming_host_and_address() -> None:
    result = run_module(
        "ugro_host_facts",
        {
            "host": HOST,
            "gather_subset": ["network"],
            "cluster_address": "192.0.2.254",
            "cluster_interface_required": True,
        },
    )
    assert result["failed"]
    assert f"{HOST}: no interface holds its cluster address 192.0.2.254" in result["msg"]
    assert "ugro_cluster_address" in result["msg"]


def test_a_malformed_cluster_address_is_one_error_naming_host_and_key() -> None:
    result = run_module("ugro_host_facts", {"host": HOST, "cluster_address": "10.0.0"})
    assert result["failed"]
    assert result["msg"].startswith(f"{HOST}: cluster_address '10.0.0' is not an IPv4 address")


def test_a_host_without_nvidia_smi_has_no_gpu_and_says_why(tmp_path: Path) -> None:
    gpu = _facts(gather_subset=["gpu"], nvidia_smi=str(tmp_path / "nvidia-smi"))["gpu"]
    assert gpu["gpus"] == [] and gpu["count"] == 0
    assert gpu["smi"] == "missing"
    assert gpu["why"] == f"no nvidia-smi at {tmp_path / 'nvidia-smi'}"


def test_a_failing_nvidia_smi_is_reported_with_its_error(tmp_path: Path) -> None:
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    gpu = _facts(gather_subset=["gpu"], nvidia_smi=_fake_smi(tmp_path, f'echo "{said}"; exit 9'))["gpu"]
    assert gpu["count"] == 0 and gpu["smi"] == "failed"
    assert gpu["why"] == f"nvidia-smi failed (rc 9): {said}"


def test_a_hung_nvidia_smi_is_reported_as_hung(tmp_path: Path) -> None:
    gpu = _facts(gather_subset=["gpu"], nvidia_smi=_fake_smi(tmp_path, "exec sleep 30"), timeout_s=1)["gpu"]
    assert gpu["count"] == 0 and gpu["smi"] == "hung"
    assert gpu["why"] == "nvidia-smi hung for 1 s"


def test_gpus_come_with_name_memory_compute_capability_and_driver(tmp_path: Path) -> None:
    rows = (
        "0, NVIDIA GeForce RTX 5070 Ti, 12227, 580.173.02, 12.0\n1, NVIDIA GeForce RTX 3070 Ti, 8192, 580.173.02, 8.6"
    )
    smi = _fake_smi(tmp_path, f"echo \"$*\" >> {tmp_path}/asked; printf '{rows}\\n'")
    gpu = _facts(gather_subset=["gpu"], nvidia_smi=smi)["gpu"]
    assert gpu["smi"] == "ok" and gpu["why"] is None and gpu["driver"] == "580.173.02"
    assert gpu["gpus"] == [
        {"index": 0, "name": "NVIDIA GeForce RTX 5070 Ti", "memory_mib": 12227, "memory_bytes": 12227 << 20,
         "compute_cap": "12.0"},
        {"index": 1, "name": "NVIDIA GeForce RTX 3070 Ti", "memory_mib": 8192, "memory_bytes": 8192 << 20,
         "compute_cap": "8.6"},
    ]  # fmt: skip
    asked = (tmp_path / "asked").read_text()
    assert asked == "--query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv,noheader,nounits\n"


def test_an_nvidia_smi_without_compute_cap_still_lists_the_gpus(tmp_path: Path) -> None:
    """Drivers older than the compute_cap field refuse the whole query: the module asks again without it."""
    body = (
        'case "$1" in *compute_cap*) echo \'Field "compute_cap" is not a valid field to query.\' >&2; exit 2 ;; esac\n'
        "printf '0, NVIDIA GeForce GTX 1080, 8192, 470.256.02\\n'"
    )
    gpu = _facts(gather_subset=["gpu"], nvidia_smi=_fake_smi(tmp_path, body))["gpu"]
    assert gpu["smi"] == "ok" and gpu["driver"] == "470.256.02", gpu
    assert [(g["name"], g["compute_cap"]) for g in gpu["gpus"]] == [("NVIDIA GeForce GTX 1080", None)]


def test_versions_are_the_job_pythons_without_importing_torch() -> None:
    facts = _facts(gather_subset=["versions"], python=sys.executable)
    import importlib.metadata

    import torch
    import transformers

    # The wheel's metadata: the registry's CUDA build says 2.13.0 there and 2.13.0+cu130 in torch.__version__.
    assert facts["versions"]["torch"] == importlib.metadata.version("torch")
    assert torch.__version__.split("+")[0] == facts["versions"]["torch"]
    assert facts["versions"]["transformers"] == transformers.__version__
    assert facts["versions"]["python"] == facts["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert facts["versions"]["cuda runtime"] == torch.version.cuda


class Job:
    """A run directory laid out as the launch leaves it, with processes whose command line names it."""

    def __init__(self, code_dir: Path, job_id: str) -> None:
        self.code_dir, self.job_id = code_dir, job_id
        self.run_dir = code_dir / "runs" / job_id
        self.host_dir = self.run_dir / "hosts" / HOST
        self.host_dir.mkdir(parents=True)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, record: str | None) -> subprocess.Popen[bytes]:
        """A process of this run (its command line names the run directory), recorded under ``record``."""
        proc = subprocess.Popen(["sh", "-c", "sleep 300", str(self.host_dir / "launch.sh")], start_new_session=True)
        self.procs.append(proc)
        if record:
            (self.host_dir / f"{record}.pid").write_text(f"{proc.pid}\n")
        return proc

    def state(self) -> dict[str, Any]:
        facts = _facts(gather_subset=["job"], code_dir=str(self.code_dir), job_id=self.job_id)
        return {"job": facts["job"], "running_job": facts["running_job"]}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path / "code", "default-20261121-190000")
    yield made
    made.close()


def test_a_job_runs_while_its_recorded_process_lives(job: Job) -> None:
    launcher = job.start(record="launch")
    (job.code_dir / "runs" / "active-job").write_text(f"{job.job_id} {launcher.pid}\n")
    state = job.state()
    assert state["job"]["state"] == "running" and state["job"]["pids"] == {"launcher": launcher.pid}
    assert state["running_job"] == {"job": job.job_id, "pgid": launcher.pid}

    launcher.kill()
    launcher.wait()
    state = job.state()
    assert state["job"]["state"] == "lost" and state["job"]["pids"] == {}  # gone without an exit code
    assert state["running_job"] is None
    (job.host_dir / "exit_code").write_text("0\n")
    assert job.state()["job"]["state"] == "finished"


def test_a_recorded_pid_reused_by_another_process_is_not_the_job(job: Job) -> None:
    (job.host_dir / "launch.pid").write_text(f"{os.getpid()}\n")  # alive, but its command line names no run
    (job.code_dir / "runs" / "active-job").write_text(f"{job.job_id} {os.getpid()}\n")
    state = job.state()
    assert state["job"]["state"] == "lost" and state["job"]["pids"] == {}
    assert state["running_job"] is None


def test_stop_signals_no_process_of_another_user_or_another_start_that_a_pid_file_names(job: Job) -> None:
    """The pid files are the job's user's to write: one that names another user's process (root's, say) whose
    command line names the run, or a process that started after the pid was recorded (a reused pid), is not the
    job's, and a stop leaves it alone."""
    other_user = subprocess.Popen(["sh", "-c", "sleep 300", str(job.host_dir / "launch.sh")], start_new_session=True,
                                  user=65534)  # nobody: not the run directory's owner  # fmt: skip
    job.procs.append(other_user)
    (job.host_dir / "worker-rank0.pid").write_text(f"{other_user.pid}\n")
    later = job.start(record=None)
    started = psutil.Process(later.pid).create_time()
    (job.host_dir / "worker-rank1.pid").write_text(f"{later.pid} {started - 60:.3f}\n")  # recorded a minute before
    args = {"code_dir": str(job.code_dir), "job_id": job.job_id, "host": HOST, "grace_s": 5}
    result = run_module("ugro_job", args)
    assert not result["changed"] and result["signalled"] == {}, result
    assert other_user.poll() is None and later.poll() is None


def test_stop_signals_only_the_jobs_own_recorded_processes(job: Job) -> None:
    launcher = job.start(record="launch")
    worker = job.start(record="worker-rank0")
    stranger = job.start(record=None)  # names the run too, but the job never recorded it
    (job.code_dir / "runs" / "active-job").write_text(f"{job.job_id} {launcher.pid}\n")
    args = {"code_dir": str(job.code_dir), "job_id": job.job_id, "host": HOST, "grace_s": 5}

    planned = run_module("ugro_job", args, check=True)
    assert planned["changed"] and planned["signalled"] == {"launcher": launcher.pid, "worker-rank0": worker.pid}
    assert launcher.poll() is None and worker.poll() is None  # check mode signals nothing

    result = run_module("ugro_job", args)
    assert result["changed"] and not result.get("failed")
    assert result["signalled"] == {"launcher": launcher.pid, "worker-rank0": worker.pid}
    assert result["remaining"] == {}
    assert launcher.wait(timeout=10) != 0 and worker.wait(timeout=10) != 0
    assert stranger.poll() is None
    assert job.state()["job"]["state"] == "stopped"
    assert not (job.code_dir / "runs" / "active-job").exists()

    again = run_module("ugro_job", args)
    assert not again["changed"] and again["signalled"] == {}


LAUNCH_SCRIPT = """#!/usr/bin/env bash
host_dir="$(dirname "$0")"
exec </dev/null >"${host_dir}/torchrun.log" 2>&1
printf '%s\\n' "$$" >"${host_dir}/launch.pid"
echo started
sleep 300
"""


def test_start_runs_the_launch_script_in_a_session_of_its_own_and_records_the_job(job: Job) -> None:
    for stale in ("launch.pid", "exit_code", "stopped"):  # an earlier launch of the run left these
        (job.host_dir / stale).write_text("1\n")
    args = {"code_dir": str(job.code_dir), "job_id": job.job_id, "host": HOST}
    result = run_module("ugro_job", {**args, "state": "started", "script": LAUNCH_SCRIPT})
    assert result["changed"] and not result.get("failed"), result.get("msg")
    pgid = result["pgid"]
    try:
        assert (job.host_dir / "launch.pid").read_text().split() == [str(pgid)]
        assert os.getsid(pgid) == pgid  # leads its own session: its pid is the job's process group
        assert (job.code_dir / "runs" / "active-job").read_text() == f"{job.job_id} {pgid}\n"
        assert not (job.host_dir / "exit_code").exists() and not (job.host_dir / "stopped").exists()
        assert os.access(job.host_dir / "launch.sh", os.X_OK)
        state = job.state()
        assert state["job"]["state"] == "running" and state["job"]["pids"] == {"launcher": pgid}
        assert state["running_job"] == {"job": job.job_id, "pgid": pgid}
    finally:
        stopped = run_module("ugro_job", {**args, "grace_s": 5})
    assert stopped["signalled"] == {"launcher": pgid} and stopped["remaining"] == {}
    assert (job.host_dir / "torchrun.log").read_text() == "started\n"


def test_a_launch_script_that_ends_before_its_pid_is_one_error_with_its_log(job: Job) -> None:
    script = '#!/usr/bin/env bash\nexec >"$(dirname "$0")/torchrun.log" 2>&1\necho "no such python"\nexit 3\n'
    args = {"code_dir": str(job.code_dir), "job_id": job.job_id, "host": HOST, "state": "started", "script": script}
    result = run_module("ugro_job", args)
    assert result["failed"]
    assert result["msg"].startswith(f"{HOST}: job {job.job_id} did not start: ")
    assert "exited with 3 before it wrote its pid" in result["msg"] and "no such python" in result["msg"]
    assert not (job.code_dir / "runs" / "active-job").exists()


def test_files_says_what_a_launch_would_run_exists_and_runs(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: x\n")
    missing = str(tmp_path / "missing.yaml")
    facts = _facts(gather_subset=["files"], paths=[sys.executable, str(job_file), missing])
    assert facts["files"] == {
        sys.executable: {"exists": True, "regular": True, "executable": True},
        str(job_file): {"exists": True, "regular": True, "executable": False},
        missing: {"exists": False, "regular": False, "executable": False},
    }


def test_a_bad_job_id_is_one_error_naming_host_and_key(tmp_path: Path) -> None:
    result = run_module("ugro_job", {"code_dir": str(tmp_path), "job_id": "../etc", "host": HOST})
    assert (
        result["failed"] and result["msg"] == f"{HOST}: job_id '../etc' is not a job id such as default-20261121-190000"
    )
    # `$` would let a trailing newline through (a path, a log line or a command of two lines).
    assert ugro_jobstate.JOB_ID.match("default-1") and not ugro_jobstate.JOB_ID.match("default-1\n")
    assert run_module("ugro_job", {"code_dir": str(tmp_path), "job_id": "default-1\n", "host": HOST})["failed"]


def test_a_python_without_psutil_fails_naming_host_and_fix(tmp_path: Path) -> None:
    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    bare = str(tmp_path / "bare" / "bin" / "python")
    assert subprocess.run([bare, "-c", "import psutil"], capture_output=True, check=False).returncode != 0
    for module, args in (
        ("ugro_host_facts", {"host": HOST}),
        ("ugro_job", {"code_dir": "/x", "job_id": "j", "host": HOST}),
    ):
        result = run_module(module, args, python=bare)
        assert result["failed"], module
        assert result["msg"].startswith(f"{HOST}: the Python that runs Ansible modules there ({bare}")
        assert f"cannot import psutil, which {module} needs" in result["msg"]
        assert "apt install python3-psutil" in result["msg"]


def test_facts_of_this_machine_hold_every_key_preflight_reads(tmp_path: Path) -> None:
    facts = _facts(
        cluster_address="127.0.0.1",
        python=sys.executable,
        code_dir=str(REPO),
        disk_path=str(tmp_path / "not-yet" / "checkpoints"),
        env_file=str(tmp_path / "nccl.env"),
        profile_file=str(tmp_path / "profile.yaml"),
        names=["localhost"],
    )
    assert facts["host"] == HOST and facts["hostname"]
    assert facts["code"]["hash"] and facts["code"]["why"] is None
    assert facts["disk"]["measured_at"] == str(tmp_path) and facts["disk"]["free_bytes"] > 0
    assert 0 < facts["memory"]["available_bytes"] <= facts["memory"]["total_bytes"]
    low, high = map(int, facts["port_range"].split("-"))
    assert 1024 <= low < high <= 65535
    assert facts["env_file"] == {"path": str(tmp_path / "nccl.env"), "exists": False, "error": None, "ifnames": {}}
    assert facts["profile_exists"] is False
    assert facts["resolve"]["localhost"]["address"].startswith("127.")
    assert abs(facts["time"] - time.time()) < 60


def test_the_firewall_subset_reads_the_live_rules_of_this_machine() -> None:
    # Read only: this machine has no ugro table (role firewall is never applied here), so nftables reports it absent.
    facts = _facts(gather_subset=["firewall"], firewall_table="ugro-test-absent")
    firewall = facts["firewall"]
    assert set(firewall) == {"nftables", "ufw", "why"}
    if firewall["nftables"] is not None:
        assert firewall["nftables"] == {"table": "ugro-test-absent", "present": False, "rules": []}
    else:
        assert firewall["why"] or not Path("/usr/sbin/nft").exists()


def test_a_service_listening_inside_the_ephemeral_range_is_listed_with_its_process() -> None:
    """What role firewall's reset of the range would cut off from the LAN (preflight's firewall row warns)."""
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    with socket.socket() as inside, socket.socket() as loopback_only:
        inside.bind(("0.0.0.0", 0))  # the kernel picks a port of the ephemeral range, as NFS's rpc ports get theirs
        inside.listen()
        loopback_only.bind(("127.0.0.1", 0))
        loopback_only.listen()
        port, local = inside.getsockname()[1], loopback_only.getsockname()[1]
        assert low <= port <= high
        facts = _facts(gather_subset=["ports"])
    listed = {entry["port"]: entry for entry in facts["range_listeners"]}
    assert listed[port]["process"].startswith("python") and listed[port]["address"] == "0.0.0.0", listed
    assert local not in listed  # loopback only: no device of the LAN reached it anyway


def test_files_planted_in_the_run_directory_neither_hang_nor_flood_a_status(job: Job) -> None:
    """The run directory is the job user's; what a root reader (the exporter, a module with become) reads there is
    opened without following a link and without waiting on a FIFO, and read up to a bound: a FIFO where a rank's
    record goes, a link to /dev/zero as run.json and one to a root file as failures.jsonl cost a status nothing."""
    os.mkfifo(job.host_dir / "rank0.json")
    os.mkfifo(job.run_dir / "metrics.jsonl")
    (job.run_dir / "run.json").symlink_to("/dev/zero")
    secret = job.code_dir / "root-only.jsonl"
    secret.write_text('{"kind": "error", "message": "root\'s secret", "attempt": 0}\n')
    (job.host_dir / "failures.jsonl").symlink_to(secret)
    (job.host_dir / "exit_code").write_text("0\n")
    done: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: done.append(ugro_jobstate.status(job.run_dir, HOST, True)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert done, "the status hung on a planted file"
    assert done[0]["state"] == "finished" and done[0]["failures"] == [], done[0]
