"""report_to: [mlflow, wandb] for real: MLflow against a real `mlflow server` (read back through MlflowClient), W&B in
offline mode (its run file read back as W&B's own protobuf records). One real `ugro train` run on this machine holds
the end-to-end asserts of both trackers; resuming, a remote cluster's backfill and unreachable trackers run the feed
(ugro/tracking/feed.py) on prepared records."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import RUNS_ENV, closed_port, copy_checkout, free_port, run_env, small_job
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from train.config import JobConfig
from ugro.hosts.playbook import REPO
from ugro.tracking.feed import Feed

MLFLOW = REPO / ".venv-mlflow" / "bin" / "mlflow"
PYTHON = REPO / ".venv" / "bin" / "python"


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on a free loopback port (`make mlflow-server`, as a user starts it), its store in a
    temporary directory; stopped by its own process group at the end."""
    if not MLFLOW.is_file():
        pytest.fail(f"{MLFLOW} missing: `make mlflow-venv` builds it (make test depends on it)")
    store = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (store / "server.log").open("w")
    server = subprocess.Popen(
        ["make", "--no-print-directory", "mlflow-server", f"PORT={port}", f"MLFLOW_STORE={store}", "MLFLOW_WORKERS=1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(store / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(3)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def wandb_records(run_file: Path) -> list[Any]:
    """W&B's records of a run (wandb_internal_pb2.Record), read from its .wandb file: W&B's log format of 32 KiB
    blocks, each record a 7-byte header (CRC-32C, length, type: full, first, middle, last) and its bytes."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    pos, block, pending, found = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's zero padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def wandb_history(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[int], set[str]]:
    """Of every offline W&B run in ``run_dir``/wandb: the history rows, the config, the exit codes, the run ids."""
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    exits: list[int] = []
    ids: set[str] = set()
    for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
            elif kind == "config":
                config |= {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.config.update}
            elif kind == "exit":
                exits.append(record.exit.exit_code)
            elif kind == "run":
                ids.add(record.run.run_id)
    return rows, config, exits, ids


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _wandb_core_of(pid: int) -> list[int]:
    """wandb-core processes started for the process ``pid`` (its command line names the parent's pid)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"wandb-core") and str(pid).encode() in args:
            found.append(int(proc.name))
    return found


# --------------------------------------------------------------------------------------------------
# One real run: `ugro train` on this machine, reporting to both trackers.


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, mlflow_uri: str) -> tuple[Path, str, int]:
    """A real 6-step run of `ugro train` (inventory/local.yml, 2 CPU ranks) with report_to: [mlflow, wandb]: the
    MLflow server from the environment (MLFLOW_TRACKING_URI), W&B offline from the job; its run directory, its
    output, the CLI's pid."""
    checkout = copy_checkout(tmp_path_factory.mktemp("checkout"))
    name = f"track-{free_port()}"
    job = small_job(name=name, train={"max_steps": 6, "log_every": 1}, checkpoint={"every": 6},
                    eval={"source": "data/sample/eval.jsonl", "every": 3, "samples": 1, "max_new_tokens": 8},
                    report_to=["mlflow", "wandb"], wandb={"mode": "offline"})  # fmt: skip
    (checkout / "jobs" / f"{name}.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    inventory = yaml.safe_load((checkout / "inventory" / "local.yml").read_text())
    host = inventory["all"]["children"]["ugro_cluster"]["hosts"]["localhost"]
    host |= {"ugro_rendezvous_port": free_port(), "ugro_code_dir": str(checkout)}
    (checkout / "inventory" / "local.yml").write_text(yaml.safe_dump(inventory))
    env = run_env() | {"PYTHONPATH": str(checkout), RUNS_ENV: str(checkout / "runs"), "MLFLOW_TRACKING_URI": mlflow_uri,
                       "MLFLOW_EXPERIMENT_NAME": name, "WANDB_MODE": "online", "SKIP_PREFLIGHT": "1"}  # fmt: skip
    proc = subprocess.Popen([str(PYTHON), "-m", "ugro.cli", "train", "--job", f"jobs/{name}.yaml"], cwd=checkout,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    run_dir = Path(out.split("run finished:")[1].split()[0])
    return run_dir, out, proc.pid


def test_a_real_run_is_one_finished_mlflow_run_with_its_params_metrics_and_files(
    trained: tuple[Path, str, int], mlflow_uri: str
) -> None:
    run_dir, out, _ = trained
    assert "warning" not in out, out
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(run_dir.name.rsplit("-", 2)[0])
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    ids = json.loads((run_dir / "tracking.json").read_text())["trackers"]
    assert ids["mlflow"]["ids"]["run_id"] == run.info.run_id and run.info.status == "FINISHED"
    params = run.data.params
    assert params["ugro.job_id"] == run_dir.name and params["train.max_steps"] == "6" and params["optim.lr"] == "0.003"
    assert params["ugro.hosts"] == '["localhost"]' and len(params["ugro.code_hash"]) >= 12
    assert run.data.tags["device.localhost.rank0"] and run.data.tags["device.localhost.rank1"]
    # Every logged step's loss once, equal to metrics.jsonl's; the per-host share, the held-out losses.
    rows = _rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], r["loss"]) for r in rows]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] == [1, 2, 3, 4, 5, 6]
    share = client.get_metric_history(run.info.run_id, "host/localhost/share")
    assert [round(m.value, 6) for m in share] == [1.0] * 6
    # Each rank's peak memory (its process's resident set here), carried by the step's exchange from step 2 on.
    for rank in (0, 1):
        memory = client.get_metric_history(run.info.run_id, f"rank{rank}/peak_gib")
        assert [m.step for m in memory] == [2, 3, 4, 5, 6] and all(0.1 < m.value < 64 for m in memory), memory
        assert [m.value for m in memory] == [r["ranks"]["peak_gib"][rank] for r in rows[1:]]
    evals = _rows(run_dir / "eval.jsonl")
    tuned = [(r["step"], r["eval_loss"]) for r in evals if r["model"] == "fine-tuned"]
    assert tuned and [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss")] == tuned
    base = client.get_metric_history(run.info.run_id, "base_eval_loss")
    assert [(m.step, m.value) for m in base] == [(0, evals[0]["eval_loss"])]
    # The run's files.
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"adapter", "loss.png", "samples.md", "model-card"} <= top, top
    adapter = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= adapter, adapter
    card = Path(client.download_artifacts(run.info.run_id, "model-card/README.md", str(run_dir / ".control")))
    assert card.read_text().startswith("---\nbase_model:")


