#!/usr/bin/env python3
"""The node exporter: Prometheus metrics of one host, read at scrape time.

Role ``exporter`` installs this file (with ``ugro_jobstate.py`` beside it) on every host and runs it as a
service (a systemd unit, or a detached process with a pid file where there is no systemd)::

    python3 ugro_exporter.py serve --listen 10.0.0.11 --port 9840 --host node4070 --controller 10.0.0.2
    python3 ugro_exporter.py status --pid-file /run/ugro-exporter.pid    # exit 0 serving, 3 not
    python3 ugro_exporter.py stop --pid-file /run/ugro-exporter.pid

What it serves at ``/metrics`` (``FAMILIES`` lists every name; base units, ``_total`` for counters):

- per GPU, through NVML (nvidia-ml-py): utilization, memory used and total, temperature, power, energy
  and XID errors (NVML's critical-XID events, counted by a thread blocked in ``nvmlEventSetWait``). A host
  where NVML does not initialize (no driver, no GPU, no ``pynvml``) exports no GPU series at all;
- the host's CPU utilization since the previous scrape, its CPU count, and memory used and total (psutil);
- the job this host runs (``runs/active-job``): its state here; on the host that keeps the run (rank 0's
  ``run.json`` / ``metrics.jsonl`` / ``eval.jsonl``) the job's step, loss, held-out loss, tokens/s, ETA
  and world size; and per rank of this host whose worker is alive, from the ``hosts/<host>/rank<N>.json``
  every rank writes after each step (train/metrics.py): step, loss, tokens/s, ready time, share of the
  global batch, world size, labelled with job, host and rank;
- the exporter's own process (``process_*``: CPU seconds, memory), so its cost can be watched.

At ``/job/<job-id>`` (``?main=1`` on the host that keeps the run) it serves the job's state on this host as JSON:
what the status playbook's fact module returns (``ugro_jobstate.status``), with ``jobstate``, the hash of the
``ugro_jobstate.py`` it runs. The controller reads it there while it follows a run (ugro/monitoring/jobstates.py),
where the hash is its own, and asks through Ansible where not. 404 where this host has no such run. Its poll
(``?follow=<poll_s>``) from the controller's address (``--controller``) records that a controller follows the run, in
the exporter's own directory (``FollowMarks``), where the ranks read it; a request never writes into a run's
directory (the job user's).

Anyone the firewall lets reach the port (every member, Prometheus) is a client: one thread reads every request whole
and a few workers answer (``Limits``), so that a client that sends half a request and waits holds no worker.

Nothing is sampled between scrapes: a scrape reads NVML, psutil and a few small files and returns.
Standard library, prometheus_client and psutil (pynvml optional), so it runs with the node's venv or
with Debian's python3-prometheus-client and python3-psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import ipaddress
import json
import logging
import os
import queue
import selectors
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

if __package__:  # imported as ugro.module_utils.ugro_exporter (the controller's dashboard and the tests)
    from ugro.module_utils import ugro_jobstate
else:  # run as a script on a host: role exporter installs ugro_jobstate.py beside this file
    import ugro_jobstate  # type: ignore[no-redef]

log = logging.getLogger("ugro_exporter")

VERSION = "2"  # 2: /job/<job-id>
DEFAULT_PORT = 9840
NOT_RUNNING = 3  # exit status of `status` when no exporter serves from the pid file
JOBSTATE = ugro_jobstate.digest()  # the code of the job states this exporter serves

# Every family the exporter can export: name -> (type, help). The dashboard, the Grafana dashboard's test and
# the docs read this table; a name not in it is never exported.
FAMILIES: dict[str, tuple[str, str]] = {
    "ugro_exporter_info": ("gauge", "The exporter on this host (value 1): version, and whether NVML is usable."),
    "ugro_exporter_scrape_duration_seconds": ("gauge", "How long the exporter took to gather this scrape."),
    "ugro_gpu_utilization_ratio": ("gauge", "GPU busy time over NVML's last sample period (0-1)."),
    "ugro_gpu_memory_used_bytes": ("gauge", "GPU memory in use."),
    "ugro_gpu_memory_total_bytes": ("gauge", "GPU memory installed."),
    "ugro_gpu_temperature_celsius": ("gauge", "GPU core temperature."),
    "ugro_gpu_power_watts": ("gauge", "GPU power draw."),
    "ugro_gpu_energy_joules_total": ("counter", "GPU energy consumed since the driver was loaded."),
    "ugro_gpu_xid_errors_total": ("counter", "Critical XID errors NVML reported for the GPU since the exporter began."),
    "ugro_host_cpu_utilization_ratio": ("gauge", "Share of all CPU cores busy since the previous scrape (0-1)."),
    "ugro_host_cpus": ("gauge", "Logical CPUs of the host."),
    "ugro_host_memory_used_bytes": ("gauge", "Host memory in use (total minus available)."),
    "ugro_host_memory_total_bytes": ("gauge", "Host memory installed."),
    "ugro_job_state": ("gauge", "The state of the host's current job on this host: 1 for its state, 0 for the others."),
    "ugro_lent_since_timestamp_seconds": (
        "gauge",
        "While the host is taken back from its job (by hand or by its owner's use): since when (Unix time), by whom "
        "and why.",
    ),
    "ugro_job_step": ("gauge", "Optimizer steps the job has done (host that keeps the run)."),
    "ugro_job_total_steps": ("gauge", "Optimizer steps the job will do."),
    "ugro_job_loss": ("gauge", "Training loss of the last step (mean per label token, over all ranks)."),
    "ugro_job_eval_loss": ("gauge", "Latest held-out loss (the base model's before step 1, then the fine-tuned)."),
    "ugro_job_eval_step": ("gauge", "The step the latest held-out loss was measured at."),
    "ugro_job_tokens_per_second": ("gauge", "Label tokens per second of the whole job since it started."),
    "ugro_job_eta_seconds": ("gauge", "Estimated seconds until the job's last step."),
    "ugro_job_world_size": ("gauge", "Ranks of the job."),
    "ugro_rank_step": ("gauge", "Optimizer steps the rank has done."),
    "ugro_rank_loss": ("gauge", "Training loss of the rank's last step (the global mean every rank agrees on)."),
    "ugro_rank_tokens_per_second": ("gauge", "The rank's label tokens per second of its own compute (step before)."),
    "ugro_rank_ready_seconds": ("gauge", "Seconds from the step's start until the rank's gradients were ready."),
    "ugro_rank_batch_share_ratio": ("gauge", "The rank's share of the global batch in its last step (0-1)."),
    "ugro_rank_world_size": ("gauge", "Ranks of the job, as the rank saw it."),
    "ugro_rank_updated_timestamp_seconds": ("gauge", "When the rank last wrote its figures (Unix time)."),
    "ugro_rank_stage_info": (
        "gauge",
        "What the rank computes (value 1): label part, its pipeline stage and decoder layers, or the whole model.",
    ),
}
JOB_STATES = ("running", "lent", "finished", "failed", "stopped", "lost")


def _family(name: str, labels: list[str]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    kind, text = FAMILIES[name]
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
    return GaugeMetricFamily(name, text, labels=labels)


# Per-rank series -> the field of hosts/<host>/rank<N>.json it reports (the dashboard reads them back by this too).
RANK_FIELDS = {
    "ugro_rank_step": "step",
    "ugro_rank_loss": "loss",
    "ugro_rank_tokens_per_second": "tokens_per_s",
    "ugro_rank_ready_seconds": "ready_s",
    "ugro_rank_batch_share_ratio": "share",
    "ugro_rank_world_size": "world_size",
    "ugro_rank_updated_timestamp_seconds": "time",
}


class Gpus:
    """The host's NVIDIA GPUs through NVML; ``handles`` is empty (and ``reason`` says why) where NVML is unusable.

    ``nvml`` replaces the pynvml module (tests); XID errors are counted by a daemon thread that waits on an
    NVML event set for ``nvmlEventTypeXidCriticalError`` (GPUs that do not support the events get no XID series).
    """

    def __init__(self, nvml: Any = None, watch_xid: bool = True) -> None:
        self.nv = nvml
        self.handles: list[Any] = []
        self.reason = ""
        self.xid: dict[int, int] = {}
        self._lock = threading.Lock()
        try:
            if self.nv is None:
                import pynvml

                self.nv = pynvml
            self.nv.nvmlInit()
            self.handles = [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.nv.nvmlDeviceGetCount())]
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound / DriverNotLoaded, OSError: no GPU here
            self.reason = f"{type(exc).__name__}: {exc}"
            self.handles = []
            return
        if not self.handles:
            self.reason = "NVML reports no GPU"
        elif watch_xid:
            threading.Thread(target=self._watch_xid, name="nvml-xid", daemon=True).start()

    def _watch_xid(self) -> None:
        nv = self.nv
        try:
            events = nv.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML events unavailable, no XID counts: %s", exc)
            return
        uuids = {}
        for index, handle in enumerate(self.handles):
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
                uuids[_text(nv.nvmlDeviceGetUUID(handle))] = index
                with self._lock:
                    self.xid[index] = 0
            except Exception as exc:  # NVMLError_NotSupported on some boards
                log.warning("GPU %d: no XID events (%s)", index, exc)
        if not uuids:
            return
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        timeout = getattr(nv, "NVMLError_Timeout", ())
        while True:
            try:
                data = wait(events, 60_000)
            except timeout:
                continue
            except Exception as exc:
                log.warning("NVML event wait failed, XID counting stops: %s", exc)
                return
            try:
                index = uuids.get(_text(nv.nvmlDeviceGetUUID(data.device)), -1)
            except Exception:
                index = -1
            with self._lock:
                if index in self.xid:
                    self.xid[index] += 1
            log.warning("GPU %d: XID %s", index, getattr(data, "eventData", "?"))

    def collect(self, host: str) -> Iterator[Any]:
        if not self.handles:
            return
        nv = self.nv
        labels = ["host", "gpu", "name", "uuid"]
        fams = {
            name: _family(name, labels)
            for name in FAMILIES
            if name.startswith("ugro_gpu_") and name != "ugro_gpu_xid_errors_total"
        }
        for index, handle in enumerate(self.handles):
            ident = [host, str(index), _safe(lambda h=handle: _text(nv.nvmlDeviceGetName(h))) or "",
                     _safe(lambda h=handle: _text(nv.nvmlDeviceGetUUID(h))) or ""]  # fmt: skip
            util = _safe(lambda h=handle: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            memory = _safe(lambda h=handle: nv.nvmlDeviceGetMemoryInfo(h))
            temp = _safe(lambda h=handle: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            power = _safe(lambda h=handle: nv.nvmlDeviceGetPowerUsage(h))  # milliwatts
            energy = _safe(lambda h=handle: nv.nvmlDeviceGetTotalEnergyConsumption(h))  # millijoules
            for name, value in (
                ("ugro_gpu_utilization_ratio", None if util is None else util / 100),
                ("ugro_gpu_memory_used_bytes", None if memory is None else memory.used),
                ("ugro_gpu_memory_total_bytes", None if memory is None else memory.total),
                ("ugro_gpu_temperature_celsius", temp),
                ("ugro_gpu_power_watts", None if power is None else power / 1000),
                ("ugro_gpu_energy_joules_total", None if energy is None else energy / 1000),
            ):
                if value is not None:
                    fams[name].add_metric(ident, float(value))
            with self._lock:
                count = self.xid.get(index)
            if count is not None:
                fams.setdefault("ugro_gpu_xid_errors_total", _family("ugro_gpu_xid_errors_total", labels))
                fams["ugro_gpu_xid_errors_total"].add_metric(ident, float(count))
        yield from (fam for fam in fams.values() if fam.samples)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _safe(read: Any) -> Any:
    """One NVML reading, or None where the GPU does not support it (NVMLError_NotSupported and friends)."""
    try:
        return read()
    except Exception:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(ugro_jobstate.read_text(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _last_line(path: Path) -> dict[str, Any] | None:
    """The newest complete JSON line of a file, reading only its end."""
    try:
        lines = ugro_jobstate.read_file(path, 4096, tail=True).splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if isinstance(data, dict):
                return data
    return None


class Collector:
    """prometheus_client custom collector: everything is read when Prometheus (or the dashboard) scrapes."""

    def __init__(self, host: str, runs_dir: Path, gpus: Gpus | None = None) -> None:
        import psutil

        self.host = host
        self.runs_dir = runs_dir
        self.gpus = gpus if gpus is not None else Gpus()
        self.psutil = psutil
        self._cpu_lock = threading.Lock()
        self._cpu_last = psutil.cpu_times()  # the window the first scrape measures starts now

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: collect() reads NVML and files, only when scraped

    def collect(self) -> Iterator[Any]:
        started = time.perf_counter()
        yield from self._host()
        yield from self.gpus.collect(self.host)
        yield from self._job()
        info = _family("ugro_exporter_info", ["host", "version", "nvml", "gpus"])
        info.add_metric([self.host, VERSION, "ok" if self.gpus.handles else "unavailable",
                         str(len(self.gpus.handles))], 1.0)  # fmt: skip
        yield info
        took = _family("ugro_exporter_scrape_duration_seconds", ["host"])
        took.add_metric([self.host], time.perf_counter() - started)
        yield took

    def _host(self) -> Iterator[Any]:
        memory = self.psutil.virtual_memory()
        for name, value in (
            ("ugro_host_cpu_utilization_ratio", self._cpu_busy()),
            ("ugro_host_cpus", self.psutil.cpu_count() or 0),
            ("ugro_host_memory_used_bytes", memory.total - memory.available),
            ("ugro_host_memory_total_bytes", memory.total),
        ):
            fam = _family(name, ["host"])
            fam.add_metric([self.host], float(value))
            yield fam

    def _cpu_busy(self) -> float:
        """Busy share of all cores since the previous scrape, whoever scraped (psutil.cpu_percent keeps its window
        per thread, and the HTTP server answers every scrape in a new thread)."""
        now = self.psutil.cpu_times()
        with self._cpu_lock:
            last, self._cpu_last = self._cpu_last, now

        def total(t: Any) -> float:  # guest time is already counted in user and nice on Linux
            return float(sum(t)) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

        def idle(t: Any) -> float:
            return float(t.idle) + getattr(t, "iowait", 0.0)

        elapsed = total(now) - total(last)
        return min(1.0, max(0.0, 1.0 - (idle(now) - idle(last)) / elapsed)) if elapsed > 0 else 0.0

    def current_job(self) -> Path | None:
        """The run directory named by runs/active-job (the last job launched here, running or not)."""
        try:
            job = ugro_jobstate.read_text(self.runs_dir / ugro_jobstate.ACTIVE_JOB).split()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            return None
        run_dir = self.runs_dir / job
        return run_dir if job and "/" not in job and run_dir.is_dir() else None

    def _job(self) -> Iterator[Any]:
        run_dir = self.current_job()
        if run_dir is None:
            return
        job = run_dir.name
        # The host that keeps the run: its run.json, unless it handed the records on when it was taken back.
        record = _read_json(run_dir / ugro_jobstate.STATUS)
        main = record is not None and not record.get("records_moved_to")
        state = ugro_jobstate.status(run_dir, self.host, main)
        fam = _family("ugro_job_state", ["job", "host", "state"])
        for name in JOB_STATES:
            fam.add_metric([job, self.host, name], 1.0 if state.get("state") == name else 0.0)
        yield fam
        lent = state.get("lent")
        if isinstance(lent, dict) and isinstance(lent.get("since"), int | float):
            request = lent.get("request") or {}
            since = _family("ugro_lent_since_timestamp_seconds", ["job", "host", "by", "why"])
            since.add_metric([job, self.host, str(request.get("by") or ""), str(request.get("why") or "")[:120]],
                             float(lent["since"]))  # fmt: skip
            yield since
        if main:
            yield from self._job_totals(run_dir)
        alive = state.get("pids") or {}
        per_rank = RANK_FIELDS
        fams = {name: _family(name, ["job", "host", "rank"]) for name in per_rank}
        stages = _family("ugro_rank_stage_info", ["job", "host", "rank", "part"])
        for path in sorted((run_dir / "hosts" / self.host).glob("rank*.json")):
            rank = path.stem[len("rank") :]
            record = _read_json(path)
            if record is None or not rank.isdigit() or f"worker-rank{rank}" not in alive:
                continue  # a rank of an earlier launch, or one that has ended: its figures are not current
            for name, key in per_rank.items():
                if isinstance(record.get(key), int | float):
                    fams[name].add_metric([job, self.host, rank], float(record[key]))
            if isinstance(record.get("part"), str):
                stages.add_metric([job, self.host, rank, record["part"]], 1.0)
        yield from (fam for fam in [*fams.values(), stages] if fam.samples)

    def _job_totals(self, run_dir: Path) -> Iterator[Any]:
        job = run_dir.name
        last = ugro_jobstate.last_metrics(run_dir) or {}
        run = _read_json(run_dir / ugro_jobstate.STATUS) or {}
        evaluated = _last_line(run_dir / "eval.jsonl") or {}
        for name, value in (
            ("ugro_job_step", last.get("step", run.get("step"))),
            ("ugro_job_total_steps", last.get("total_steps", run.get("total_steps"))),
            ("ugro_job_loss", last.get("loss")),
            ("ugro_job_tokens_per_second", last.get("tokens_per_s")),
            ("ugro_job_eta_seconds", last.get("eta_s")),
            ("ugro_job_world_size", run.get("world_size")),
            ("ugro_job_eval_loss", evaluated.get("eval_loss")),
            ("ugro_job_eval_step", evaluated.get("step") if "eval_loss" in evaluated else None),
        ):
            if isinstance(value, int | float) and not isinstance(value, bool):
                fam = _family(name, ["job"])
                fam.add_metric([job], float(value))
                yield fam


def registry(collector: Collector) -> Any:
    """A registry of the collector and the exporter's own process figures (no Python GC/platform noise)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    ProcessCollector(registry=reg)
    return reg


