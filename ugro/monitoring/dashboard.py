"""`make dashboard`: every node's exporter on one screen, in the terminal (Textual).

Polls every host of the inventory over HTTP (ugro/monitoring/monitor.py, all at once, each with its own timeout) and
shows per host its GPUs, or its CPU, with utilization, memory, temperature and power; the job's progress
with its ETA; loss and held-out loss as sparklines; per rank tokens/s, share of the batch and ready time
(the balance at a glance). A host whose exporter does not answer a poll is marked OFFLINE at once (the
others keep updating) and comes back when it answers again. `q` quits.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import ClassVar

import httpx
from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Header, Label, ProgressBar, Sparkline, Static

from ugro.monitoring.monitor import Cluster, HostView, Rank, Target

DASH = "-"
BAR_WIDTH = 24


def _ratio(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}"


def _gib(used: float | None, total: float | None) -> str:
    if used is None or total is None:
        return DASH
    return f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB"


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return DASH if value is None else f"{value:{fmt}}{unit}"


def duration(seconds: float | None) -> str:
    """12 s, 6 min 12 s, 2 h 05 min."""
    if seconds is None:
        return DASH
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _bar(share: float | None) -> str:
    if share is None:
        return ""
    filled = round(share * BAR_WIDTH)
    return "█" * filled + "·" * (BAR_WIDTH - filled)


class Dashboard(App[None]):
    """The live view of a cluster's exporters."""

    TITLE = "ugro dashboard"
    BINDINGS: ClassVar = [("q", "quit", "Quit")]
    CSS = """
    #job { height: 1; padding: 0 1; }
    #progress { padding: 0 1; height: 1; }
    .spark-row { height: 3; padding: 0 1; }
    .spark-row Label { width: 12; content-align: left middle; height: 3; }
    .spark-row Sparkline { width: 1fr; height: 3; }
    #hosts { height: auto; max-height: 16; margin: 1 0 0 0; }
    #ranks { height: auto; max-height: 14; margin: 1 0 0 0; }
    #poll { height: 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, targets: list[Target], interval_s: float = 2.0, source: str = "") -> None:
        super().__init__()
        self.cluster = Cluster(targets)
        self.interval_s = interval_s
        self.timeout_s = max(0.3, min(2.0, interval_s * 0.8))
        self.sub_title = f"{source}: {len(targets)} hosts, polled every {interval_s:g} s"

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield Static("waiting for the first poll...", id="job")
            yield ProgressBar(total=None, show_eta=False, id="progress")
            with Horizontal(classes="spark-row"):
                yield Label("loss")
                yield Sparkline([], id="loss")
            with Horizontal(classes="spark-row"):
                yield Label("held-out")
                yield Sparkline([], id="eval")
            yield DataTable(id="hosts", cursor_type="none", zebra_stripes=True)
            yield DataTable(id="ranks", cursor_type="none", zebra_stripes=True)
            yield Static("", id="poll")
        yield Footer()

    def on_mount(self) -> None:
        hosts = self.query_one("#hosts", DataTable)
        for key, label in (("host", "host"), ("state", "state"), ("device", "device"), ("util", "util"),
                           ("memory", "memory"), ("temp", "temp"), ("power", "power"), ("ranks", "ranks")):  # fmt: skip
            hosts.add_column(label, key=key)
        ranks = self.query_one("#ranks", DataTable)
        for key, label in (("rank", "rank"), ("host", "host"), ("step", "step"), ("tokens", "tokens/s"),
                           ("share", "share"), ("ready", "ready s"), ("balance", "share of the batch"),
                           ("part", "computes")):  # fmt: skip
            ranks.add_column(label, key=key)
        self.run_worker(self._poll_forever(), exclusive=True, group="poll")

    async def _poll_forever(self) -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                started = time.monotonic()
                await self.cluster.poll(client, self.timeout_s)
                self.refresh_view()
                await asyncio.sleep(max(0.05, self.interval_s - (time.monotonic() - started)))

    # ----------------------------------------------------------------------------------------------

    def refresh_view(self) -> None:
        self._show_job()
        self._show_hosts()
        self._show_ranks()
        views = self.cluster.hosts.values()
        answered = sum(not v.offline for v in views)
        self.query_one("#poll", Static).update(
            f"poll {self.cluster.polls}: {answered}/{len(views)} hosts answered "
            f"(every {self.interval_s:g} s, timeout {self.timeout_s:.1f} s)   q quits"
        )

    def _show_job(self) -> None:
        job = self.cluster.job
        line = self.query_one("#job", Static)
        bar = self.query_one("#progress", ProgressBar)
        if job is None:
            line.update("no job on these hosts (runs/active-job names none)")
            return
        states = [v.sample.job_states.get(job.job) for v in self.cluster.hosts.values() if v.sample and not v.offline]
        state = max(set(s for s in states if s), key=states.count, default="?")
        step, total = job.get("step"), job.get("total_steps")
        parts = [f"job [b]{job.job}[/b]", state]
        if step is not None and total:
            parts.append(f"step {step:.0f}/{total:.0f} ({step / total:.1%})")
            bar.update(total=total, progress=step)
        parts.append(f"loss {_num(job.get('loss'), '.4f')}")
        if job.get("eval_loss") is not None:
            parts.append(f"held-out {job.get('eval_loss'):.4f} (step {job.get('eval_step') or 0:.0f})")
        parts.append(f"{_num(job.get('tokens_per_second'), ',.0f')} tokens/s")
        parts.append(f"ETA {duration(job.get('eta_seconds'))}")
        line.update("   ".join(parts))
        for spark, history in (("#loss", self.cluster.loss), ("#eval", self.cluster.eval_loss)):
            values = [v for _, v in history]
            self.query_one(spark, Sparkline).data = values if len(values) > 1 else []  # one value draws a wall

    def _host_rows(self, view: HostView) -> list[tuple[str, list[str | Text]]]:
        name = view.target.host
        if view.offline:
            seen = (
                "never answered"
                if view.last_seen is None
                else f"last seen {duration(time.monotonic() - view.last_seen)} ago"
            )
            return [
                (name, [name, Text("OFFLINE", style="bold red"), f"{view.error}; {seen}", DASH, DASH, DASH, DASH, ""])
            ]
        s = view.sample
        assert s is not None
        ranks = ",".join(str(r.rank) for r in s.ranks)
        cpu = f"CPU, {s.cpus:.0f} cores" if s.cpus else "CPU"
        up = Text("up", style="green")
        if s.lent is not None:  # taken back from the job (train/recovery/lending.py)
            since, by, why = s.lent
            up = Text(f"lent since {time.strftime('%H:%M:%S', time.localtime(since))} (by {by}: {why})",
                      style="yellow")  # fmt: skip
        memory = _gib(s.memory_used, s.memory_total)
        rows: list[tuple[str, list[str | Text]]] = [
            (name, [name, up, cpu, _ratio(s.cpu_utilization), memory, DASH, DASH, ranks]),
        ]
        for gpu in s.gpus:
            rows.append((f"{name}:gpu{gpu.index}", ["", "", f"gpu{gpu.index} {gpu.name}", _ratio(gpu.utilization),
                         _gib(gpu.memory_used, gpu.memory_total), _num(gpu.temperature, ".0f", " °C"),
                         _num(gpu.power, ".0f", " W"), ""]))  # fmt: skip
        return rows

    def _show_hosts(self) -> None:
        table = self.query_one("#hosts", DataTable)
        table.clear()
        for view in self.cluster.hosts.values():
            for key, cells in self._host_rows(view):
                table.add_row(*cells, key=key)

    def _show_ranks(self) -> None:
        table = self.query_one("#ranks", DataTable)
        table.clear()
        ranks: list[Rank] = self.cluster.ranks()
        for r in ranks:
            table.add_row(str(r.rank), r.host, _num(r.step, ".0f"), _num(r.tokens_per_s, ",.0f"), _ratio(r.share),
                          _num(r.ready_s, ".3f"), _bar(r.share), r.part or DASH, key=f"rank{r.rank}")  # fmt: skip


def run(inventory: Path, interval_s: float) -> None:
    from ugro.monitoring.monitor import targets

    Dashboard(targets(inventory), interval_s, str(inventory)).run()
