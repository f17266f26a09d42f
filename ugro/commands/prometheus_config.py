"""`ugro prometheus-config`: a Prometheus scrape configuration of the cluster's exporters (ugro/monitoring/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, console, fail
from ugro.hosts.playbook import REPO


def prometheus_config(
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    out: Annotated[Path, typer.Option(help="where to write it")] = Path("runs/monitoring/prometheus.yml"),
    scrape_interval: Annotated[str, typer.Option(help="Prometheus scrape interval")] = "15s",
) -> None:
    """A Prometheus scrape configuration: every node's exporter, and node_exporter where the inventory sets one."""
    from ugro.monitoring.monitor import MonitorError, render_prometheus_config

    try:
        text = render_prometheus_config(inventory, scrape_interval)
    except MonitorError as exc:
        raise fail(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"{out}: scrape configuration of {inventory} (prometheus --config.file={out}); Grafana: import "
                  f"{REPO / 'ugro' / 'monitoring' / 'grafana-dashboard.json'}", highlight=False)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command(name="prometheus-config")(prometheus_config)