def test_a_real_run_is_one_finished_offline_wandb_run_with_its_history_and_config(
    trained: tuple[Path, str, int],
) -> None:
    run_dir, _, pid = trained
    rows, config, exits, ids = wandb_history(run_dir)
    assert len(ids) == 1 and exits == [0]
    metrics = _rows(run_dir / "metrics.jsonl")
    logged = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert logged == [(r["step"], r["loss"]) for r in metrics]
    tuned = [(r["step"], r["eval_loss"]) for r in _rows(run_dir / "eval.jsonl") if r["model"] == "fine-tuned"]
    assert [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r] == tuned
    assert config["train"]["max_steps"] == 6 and config["ugro"]["job_id"] == run_dir.name
    assert config["wandb"]["mode"] == "offline"  # the job's key won over WANDB_MODE=online
    assert not _wandb_core_of(pid)  # W&B's service process ended with the run


# --------------------------------------------------------------------------------------------------
# The feed on prepared records.


def _job(name: str, **tracking: Any) -> JobConfig:
    return JobConfig.model_validate(small_job(name=name, **tracking))


def _write_rows(run_dir: Path, steps: range, evals: list[int]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = {"host": ["a", "b"], "share": [0.75, 0.25], "ready_s": [0.1, 0.3], "tokens_per_s": [900.0, 300.0]}
    with (run_dir / "metrics.jsonl").open("a") as out:
        for s in steps:
            row = {"step": s, "total_steps": 10, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens": 100,
                   "tokens_per_s": 1000.0 + s, "eta_s": 10.0 - s, "time": time.time(), "ranks": ranks}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    with (run_dir / "eval.jsonl").open("a") as out:
        for s in evals:
            out.write(json.dumps({"step": s, "eval_loss": 4.0 - s / 10, "tokens": 50,
                                  "model": "base" if s == 0 else "fine-tuned"}) + "\n")  # fmt: skip


def test_a_resumed_run_continues_the_same_tracker_runs_each_step_once(mlflow_uri: str, tmp_path: Path) -> None:
    """`make train RESUME=auto` or `make follow` in the same run directory: the same MLflow and W&B runs, the steps
    continued, none logged twice; a poll that brings no new row logs nothing."""
    run_dir = tmp_path / "runs" / "resume-20260101-000000"
    job = _job("resume", report_to=["mlflow", "wandb"], mlflow={"tracking_uri": mlflow_uri, "experiment": "resume"},
               wandb={"mode": "offline", "project": "resume"})  # fmt: skip
    warnings: list[str] = []
    _write_rows(run_dir, range(1, 6), [0, 5])
    first = Feed.start(job, run_dir, "c0ffee", ["a", "b"], False, warnings.append, REPO)
    first.poll("a", {})
    first.poll("a", {})
    first.detach()  # Ctrl-C: left open
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("resume")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "RUNNING"
    _write_rows(run_dir, range(6, 11), [10])
    second = Feed.start(job, run_dir, "c0ffee", ["a", "b"], False, warnings.append, REPO)
    second.poll("a", {})
    second.finish("finished")
    assert warnings == []
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 11))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [5, 10]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "host/a/share")] == [0.75] * 10
    rows, config, exits, ids = wandb_history(run_dir)
    assert len(ids) == 1 and exits[-1] == 0  # one W&B run, continued in a second offline directory
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 11))
    assert config["ugro"]["code_hash"] == "c0ffee"


