"""Collecting a job's results, the host module ugro_collect with its action plugin, run for real through `ansible`.

What a user relies on: `make logs` (and the end of `make train`) brings every host's logs and the main host's
results into the controller's run directory under the names the docs give them, leaves out what is not a result
(checkpoints, pid files), reports a second collection of the same files as no change, and an archive that would
write outside the run directory is refused.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from helpers import run_module

REPO = Path(__file__).resolve().parent.parent

HOST = "node4070"
RESULTS = yaml.safe_load((REPO / "roles/train_job/vars/main.yml").read_text())["train_job_result_pattern"]

pytestmark = pytest.mark.usefixtures("ansible_module")


def _host_run(root: Path) -> Path:
    run = root / "opt/ugro/runs/default-20261128-070000"
    files = {
        "logs/rank0.log": "step 1/2\n", "logs/rank1.log": "rank 1\n", f"hosts/{HOST}/torchrun.log": "torchrun\n",
        f"hosts/{HOST}/failures.jsonl": '{"rank": 1}\n', f"hosts/{HOST}/job.pid": "123\n",
        "adapter/adapter_config.json": "{}", "adapter/adapter_model.safetensors": "weights",
        "tensorboard/events.out": "events", "metrics.jsonl": "{}\n", "run.json": "{}", "loss.png": "png",
        "checkpoints/step-000002/state.pt": "state", "checkpoints/step-000002/manifest.json": "{}",
    }  # fmt: skip
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return run


def _collect(run: Path, dest: Path, main_host: bool) -> dict[str, object]:
    args = {"run_dir": str(run), "host": HOST, "dest": str(dest)} | ({"results": RESULTS} if main_host else {})
    return run_module("ugro_collect", args)


def test_the_main_host_brings_its_logs_and_results_under_their_names_and_a_second_time_changes_nothing(
    tmp_path: Path,
) -> None:
    run, dest = _host_run(tmp_path / "host"), tmp_path / "controller" / "runs" / "default-20261128-070000"
    first = _collect(run, dest, main_host=True)
    assert not first["failed"] and first["changed"], first.get("msg")
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert got == [
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", f"hosts/{HOST}/failures.jsonl",
        "logs/node4070-torchrun.log", "logs/rank0.log", "logs/rank1.log", "loss.png", "metrics.jsonl", "run.json",
        "tensorboard/events.out",
    ]  # fmt: skip
    assert (dest / "logs/node4070-torchrun.log").read_text() == "torchrun\n"
    assert (dest / "adapter/adapter_model.safetensors").read_text() == "weights"
    assert not list(tmp_path.glob("host/**/collect.tar")), "the archive stayed on the host"

    second = _collect(run, dest, main_host=True)
    assert not second["failed"] and not second["changed"], second
    (run / "logs/rank0.log").write_text("step 1/2\nstep 2/2\n")  # the run went on: only that log changes
    third = _collect(run, dest, main_host=True)
    assert third["changed"] and third["updated"] == ["logs/rank0.log"], third
    assert (dest / "logs/rank0.log").read_text().endswith("step 2/2\n")


def test_another_host_brings_its_logs_only_and_a_host_without_the_run_brings_nothing(tmp_path: Path) -> None:
    run, dest = _host_run(tmp_path / "host"), tmp_path / "controller"
    other = _collect(run, dest, main_host=False)
    assert not other["failed"], other.get("msg")
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        f"hosts/{HOST}/failures.jsonl", "logs/node4070-torchrun.log", "logs/rank0.log", "logs/rank1.log"
    ]  # fmt: skip
    empty = _collect(tmp_path / "nothing-here", tmp_path / "controller2", main_host=True)
    assert not empty["failed"] and not empty["changed"] and empty["files"] == [], empty


def test_an_archive_that_would_write_outside_the_run_directory_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "collect.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../outside.log")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    # In a process of its own: importing Ansible's controller side patches sys.intern, which torch's compiler (and so
    # transformers, imported by the tests after this one) refuses.
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, 'action_plugins'); "
        "from ugro_collect import unpack; unpack(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(archive), str(tmp_path / "dest")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode != 0 and "would land outside the run directory" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "outside.log").exists()


def test_a_checkpoint_and_the_runs_records_come_back_as_one_archive_the_controller_checks(tmp_path: Path) -> None:
    """What the controller copies while it follows a run (roles/train_job/tasks/checkpoint_fetch.yml)."""
    run, dest = _host_run(tmp_path / "host"), tmp_path / "controller" / "checkpoints" / ".incoming.tar"
    paths = ["checkpoints/step-000002", "metrics.jsonl", "eval.jsonl", "run.json"]  # no eval.jsonl: left out
    args = {"run_dir": str(run), "host": HOST, "paths": paths, "dest": str(dest), "unpack": False}
    result = run_module("ugro_collect", args)
    assert not result["failed"] and result["changed"], result.get("msg")
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == [
            "checkpoints/step-000002/manifest.json", "checkpoints/step-000002/state.pt", "metrics.jsonl", "run.json"
        ]  # fmt: skip
        state = tar.extractfile("checkpoints/step-000002/state.pt")
        assert state is not None and state.read() == b"state"
