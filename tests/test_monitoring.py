"""Seeing the cluster: the node exporter, the dashboard, a real Prometheus, the Grafana dashboard, the picture.

The main test runs ONE short job on the 3-host test cluster with role exporter's exporters on every host
(installed by the real playbook) and checks, while the job runs: every exporter serves its host's ranks and
passes `promtool check metrics`; Debian's `prometheus`, configured by `ugro prometheus-config`, has every
exporter up and sees the training series move; the Textual dashboard (Pilot) shows all three hosts and the
job, and marks tb3 OFFLINE within two polls of its exporter being stopped while the others keep updating.
The rest needs no cluster: the GPU part of the exporter against a stand-in NVML, the Grafana dashboard's
queries against what the exporter really exports, and the end-of-run picture.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from helpers import (
    PYTHON,
    REPO,
    Run,
    cli,
    free_port,
    remove_runs,
    run_env,
    runs_dir,
    start_exporters,
    unavailable,
    write_job,
)

from testbed import planted as planted_run
from train.metrics import plot_loss, rank_figures
from ugro.module_utils import ugro_exporter, ugro_jobstate
from ugro.monitoring import monitor
from ugro.monitoring.jobstates import ExporterStates
from ugro.run.follow import RemoteSource

GRAFANA = REPO / "ugro" / "monitoring" / "grafana-dashboard.json"
EXPORTER_ON_HOST = "/opt/ugro-exporter/ugro_exporter.py"
PID_FILE = "/run/ugro-exporter.pid"


def _promtool(text: str) -> str:
    """`promtool check metrics` on an exposition: its complaints ('' when clean)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool not found: apt-get install prometheus (Debian 12: 2.42)")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    return "" if out.returncode == 0 else out.stdout + out.stderr


# --------------------------------------------------------------------------------------------------
# The exporter without a cluster: a stand-in NVML, and a planted run.


class _NVMLError(Exception):
    pass


class _Timeout(_NVMLError):
    pass


def fake_nvml() -> Any:
    """Two GPUs the way nvidia-ml-py reports them (milliwatts, millijoules, percent, bytes); GPU 1 supports no
    power reading and no events; one critical XID arrives for GPU 0."""
    events = iter([SimpleNamespace(device="h0", eventData=79)])

    def wait(_events: Any, timeout_ms: int) -> Any:
        event = next(events, None)
        if event is None:
            time.sleep(min(timeout_ms, 1000) / 1000)
            raise _Timeout()
        return event

    def power(handle: str) -> int:
        if handle == "h1":
            raise _NVMLError("not supported")
        return 187_500

    def register(handle: str, _kind: int, _events: Any) -> None:
        if handle == "h1":
            raise _NVMLError("not supported")

    return SimpleNamespace(
        NVMLError=_NVMLError,
        NVMLError_Timeout=_Timeout,
        NVML_TEMPERATURE_GPU=0,
        nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"NVIDIA GeForce RTX 4070" if h == "h0" else "NVIDIA GeForce RTX 3070 Ti",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=97 if h == "h0" else 40, memory=50),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=6 * 2**30, total=8 * 2**30, free=2 * 2**30),
        nvmlDeviceGetTemperature=lambda h, kind: 71 if h == "h0" else 64,
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: 123_456_789,
        nvmlEventSetCreate=lambda: "events",
        nvmlDeviceRegisterEvents=register,
        nvmlEventSetWait_v2=wait,
    )


@pytest.fixture()
def planted(tmp_path: Path) -> Iterator[Path]:
    runs = tmp_path / "runs"
    runs.mkdir()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(runs / planted_run.JOB_ID)])
    try:
        planted_run.plant_run(runs, "node4070", worker.pid)
        yield runs
    finally:
        worker.kill()
        worker.wait()


