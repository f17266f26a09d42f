"""The controller's side of the node exporters: where they are, one scrape read, the cluster polled.

``targets`` reads the inventory (the same one ``make train`` uses): every host of ``ugro_cluster`` at its
``ugro_cluster_address`` (else ``ansible_host``, else its name) and ``ugro_exporter_port`` (role ugro's
default where the inventory sets none). ``parse`` turns an exporter's text (prometheus_client's parser)
into a ``HostSample``; ``Cluster.poll`` scrapes every host at once, each with its own timeout, so one
host that does not answer never holds up the others. ``prometheus_config`` renders the scrape
configuration of ``make prometheus-config``. The exporter itself is ugro/module_utils/ugro_exporter.py.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ugro.module_utils.ugro_exporter import RANK_FIELDS

REPO = Path(__file__).resolve().parents[2]
GROUP = "ugro_cluster"
HISTORY = 240  # loss values kept for the sparklines


class MonitorError(RuntimeError):
    """The inventory names no host to watch, or cannot be read."""


@dataclass(frozen=True)
class Target:
    host: str
    address: str
    port: int
    node_exporter_port: int = 0

    @property
    def endpoint(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}/metrics"


def _literal(value: Any) -> str:
    """A plain inventory value (a templated one, such as a role default's expression, counts as unset)."""
    text = "" if value is None else str(value).strip()
    return "" if "{{" in text or "{%" in text else text


def _port(value: Any) -> int:
    text = _literal(value)
    return int(text) if text.isdigit() else 0


@functools.cache
def _shipped_defaults() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "roles" / "ugro" / "defaults" / "main.yml").read_text())
    return dict(data or {})


def targets(inventory: Path) -> list[Target]:
    """Every host of the group ugro_cluster with its exporter's address and port, in inventory order."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    if not inventory.is_file():
        raise MonitorError(f"{inventory}: inventory not found (the default is inventory/local.yml)")
    loader = DataLoader()
    manager = InventoryManager(loader=loader, sources=[str(inventory)])
    variables = VariableManager(loader=loader, inventory=manager)
    hosts = manager.get_hosts(GROUP)
    if not hosts:
        raise MonitorError(f"{inventory}: no host in the group {GROUP}")
    return [target(str(host.name), variables.get_vars(host=host)) for host in hosts]


def target(host: str, hostvars: dict[str, Any]) -> Target:
    """Where ``host``'s exporter serves, from its inventory variables (role ugro's port where they set none)."""
    address = _literal(hostvars.get("ugro_cluster_address")) or _literal(hostvars.get("ansible_host")) or host
    port = _port(hostvars.get("exporter_port")) or _port(hostvars.get("ugro_exporter_port"))
    port = port or _port(_shipped_defaults().get("ugro_exporter_port"))
    return Target(host, address, port, _port(hostvars.get("ugro_node_exporter_port")))


# --------------------------------------------------------------------------------------------------
# One scrape.


@dataclass
class Gpu:
    index: str
    name: str
    utilization: float | None = None
    memory_used: float | None = None
    memory_total: float | None = None
    temperature: float | None = None
    power: float | None = None


@dataclass
class Rank:
    rank: int
    host: str
    job: str
    step: float | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    ready_s: float | None = None
    share: float | None = None
    world_size: float | None = None
    part: str | None = None  # what it computes: "the whole model", or "stage 2/3, layers 13-25"


@dataclass
class Job:
    job: str
    values: dict[str, float] = field(default_factory=dict)  # step, total_steps, loss, eval_loss, ... (ugro_job_*)

    def get(self, key: str) -> float | None:
        return self.values.get(key)


@dataclass
class HostSample:
    host: str = ""
    cpu_utilization: float | None = None
    cpus: float | None = None
    memory_used: float | None = None
    memory_total: float | None = None
    nvml: str = ""
    gpus: list[Gpu] = field(default_factory=list)
    ranks: list[Rank] = field(default_factory=list)
    job: Job | None = None  # on the host that keeps the run
    job_states: dict[str, str] = field(default_factory=dict)  # job -> its state on this host
    lent: tuple[float, str, str] | None = None  # taken back from its job: since (Unix time), by whom, why
    names: set[str] = field(default_factory=set)  # every sample name, as exported


_RANK_KEYS = {name: key for name, key in RANK_FIELDS.items() if key != "time"}
_GPU_KEYS = {
    "ugro_gpu_utilization_ratio": "utilization",
    "ugro_gpu_memory_used_bytes": "memory_used",
    "ugro_gpu_memory_total_bytes": "memory_total",
    "ugro_gpu_temperature_celsius": "temperature",
    "ugro_gpu_power_watts": "power",
}
_HOST_KEYS = {
    "ugro_host_cpu_utilization_ratio": "cpu_utilization",
    "ugro_host_cpus": "cpus",
    "ugro_host_memory_used_bytes": "memory_used",
    "ugro_host_memory_total_bytes": "memory_total",
}


def parse(text: str) -> HostSample:
    """One exporter's /metrics text as a HostSample."""
    sample = HostSample()
    gpus: dict[str, Gpu] = {}
    ranks: dict[tuple[str, int], Rank] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            sample.names.add(name)
            if name in _HOST_KEYS:
                setattr(sample, _HOST_KEYS[name], value)
                sample.host = labels.get("host", sample.host)
            elif name in _GPU_KEYS:
                gpu = gpus.setdefault(labels.get("gpu", "?"), Gpu(labels.get("gpu", "?"), labels.get("name", "")))
                setattr(gpu, _GPU_KEYS[name], value)
            elif name in _RANK_KEYS and labels.get("rank", "").isdigit():
                key = (labels.get("job", ""), int(labels["rank"]))
                rank = ranks.setdefault(key, Rank(key[1], labels.get("host", ""), key[0]))
                setattr(rank, _RANK_KEYS[name], value)
            elif name == "ugro_rank_stage_info" and labels.get("rank", "").isdigit():
                key = (labels.get("job", ""), int(labels["rank"]))
                rank = ranks.setdefault(key, Rank(key[1], labels.get("host", ""), key[0]))
                rank.part = labels.get("part")
            elif name == "ugro_lent_since_timestamp_seconds":
                sample.lent = (value, labels.get("by", ""), labels.get("why", ""))
            elif name == "ugro_job_state":
                if value == 1:
                    sample.job_states[labels.get("job", "")] = labels.get("state", "")
            elif name.startswith("ugro_job_") and "job" in labels:
                if sample.job is None or sample.job.job != labels["job"]:
                    sample.job = Job(labels["job"])
                sample.job.values[name.removeprefix("ugro_job_")] = value
            elif name == "ugro_exporter_info":
                sample.nvml = labels.get("nvml", "")
                sample.host = labels.get("host", sample.host)
    sample.gpus = [gpus[k] for k in sorted(gpus, key=lambda k: (len(k), k))]
    sample.ranks = sorted(ranks.values(), key=lambda r: r.rank)
    return sample


