"""`ugro dashboard`: a live view of every node's exporter (ugro/monitoring/dashboard.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, fail


def dashboard(
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    interval: Annotated[float, typer.Option(help="seconds between polls of the exporters")] = 2.0,
) -> None:
    """Live view of every node's exporter: GPUs or CPU, the job's progress, loss, per-rank balance; q quits."""
    from ugro.monitoring import dashboard as dash
    from ugro.monitoring.monitor import MonitorError

    try:
        dash.run(inventory, interval)
    except MonitorError as exc:
        raise fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    app.command()(dashboard)