def test_gpu_series_from_nvml_in_base_units_and_promtool_clean(planted: Path) -> None:
    gpus = ugro_exporter.Gpus(nvml=fake_nvml())
    deadline = time.monotonic() + 5
    while gpus.xid.get(0, 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # the XID thread takes the one event
    text = ugro_exporter.exposition(ugro_exporter.Collector("node4070", planted, gpus))
    assert _promtool(text) == ""
    sample = monitor.parse(text)
    first, second = sample.gpus
    assert (first.name, first.utilization, first.memory_total, first.temperature, first.power) == (
        "NVIDIA GeForce RTX 4070", 0.97, 8 * 2**30, 71.0, 187.5,
    )  # fmt: skip
    assert second.power is None and second.name == "NVIDIA GeForce RTX 3070 Ti"  # unsupported: left out, not 0
    assert re.search(r'ugro_gpu_energy_joules_total\{[^}]*gpu="0"[^}]*\} 123456\.789', text)
    assert re.search(r'ugro_gpu_xid_errors_total\{[^}]*gpu="0"[^}]*\} 1\.0', text)
    assert not re.search(r'ugro_gpu_xid_errors_total\{[^}]*gpu="1"', text)  # GPU 1 supports no events
    # The planted job: the totals on the host that keeps the run, each live rank's own figures.
    assert sample.job is not None and sample.job.get("step") == 7 and sample.job.get("eval_loss") == 7.25
    assert [(r.rank, r.share, r.ready_s, r.tokens_per_s, r.part) for r in sample.ranks] == [
        (0, 0.625, 0.5, 2000.0, "stage 1/2, layers 0-14"), (1, 0.375, 0.25, 2400.0, "stage 2/2, layers 15-29"),
    ]  # fmt: skip
    assert sample.job_states == {"plant-20260101-000000": "running"}


def test_no_gpu_series_where_nvml_does_not_start(planted: Path) -> None:
    broken = SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(_NVMLError("NVML Shared Library Not Found")))
    gpus = ugro_exporter.Gpus(nvml=broken)
    text = ugro_exporter.exposition(ugro_exporter.Collector("tb1", planted, gpus))
    assert "ugro_gpu_" not in text and 'nvml="unavailable"' in text
    assert "ugro_host_cpus" in text and _promtool(text) == ""


@pytest.fixture()
def exporter_http(planted: Path) -> Iterator[str]:
    """The exporter's HTTP side (/metrics and /job/) for node4070 of the planted run, on a free local port."""
    from prometheus_client import make_wsgi_app

    collector = ugro_exporter.Collector("node4070", planted, ugro_exporter.Gpus(nvml=SimpleNamespace()))
    app = ugro_exporter.application(make_wsgi_app(ugro_exporter.registry(collector)), planted, "node4070")
    server = ugro_exporter.http_server("127.0.0.1", free_port(), app)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_exporter_serves_the_planted_jobs_state(planted: Path, exporter_http: str) -> None:
    """/job/<job-id>: the planted run's facts as the controller's poll reads them (that the exporter on a real host
    answers what the playbook's status module finds there: tests below, on the test cluster)."""
    job = planted_run.JOB_ID
    answer = httpx.get(f"http://{exporter_http}/job/{job}?main=1", timeout=5)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    found = answer.json()
    worker = int((planted / "active-job").read_text().split()[1])  # the planted rank's process
    assert (found["host"], found["job"], found["state"], found["run_state"]) == ("node4070", job, "running", "running")
    assert found["pids"] == {"worker-rank0": worker, "worker-rank1": worker} and found["ranks"] == [0, 1]
    assert (found["step"], found["total_steps"], found["loss"], found["failures"]) == (7, 50, 6.5, [])
    assert found["parts"] == {"0": "stage 1/2, layers 0-14", "1": "stage 2/2, layers 15-29"}
    assert found["jobstate"] == ugro_jobstate.digest()  # the code it answers with, which the controller compares
    assert "step" not in httpx.get(f"http://{exporter_http}/job/{job}", timeout=5).json()  # not the main host
    missing = httpx.get(f"http://{exporter_http}/job/other-20260101-000000", timeout=5)
    assert missing.status_code == 404 and "node4070 has no run other-20260101-000000" in missing.json()["error"]
    assert httpx.get(f"http://{exporter_http}/job/..%2Fetc", timeout=5).status_code == 400
    assert "ugro_job_state" in httpx.get(f"http://{exporter_http}/metrics", timeout=5).text

    # The controller's reader: the state where the exporter runs the controller's code for the host asked, and
    # otherwise why not (that host is then polled through Ansible).
    host, port = exporter_http.split(":")
    here = monitor.Target("node4070", host, int(port))
    states = ExporterStates([here, monitor.Target("node3070", host, free_port())], job)
    found, missed = states.read(["node4070", "node3070"], main="node4070")
    assert found["node4070"]["step"] == 7 and "jobstate" not in found["node4070"]
    assert list(missed) == ["node3070"] and "ConnectError" in missed["node3070"]
    wrong_host = ExporterStates([monitor.Target("node4080", host, int(port))], job)
    assert "reports host 'node4070'" in wrong_host.read(["node4080"], main="node4080")[1]["node4080"]
    other_code = ExporterStates([here], job)
    other_code.digest = "0" * 16  # an exporter provisioned from another ugro
    assert "another ugro_jobstate.py" in other_code.read(["node4070"], main="node4070")[1]["node4070"]