def exposition(collector: Collector) -> str:
    """One scrape's text, as /metrics serves it."""
    from prometheus_client import generate_latest

    return str(generate_latest(registry(collector)).decode())


# --------------------------------------------------------------------------------------------------
# The HTTP side: /metrics (prometheus_client's application) and /job/<job-id>.

JOB_PATH = "/job/"
App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
# The exporter's own directory: systemd creates it for the unit's dynamic user (RuntimeDirectory=ugro-exporter,
# role exporter's unit); without systemd the exporter creates it. Nobody else can write there.
STATE_DIR = Path("/run/ugro-exporter")
# <STATE_DIR>/followed/<job-id>/<host>.json: when the following controller last asked, and how often it asks (the
# format of ugro_jobstate.FOLLOWED). The ranks read it there (train/recovery/consensus.py EXPORTER_MARKS).
FOLLOWED_DIR = "followed"
FORGET_MARKS_S = 7 * 86400  # the marks of runs nobody followed for a week are removed when a new run is followed
_WARNINGS = 64  # distinct warnings logged once each; beyond, none (any client can make them up)


def job_state(runs_dir: Path, host: str, job_id: str, main: bool) -> tuple[str, dict[str, Any]]:
    """The HTTP status and JSON body of ``/job/<job_id>``: the job's state on this host, or why there is none.
    Reading it writes nothing (the run's directory is the job user's)."""
    if not ugro_jobstate.JOB_ID.match(job_id):
        return "400 Bad Request", {"error": f"'{job_id}' is not a job id such as default-20261121-190000"}
    run_dir = runs_dir / job_id
    if not (run_dir / "hosts" / host).is_dir():
        return "404 Not Found", {"error": f"{host} has no run {job_id} in {runs_dir}"}
    return "200 OK", {**ugro_jobstate.status(run_dir, host, main), "jobstate": JOBSTATE}