async def scrape(client: httpx.AsyncClient, target: Target, timeout_s: float) -> HostSample:
    response = await client.get(target.url, timeout=timeout_s)
    response.raise_for_status()
    return parse(response.text)


# --------------------------------------------------------------------------------------------------
# The cluster, polled.


@dataclass
class HostView:
    target: Target
    sample: HostSample | None = None  # the last good one
    error: str = ""  # why the last poll failed; "" when it answered
    polls: int = 0
    answered: int = 0
    last_seen: float | None = None  # time.monotonic() of the last answer

    @property
    def offline(self) -> bool:
        return bool(self.error)


@dataclass
class Cluster:
    """Every host's latest view, and the job's loss and held-out loss history seen so far."""

    targets: list[Target]
    hosts: dict[str, HostView] = field(default_factory=dict)
    loss: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    eval_loss: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    job: Job | None = None
    polls: int = 0

    def __post_init__(self) -> None:
        self.hosts = {t.host: HostView(t) for t in self.targets}

    async def poll(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Scrape every host at once; a host that fails or takes longer than ``timeout_s`` is offline."""
        results = await asyncio.gather(
            *(
                asyncio.wait_for(scrape(client, view.target, timeout_s), timeout_s + 0.5)
                for view in self.hosts.values()
            ),
            return_exceptions=True,
        )
        self.polls += 1
        for view, result in zip(self.hosts.values(), results, strict=True):
            view.polls += 1
            if isinstance(result, HostSample):
                view.sample, view.error, view.last_seen = result, "", time.monotonic()
                view.answered += 1
            else:
                view.error = _why(result)
        self._follow_job()

    def _follow_job(self) -> None:
        jobs = [v.sample.job for v in self.hosts.values() if v.sample and v.sample.job and not v.offline]
        if not jobs:
            return
        job = jobs[0]
        if self.job is None or self.job.job != job.job:
            self.loss.clear()
            self.eval_loss.clear()
        self.job = job
        step, loss, eval_step, eval_loss = (job.get(k) for k in ("step", "loss", "eval_step", "eval_loss"))
        if step is not None and loss is not None and (not self.loss or self.loss[-1][0] != step):
            self.loss.append((step, loss))
        if (
            eval_step is not None
            and eval_loss is not None
            and (not self.eval_loss or self.eval_loss[-1][0] != eval_step)
        ):
            self.eval_loss.append((eval_step, eval_loss))

    def ranks(self) -> list[Rank]:
        """Every rank the answering hosts report for the followed job, by rank."""
        found = [
            r for v in self.hosts.values() if v.sample and not v.offline for r in v.sample.ranks
            if self.job is None or r.job == self.job.job
        ]  # fmt: skip
        return sorted(found, key=lambda r: r.rank)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "no answer (timeout)"
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:  # httpx -> httpcore -> the OSError of the socket
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "connection refused"
            cause = cause.__cause__ or cause.__context__
        return f"cannot connect: {exc}"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------------
# Prometheus.


def prometheus_config(found: list[Target], scrape_interval: str = "15s") -> dict[str, Any]:
    """A Prometheus configuration scraping every node's exporter (job ``ugro``), and the node_exporter of every
    host whose inventory sets ``ugro_node_exporter_port`` (job ``node``). ``instance`` is the inventory name."""
    ugro = [{"targets": [t.endpoint], "labels": {"instance": t.host}} for t in found]
    configs: list[dict[str, Any]] = [{"job_name": "ugro", "static_configs": ugro}]
    node = [
        {
            "targets": [Target(t.host, t.address, t.node_exporter_port).endpoint],
            "labels": {"instance": t.host, "host": t.host},
        }
        for t in found
        if t.node_exporter_port
    ]
    if node:
        configs.append({"job_name": "node", "static_configs": node})
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": configs,
    }


def render_prometheus_config(inventory: Path, scrape_interval: str = "15s") -> str:
    found = targets(inventory)
    header = (
        f"# Prometheus scrape configuration of the ugro cluster in {inventory}, written by `make prometheus-config`.\n"
        "# Job ugro: every node's exporter (role exporter); job node: the node_exporter of every host whose\n"
        "# inventory sets ugro_node_exporter_port. Grafana: import ugro/monitoring/grafana-dashboard.json.\n"
    )
    return header + yaml.safe_dump(prometheus_config(found, scrape_interval), sort_keys=False)