def _grafana_exprs() -> list[str]:
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"]]
    return exprs


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def grafana_series() -> set[str]:
    """Every series name the Grafana dashboard's queries (panels and variables) name."""
    names = set()
    for expr in _grafana_exprs():
        bare = re.sub(r'"[^"]*"', "", expr)  # label values
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)  # matchers, ranges
        bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)  # grouping labels
        bare = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", bare)  # Grafana's variable query
        for match in re.finditer(r"\b[A-Za-z_:][A-Za-z0-9_:]*", bare):
            function = bare[match.end() :].lstrip().startswith("(")
            if not function and match[0] not in PROMQL_WORDS:
                names.add(match[0])
    return names


def test_grafana_dashboard_names_only_series_the_exporter_exports(planted: Path) -> None:
    exported = set()
    for gpus in (ugro_exporter.Gpus(nvml=fake_nvml()), ugro_exporter.Gpus(nvml=SimpleNamespace())):
        text = ugro_exporter.exposition(ugro_exporter.Collector("node4070", planted, gpus))
        exported |= monitor.parse(text).names
    exported |= {"up"}  # Prometheus's own, per target
    named = grafana_series()
    assert {"ugro_gpu_utilization_ratio", "ugro_job_loss", "ugro_rank_tokens_per_second"} <= named
    assert named - exported == set(), f"the Grafana dashboard queries series nobody exports: {named - exported}"
    assert {n for n in named if n.startswith("ugro_")} <= set(ugro_exporter.FAMILIES)
    board = json.loads(GRAFANA.read_text())
    assert board["__inputs"][0]["pluginId"] == "prometheus" and board["uid"] == "ugro-cluster"
    assert any(p.get("repeat") == "host" for p in board["panels"])  # per-host GPU panels


def test_the_end_of_run_picture_draws_loss_speed_and_shares(tmp_path: Path) -> None:
    from PIL import Image

    from train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, 12, 0)
    for step in range(1, 13):
        shares = [4, 2, 2] if step < 6 else [5, 2, 1]
        ready = [0.0, 0.0, 0.0] if step == 1 else [0.4, 0.5, 0.9] if step < 6 else [0.5, 0.5, 0.48]
        figures = rank_figures(["tb1", "tb2", "tb3"], shares, ready, [400, 200, 200])
        writer.log(step, 7 - step / 4, 800, 1e-3, 1.0, step / 100, figures)
    writer.log_eval(0, 7.5, 100, adapter=False)
    writer.log_eval(12, 4.5, 100)
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["ranks"]["host"] == ["tb1", "tb2", "tb3"] and row["ranks"]["share"] == [0.625, 0.25, 0.125]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["ranks"]["tokens_per_s"] == [None, None, None]  # nothing timed before the first step
    picture = plot_loss(tmp_path)
    assert picture is not None
    width, height = Image.open(picture).size
    assert height >= 3 * 300 and width >= 700  # three panels: loss, tokens/s per rank, shares


# --------------------------------------------------------------------------------------------------
# During a real job on the test cluster.


def _ssh(testbed: Any, host: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(testbed.ssh_config), host, command], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def _inventory(testbed: Any) -> Path:
    """The test cluster's inventory, one CPU process per host; tb2's says it runs a node_exporter too."""
    data = yaml.safe_load(Path(testbed.inventory).read_text())
    hosts = data["all"]["children"]["ugro_cluster"]["hosts"]
    for host in hosts.values():
        host["ugro_cpu_procs_per_node"] = 1
        host["ugro_omp_num_threads"] = 1  # three hosts on this machine's two cores
    hosts["tb2"]["ugro_node_exporter_port"] = 9100
    inventory = Path(testbed.inventory).parent / "monitored.yml"
    inventory.write_text(yaml.safe_dump(data))
    return inventory


@pytest.fixture()
def monitor_job(repo_jobs: Path) -> Iterator[Path]:
    path = write_job(
        repo_jobs / "monitor-test.yaml",
        name="monitor-test",
        train={"max_steps": 3000, "global_batch_size": 6, "log_every": 50},
        checkpoint={"every": 3000},
        eval={"source": "data/sample/eval.jsonl", "every": 25, "samples": 0},
        balance="auto",
    )
    yield path
    path.unlink()
    remove_runs("monitor-test")