def test_a_remote_run_logs_each_polls_newest_row_and_the_rest_at_the_end(mlflow_uri: str, tmp_path: Path) -> None:
    """A remote cluster: a poll gives the main rank's newest row only (step, loss, tokens/s, ETA); the fetched
    metrics.jsonl fills in every other step and figure at the end, each once."""
    run_dir = tmp_path / "runs" / "remote-20260101-000000"
    run_dir.mkdir(parents=True)
    job = _job("remote", report_to=["mlflow"], mlflow={"tracking_uri": mlflow_uri, "experiment": "remote"})
    warnings: list[str] = []
    feed = Feed.start(job, run_dir, "c0ffee", ["a", "b"], True, warnings.append, REPO)
    for step in (2, 2, 5):
        feed.poll("a", {"a": {"state": "running", "step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0 + step,
                              "eta_s": 10.0 - step}, "b": {"state": "running"}})  # fmt: skip
        time.sleep(0.3)
    _write_rows(run_dir, range(1, 9), [0, 8])  # the records, as logs.yml fetched them
    feed.finish("failed")
    assert warnings == []
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("remote")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(1, 9))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] == list(range(1, 9))


def test_unreachable_trackers_are_one_warning_each_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed port, and online W&B without a key: one warning line each, naming the tracker, where and how to fix;
    no traceback, no hang, the records untouched."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    run_dir = tmp_path / "runs" / "down-20260101-000000"
    _write_rows(run_dir, range(1, 4), [0])
    before = (run_dir / "metrics.jsonl").read_text()
    uri = f"http://127.0.0.1:{closed_port()}"
    job = _job("down", report_to=["mlflow", "wandb"], mlflow={"tracking_uri": uri}, wandb={"mode": "online"})
    warnings: list[str] = []
    began = time.monotonic()
    feed = Feed.start(job, run_dir, "c0ffee", ["a"], False, warnings.append, REPO)
    feed.poll("a", {})
    feed.finish("finished")
    assert time.monotonic() - began < 20
    assert len(warnings) == 2, warnings
    mlflow_line = next(w for w in warnings if w.startswith("MLflow"))
    assert uri in mlflow_line and "Connection refused" in mlflow_line and "make mlflow-server" in mlflow_line
    wandb_line = next(w for w in warnings if w.startswith("W&B"))
    assert "no API key" in wandb_line and "WANDB_API_KEY" in wandb_line and "wandb login" in wandb_line
    assert all("\n" not in w for w in warnings)
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert not list((run_dir / "wandb").glob("offline-run-*"))