def _seconds(values: list[str] | None) -> float:
    """A query's number of seconds (the first value), 0 where it is absent or not a positive number."""
    try:
        seconds = float((values or ["0"])[0])
    except ValueError:
        return 0.0
    return seconds if 0 < seconds < 86400 else 0.0


def client_address(address: str) -> str:
    """A client's address as the controller's is given (an IPv4 client of an IPv6 socket as IPv4, no zone)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def own_directory(path: Path) -> str | None:
    """Make ``path`` the exporter's own directory, mode 0755 (created where missing): why it cannot be, or None.
    Another user's directory is refused: nothing is written there."""
    try:
        path.mkdir(mode=0o755, exist_ok=True)
        info = path.stat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o755:
            path.chmod(0o755)
            info = path.stat()
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to uid {info.st_uid}, not to the exporter's ({os.geteuid()})"
    return None


def _write_file(directory: Path, name: str, data: bytes) -> None:
    """``data`` as ``directory/name`` (mode 0644), replaced whole, never through a symlink."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    partial = f".{name}.{threading.get_ident()}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial, dir_fd=dir_fd)  # left by a crash: unlink removes a link, never its target
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dir_fd)  # fmt: skip
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o644)  # whatever the umask: the ranks, another user, read it
            fh.write(data)
        os.replace(partial, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _made(directory: Path) -> bool:
    """Create ``directory`` (mode 0755) where it is missing: whether this call created it."""
    try:
        directory.mkdir(mode=0o755)
    except FileExistsError:
        return False
    return True


class FollowMarks:
    """The exporter's record that the controller follows a run: ``<state_dir>/followed/<job-id>/<host>.json``.

    Only a poll from one of ``controllers`` (the controller's address as this host sees it: role exporter gives the
    client address of the controller's SSH connection, the firewall's rule for the controller) records one: the
    port is open to every member and to Prometheus, and the mark makes the ranks leave a lost host to the controller's
    word. The file is in the exporter's own directory, never in the run's (the job user's)."""

    def __init__(self, state_dir: Path, host: str, controllers: Iterable[str]) -> None:
        self.dir = state_dir / FOLLOWED_DIR
        self.host = host
        self.controllers = frozenset(client_address(c) for c in controllers)
        self.problem = own_directory(state_dir) or own_directory(self.dir)
        if self.problem is None and not ugro_jobstate.JOB_ID.match(host):
            self.problem = f"the host's name {host!r} cannot name a file"
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def record(self, job_id: str, poll_s: float, client: str) -> str:
        """Record that the controller asked for ``job_id`` now and asks again within ``poll_s`` where ``client`` is
        the controller: "recorded", or why not (the answer says it, the log once)."""
        if client not in self.controllers:
            why = f"{client} is not the controller ({', '.join(sorted(self.controllers)) or 'none given'}"
            return self._not_recorded(f"{why}: exporter_controller_address)")
        if self.problem is not None:
            return self._not_recorded(self.problem)
        job_dir = self.dir / job_id
        try:
            if _made(job_dir):
                self._forget_old(job_id)
            _write_file(
                job_dir, f"{self.host}.json", json.dumps({"time": round(time.time(), 3), "poll_s": poll_s}).encode()
            )
        except OSError as exc:
            return self._not_recorded(f"{job_dir}: {exc.strerror or exc}")
        return "recorded"

    def _not_recorded(self, why: str) -> str:
        with self._lock:
            first = why not in self._warned and len(self._warned) < _WARNINGS
            if first:
                self._warned.add(why)
        if first:
            log.warning("a poll that follows a run is not recorded (the ranks count no controller): %s", why)
        return f"not recorded: {why}"

    def _forget_old(self, keep: str) -> None:
        """Remove the marks of the runs nobody followed for ``FORGET_MARKS_S`` (the directory is the exporter's)."""
        cutoff = time.time() - FORGET_MARKS_S
        for job_dir in self.dir.iterdir():
            with contextlib.suppress(OSError):
                if job_dir.name != keep and job_dir.lstat().st_mtime < cutoff:
                    shutil.rmtree(job_dir)


def application(metrics: App, runs_dir: Path, host: str, marks: FollowMarks | None = None) -> App:
    """``metrics`` everywhere but under /job/. ``?follow=<poll_s>`` on /job/ records the controller's poll in
    ``marks`` where it comes from the controller (and the answer's ``follow`` says whether it was recorded)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = str(environ.get("PATH_INFO") or "")
        if not path.startswith(JOB_PATH):
            return metrics(environ, start_response)
        query = parse_qs(str(environ.get("QUERY_STRING") or ""))
        job_id = path[len(JOB_PATH) :]
        code, body = job_state(runs_dir, host, job_id, query.get("main") == ["1"])
        poll_s = _seconds(query.get("follow"))
        if poll_s > 0 and code.startswith("200"):
            client = client_address(str(environ.get("REMOTE_ADDR") or ""))
            body["follow"] = marks.record(job_id, poll_s, client) if marks else "not recorded: no follow marks here"
        data = json.dumps(body).encode()
        start_response(code, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    return app


@dataclass(frozen=True)
class Limits:
    """What clients can hold of the exporter. One thread accepts connections and reads each request whole, without
    blocking on any; only whole requests reach the ``workers``. A client that has not sent its request within
    ``request_s`` of connecting is dropped (a byte at a time does not extend it); a request over ``request_bytes`` is
    answered 431; connections beyond ``connections`` open at once, or ``per_address`` from one address, are closed
    as they come; sending an answer may take ``answer_s``."""

    workers: int = 4
    connections: int = 256
    per_address: int = 16
    request_bytes: int = 16384
    request_s: float = 5.0
    answer_s: float = 10.0


@dataclass
class _Request:
    """A connection whose request is being read, then answered."""

    sock: socket.socket
    client: str
    port: int
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    refused: bool = False  # answered 431: what it still sends is read and dropped until it closes or the deadline


class _Writer(io.BufferedIOBase):
    """The answer's stream: every write sent whole (within the socket's timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sock.sendall(data)
        return memoryview(data).nbytes


class _Handler(WSGIRequestHandler):
    """wsgiref's handler over a request already read whole (``_Request``)."""

    def __init__(self, request: _Request, server: ExporterServer) -> None:
        self.whole = request
        super().__init__(request.sock, (request.client, request.port), server)  # answers it

    def setup(self) -> None:
        self.connection = self.whole.sock
        self.rfile = io.BytesIO(bytes(self.whole.data))
        self.wfile = _Writer(self.whole.sock)

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a line per scrape and per poll would fill the log."""


REFUSED = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class ExporterServer(WSGIServer):
    """The exporter's WSGI server, within ``Limits``: ``serve_forever`` reads requests in its own thread (a selector
    over every open connection) and answers whole ones with a fixed set of worker threads."""

    request_queue_size = 64

    def __init__(self, address: tuple[str, int], limits: Limits) -> None:
        super().__init__(address, WSGIRequestHandler)  # not used: _work answers with _Handler
        self.limits = limits
        self._open: dict[str, int] = {}  # client address -> its open connections
        self._open_lock = threading.Lock()
        self._reading: dict[int, _Request] = {}  # fd -> the connection whose request is being read
        self._whole: queue.Queue[_Request | None] = queue.Queue()  # at most ``connections``: each one is open
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        workers = [threading.Thread(target=self._work, name=f"http-{n}", daemon=True)
                   for n in range(self.limits.workers)]  # fmt: skip
        for worker in workers:
            worker.start()
        self.socket.setblocking(False)
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self.socket, selectors.EVENT_READ)
                while not self._stop.is_set():
                    for key, _ in selector.select(poll_interval):
                        if key.fileobj is self.socket:
                            self._accept(selector)
                        else:
                            self._read(selector, key.data)
                    self._expire(selector)
                for request in list(self._reading.values()):
                    self._close(selector, request)
        finally:
            for _ in workers:
                self._whole.put(None)
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait()

    def _admit(self, client: str) -> bool:
        with self._open_lock:
            if (
                sum(self._open.values()) >= self.limits.connections
                or self._open.get(client, 0) >= self.limits.per_address
            ):
                return False
            self._open[client] = self._open.get(client, 0) + 1
            return True

    def _release(self, client: str) -> None:
        with self._open_lock:
            self._open[client] -= 1
            if not self._open[client]:
                del self._open[client]

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            sock, address = self.socket.accept()
        except OSError as exc:  # gone before it was accepted, or no file descriptor left (others' or a low limit)
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.05)  # the connection waits in the backlog; the others' deadlines go on
            return
        client = client_address(str(address[0]))
        if not self._admit(client):
            sock.close()
            return
        sock.setblocking(False)
        request = _Request(sock, client, int(address[1]), time.monotonic() + self.limits.request_s)
        self._reading[sock.fileno()] = request
        selector.register(sock, selectors.EVENT_READ, request)

    def _read(self, selector: selectors.BaseSelector, request: _Request) -> None:
        try:
            chunk = request.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(selector, request)
        elif not request.refused:
            request.data += chunk
            end = _header_end(request.data)
            if len(request.data) > self.limits.request_bytes and not 0 <= end < self.limits.request_bytes:
                request.refused = True
                with contextlib.suppress(OSError):
                    request.sock.send(REFUSED)
                    request.sock.shutdown(socket.SHUT_WR)
            elif end >= 0:
                selector.unregister(request.sock)
                del self._reading[request.sock.fileno()]
                request.sock.setblocking(True)
                request.sock.settimeout(self.limits.answer_s)
                self._whole.put(request)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        for request in [r for r in self._reading.values() if r.deadline <= now]:
            self._close(selector, request)

    def _close(self, selector: selectors.BaseSelector, request: _Request) -> None:
        selector.unregister(request.sock)
        del self._reading[request.sock.fileno()]
        request.sock.close()
        self._release(request.client)

    def _work(self) -> None:
        while (request := self._whole.get()) is not None:
            try:
                _Handler(request, self)
            except Exception as exc:  # a client gone, or too slow to take its answer: the next one
                log.debug("answering %s failed: %s", request.client, exc)
            finally:
                self.shutdown_request(request.sock)
                self._release(request.client)


def _header_end(data: bytearray) -> int:
    """Where the request's headers end (the blank line), or -1 while they have not."""
    found = [at for at in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if at >= 0]
    return min(found, default=-1)