def _until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(every_s)


def _scrape_all(targets: list[monitor.Target]) -> dict[str, str]:
    with httpx.Client(trust_env=False, timeout=5) as client:
        return {t.host: client.get(t.url).text for t in targets}


def _serving_ranks(targets: list[monitor.Target]) -> dict[str, str] | None:
    """Every exporter's text once each one serves the job's ranks past step 3 and the main host the job."""
    try:
        texts = _scrape_all(targets)
    except httpx.HTTPError:
        return None
    samples = {h: monitor.parse(t) for h, t in texts.items()}
    ready = all(s.ranks and (s.ranks[0].step or 0) >= 3 for s in samples.values())
    return texts if ready and any(s.job for s in samples.values()) else None


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _start_prometheus(prometheus: str, config: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Prometheus on a free loopback port, once it answers /-/ready; another port if someone took that one first."""
    log_path = tmp_path / "prometheus.log"
    for _ in range(3):
        port = free_port()
        with open(log_path, "wb") as log:
            prom = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while prom.poll() is None and not _ready(port):
            if time.monotonic() > deadline:
                prom.terminate()
                prom.wait(timeout=30)
                raise AssertionError(f"Prometheus was not ready within 60 s: {_tail(log_path)}")
            time.sleep(0.25)
        if prom.poll() is None:
            return prom, port
        if "address already in use" not in _tail(log_path):
            raise AssertionError(f"Prometheus exited with {prom.returncode}: {_tail(log_path)}")
    raise AssertionError(f"Prometheus found no free port in 3 tries: {_tail(log_path)}")


def _prometheus(port: int, path: str, **params: str) -> Any:
    response = httpx.get(f"http://127.0.0.1:{port}{path}", params=params, timeout=5, trust_env=False)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


async def _drive_dashboard(targets: list[monitor.Target], stop_tb3: Callable[[], None]) -> dict[str, Any]:
    from textual.widgets import DataTable, Static

    from ugro.monitoring.dashboard import Dashboard

    app = Dashboard(targets, interval_s=1.0, source="monitored.yml")
    seen: dict[str, Any] = {}
    async with app.run_test(size=(160, 48)) as pilot:

        async def until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
            deadline = time.monotonic() + timeout_s
            while not check():
                assert time.monotonic() < deadline, f"dashboard: waited {timeout_s:.0f} s for {what}"
                await pilot.pause(0.1)

        cluster = app.cluster
        await until("every host, the job and its ranks", lambda: cluster.polls >= 2 and len(cluster.ranks()) == 3
                    and all(not v.offline for v in cluster.hosts.values()) and len(cluster.loss) >= 2, 60)  # fmt: skip
        hosts = app.query_one("#hosts", DataTable)
        seen["states"] = {h: str(hosts.get_cell(h, "state")) for h in ("tb1", "tb2", "tb3")}
        seen["devices"] = {h: str(hosts.get_cell(h, "device")) for h in ("tb1", "tb2", "tb3")}
        seen["ranks"] = app.query_one("#ranks", DataTable).row_count
        seen["job_line"] = str(app.query_one("#job", Static).content)
        steps_before = {h: v.sample.ranks[0].step for h, v in cluster.hosts.items() if v.sample}
        answered = {h: v.answered for h, v in cluster.hosts.items()}

        await asyncio.to_thread(stop_tb3)
        polls_at_stop = cluster.polls
        await until("tb3 marked OFFLINE", lambda: cluster.hosts["tb3"].offline, 10)
        seen["polls_to_offline"] = cluster.polls - polls_at_stop
        await until("two more polls", lambda: cluster.polls >= polls_at_stop + seen["polls_to_offline"] + 2, 10)
        seen["offline_cell"] = str(hosts.get_cell("tb3", "state"))
        seen["offline_reason"] = str(hosts.get_cell("tb3", "device"))
        seen["answered_since"] = {h: cluster.hosts[h].answered - answered[h] for h in answered}
        seen["steps_moved"] = {
            h: (cluster.hosts[h].sample.ranks[0].step or 0) > (steps_before[h] or 0)  # type: ignore[union-attr]
            for h in ("tb1", "tb2")
        }
        seen["screen"] = app.export_screenshot()
        await pilot.press("q")
    seen["exited"] = app.return_code == 0 and not app.is_running
    return seen


def test_exporters_prometheus_and_dashboard_during_a_job(
    monitor_job: Path, testbed: Any, tmp_path: Path, ugro_train: Run, ansible_playbook: Run
) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        unavailable("prometheus not found: apt-get install prometheus (Debian 12: 2.42)")
    inventory = _inventory(testbed)
    targets = monitor.targets(inventory)
    assert [(t.host, t.address, t.port, t.node_exporter_port) for t in targets] == [
        (h.name, h.address, 9840, 9100 if h.name == "tb2" else 0) for h in testbed.hosts
    ]
    # The job starts (a minute of launch and start-up); the session's test cluster runs the exporters, installed by
    # the provisioning playbook (tests/conftest.py).
    follower = subprocess.Popen(
        [PYTHON, "-m", "ugro.cli", "train", "--job", str(monitor_job), "--inventory", str(inventory), "--poll", "3"],
        cwd=REPO, env=run_env() | {"SKIP_PREFLIGHT": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    prom: subprocess.Popen[bytes] | None = None
    began = time.monotonic()

    def mark(what: str) -> None:  # the timeline, printed (pytest shows it with -s or on a failure)
        print(f"{time.monotonic() - began:6.1f} s  {what}")

    try:
        config = tmp_path / "prometheus.yml"
        made = cli("prometheus-config", "--inventory", str(inventory), "--out", str(config), "--scrape-interval", "1s")
        assert made.returncode == 0, made.stdout + made.stderr
        checked = subprocess.run([str(Path(prometheus).parent / "promtool"), "check", "config", str(config)],
                                 capture_output=True, text=True, check=False)  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        prom, port = _start_prometheus(prometheus, config, tmp_path)
        mark("Prometheus ready")

        # Every exporter serves its host's rank; the host that keeps the run also the job's totals.
        texts = _until("every exporter to serve its rank", lambda: _serving_ranks(targets), 240, 1.0)
        mark("every exporter serves its rank")
        for host, text in texts.items():
            assert _promtool(text) == "", f"{host}: {_promtool(text)}"
            sample = monitor.parse(text)
            assert sample.host == host and "ugro_gpu_" not in text and sample.nvml == "unavailable"
            assert [r.host for r in sample.ranks] == [host] and sample.ranks[0].world_size == 3
            assert 0 < (sample.ranks[0].share or 0) < 1 and sample.job_states.get(sample.ranks[0].job) == "running"
        main = [h for h, t in texts.items() if monitor.parse(t).job]
        assert main == ["tb1"], main  # the main host keeps the run

        # The controller's poll, as `ugro train` follows the job: every state from the exporters, no playbook.
        job_id = sorted(p.name for p in runs_dir().glob("monitor-test-*"))[-1]
        notes: list[str] = []
        poll = RemoteSource(inventory, job_id, tmp_path / "ansible", ["tb1", "tb2", "tb3"], "tb1",
                            ExporterStates(targets, job_id), notes.append)  # fmt: skip
        states = poll()
        assert not poll.ran_playbook and {h: s["state"] for h, s in states.items()} == dict.fromkeys(texts, "running")
        assert states["tb1"]["step"] >= 3 and states["tb1"]["pids"] and "step" not in states["tb2"]
        # What each exporter answers (as its own user, in its unit's sandbox, from the runs directory it was given) is
        # what the playbook's status module finds on that host, the way a host without an exporter is polled.
        by_ansible = RemoteSource(inventory, job_id, tmp_path / "ansible-status", ["tb1", "tb2", "tb3"], "tb1")()
        same = ("host", "job", "run_dir", "state", "exit_code", "pids", "attempt", "ranks", "failures", "parts")
        for host in ("tb1", "tb2", "tb3"):
            assert {k: states[host].get(k) for k in same} == {k: by_ansible[host].get(k) for k in same}, host
        mark("the exporters' states equal the status playbook's")
        exported = set().union(*(monitor.parse(t).names for t in texts.values())) | {"up"}
        missing = {n for n in grafana_series() if not n.startswith("ugro_gpu_")} - exported
        assert missing == set(), f"Grafana names series these exporters did not export: {missing}"

        # A real Prometheus: every exporter up (and tb2's node_exporter target from the inventory, which
        # nothing serves here), the training series moving on every host.
        def all_up() -> list[Any] | None:
            assert prom is not None and prom.poll() is None, f"Prometheus exited: {_tail(tmp_path / 'prometheus.log')}"
            active = _prometheus(port, "/api/v1/targets")["activeTargets"]
            ugro = [t for t in active if t["labels"]["job"] == "ugro"]
            return active if len(ugro) == 3 and all(t["health"] == "up" for t in ugro) else None

        active = _until("Prometheus to scrape every exporter", all_up, 60)
        mark("Prometheus: every exporter up")
        assert sorted(t["labels"]["instance"] for t in active if t["labels"]["job"] == "ugro") == ["tb1", "tb2", "tb3"]
        assert [t["labels"]["instance"] for t in active if t["labels"]["job"] == "node"] == ["tb2"]

        def moving() -> list[Any] | None:
            result = _prometheus(port, "/api/v1/query", query="changes(ugro_rank_step[30s]) > 0")["result"]
            return result if len(result) == 3 else None

        result = _until("ugro_rank_step to move on every host in Prometheus", moving, 60, 1.0)
        mark("Prometheus: ugro_rank_step moves on every host")
        assert sorted(r["metric"]["host"] for r in result) == ["tb1", "tb2", "tb3"]
        step = _prometheus(port, "/api/v1/query", query="ugro_job_step")["result"]
        assert len(step) == 1 and step[0]["metric"]["instance"] == "tb1" and float(step[0]["value"][1]) >= 3

        # The dashboard against the same exporters; tb3's exporter stopped mid-job.
        def stop_tb3() -> None:
            out = _ssh(testbed, "tb3", f"{PYTHON} {EXPORTER_ON_HOST} stop --pid-file {PID_FILE}")
            assert out.returncode == 0 and json.loads(out.stdout)["stopped"], out.stdout + out.stderr

        seen = asyncio.run(_drive_dashboard(targets, stop_tb3))
        mark("dashboard done")
        (tmp_path / "dashboard.svg").write_text(seen["screen"])
        assert seen["states"] == {"tb1": "up", "tb2": "up", "tb3": "up"}, seen
        assert all(d.startswith("CPU") for d in seen["devices"].values()), seen["devices"]
        assert seen["ranks"] == 3 and "monitor-test-" in seen["job_line"] and "step" in seen["job_line"]
        assert seen["polls_to_offline"] <= 2 and seen["offline_cell"] == "OFFLINE", seen
        assert "connection refused" in seen["offline_reason"], seen["offline_reason"]
        assert seen["answered_since"]["tb1"] >= 2 and seen["answered_since"]["tb2"] >= 2, seen
        assert seen["steps_moved"] == {"tb1": True, "tb2": True}, seen
        assert seen["exited"]
        # tb3's exporter is stopped: the poll asks tb3 through Ansible, says so once, and keeps to Ansible for a while.
        states = poll()
        assert poll.ran_playbook and states["tb3"]["state"] == "running" and states["tb3"]["pids"], states["tb3"]
        assert len(notes) == 1 and "on tb3 comes through Ansible" in notes[0] and "ConnectError" in notes[0], notes
        assert poll() and poll.ran_playbook and len(notes) == 1
        mark("polls: tb3 through Ansible")
        assert follower.poll() is None, "the job ended before the checks did"
    finally:
        if follower.poll() is None:
            follower.send_signal(signal.SIGINT)  # the follower detaches; the job is stopped below
        launched = sorted(p.name for p in runs_dir().glob("monitor-test-*"))
        # On every host at once: the job's own recorded processes (ugro_jobstate.stop, what `make stop`'s host
        # module runs; `make stop` itself is tested in test_cluster.py). The exporters stay: the session's test
        # cluster runs them (tests/conftest.py), and tb3's, stopped above, is started again below.
        stop_job = (
            f"from pathlib import Path; from ugro.module_utils import ugro_jobstate as j; import json, socket; "
            f"print(json.dumps(j.stop(Path('/opt/ugro/runs/{launched[-1]}'), socket.gethostname(), 3)))"
            if launched
            else "print('{}')"
        )
        ssh = ["ssh", "-F", str(testbed.ssh_config)]
        stops = [
            subprocess.Popen([*ssh, host, f"{PYTHON} -c {shlex.quote(stop_job)}"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for host in ("tb1", "tb2", "tb3")
        ]  # fmt: skip
        outputs = [proc.communicate(timeout=120)[0] for proc in stops]
        mark("job stopped")
        start_exporters(inventory)  # tb3's again, for the tests after this one
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        try:
            follower.wait(timeout=60)
        finally:
            if follower.poll() is None:
                follower.kill()
    remaining = [json.loads(out.splitlines()[0]).get("remaining") for out in outputs]
    assert launched and remaining == [{}, {}, {}], outputs