def http_server(listen: str, port: int, app: App, limits: Limits | None = None) -> ExporterServer:
    """The exporter's server bound to ``listen``:``port`` (IPv4 or IPv6, whichever the address is)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(listen, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("ExporterServer", (ExporterServer,), {"address_family": family})
    server = server_class((str(sockaddr[0]), port), limits or Limits())
    server.set_app(app)
    return server


# --------------------------------------------------------------------------------------------------
# The service: serve, and the status / stop the role runs where there is no systemd.


def _ours(pid: int, pid_file: Path) -> bool:
    """The pid is a live exporter serving with this pid file (never another process that reused the pid)."""
    import psutil

    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return any("ugro_exporter" in arg for arg in cmdline) and "serve" in cmdline and str(pid_file) in cmdline


def _pid(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _ours(pid, pid_file) else None


def serve(args: argparse.Namespace) -> int:
    from prometheus_client import make_wsgi_app

    gpus = Gpus()
    if not gpus.handles:
        log.info("no GPU series on this host (%s)", gpus.reason)
    runs_dir = Path(args.runs_dir)
    collector = Collector(args.host, runs_dir, gpus)
    marks = FollowMarks(Path(args.state_dir), args.host, args.controller)
    if marks.problem is not None or not marks.controllers:
        log.warning("no poll will record that a controller follows a run: %s",
                    marks.problem or "no --controller given")  # fmt: skip
    app = application(make_wsgi_app(registry(collector)), runs_dir, args.host, marks)
    server = http_server(args.listen, args.port, app)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("serving %s on http://%s:%d/metrics (runs in %s, %d GPUs)", args.host, args.listen, args.port,
             args.runs_dir, len(gpus.handles))  # fmt: skip
    pid_file = Path(args.pid_file) if args.pid_file else None
    if pid_file is not None:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = pid_file.with_name(f".{pid_file.name}.tmp")
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, pid_file)  # written once the port is bound: a pid file means "serving"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if pid_file is not None and _read_pid(pid_file) == os.getpid():
        pid_file.unlink(missing_ok=True)
    return 0


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def status(args: argparse.Namespace) -> int:
    pid = _pid(Path(args.pid_file))
    print(json.dumps({"running": pid is not None, "pid": pid}))
    return 0 if pid is not None else NOT_RUNNING


def stop(args: argparse.Namespace) -> int:
    """SIGTERM the exporter of the pid file, SIGKILL after 10 s; prints whether one was stopped."""
    pid_file = Path(args.pid_file)
    pid = _pid(pid_file)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _ours(pid, pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _ours(pid, pid_file):
            os.kill(pid, signal.SIGKILL)
    if _read_pid(pid_file) == pid:
        pid_file.unlink(missing_ok=True)
    print(json.dumps({"stopped": pid}))
    return 0


def _address(text: str) -> str:
    try:
        return client_address(str(ipaddress.ip_address(text)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ugro_exporter.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve /metrics until SIGTERM")
    p_serve.add_argument("--listen", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p_serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p_serve.add_argument("--host", default=os.uname().nodename, help="the host's name in the labels (inventory name)")
    p_serve.add_argument("--runs-dir", default="/opt/ugro/runs", help="the runs/ directory of the host's ugro code")
    p_serve.add_argument("--pid-file", default="", help="written once serving; removed on exit")
    p_serve.add_argument(
        "--state-dir", default=str(STATE_DIR), help=f"the exporter's own directory (default {STATE_DIR})"
    )
    p_serve.add_argument(
        "--controller",
        action="append",
        default=[],
        type=_address,
        metavar="ADDRESS",
        help="the controller's address: only its polls record that it follows a run (repeatable)",
    )
    for name, text in (("status", "exit 0 when an exporter serves from the pid file"), ("stop", "stop it")):
        sub.add_parser(name, help=text).add_argument("--pid-file", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ugro_exporter %(levelname)s %(message)s")
    return {"serve": serve, "status": status, "stop": stop}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
