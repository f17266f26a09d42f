"""`ugro release HOST` and `ugro lend HOST`: take a host back from the running job (its ranks leave after the step
under way, the others go on without it) and lend it to the job again (its ranks rejoin after a step, with the step,
weights and optimizer state). The decision is ugro/run/lending.py's; playbooks/lend.yml writes or removes the host's
request; no controller needs to follow the run."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ugro.commands.common import DEFAULT_INVENTORY, InventoryOpt, JobIdOpt, cluster, console, fail, job_id_or_latest
from ugro.hosts.playbook import run_playbook, runs_dir
from ugro.monitoring import monitor
from ugro.monitoring.jobstates import ExporterStates
from ugro.run import lending
from ugro.run.follow import RemoteSource, local_source

HostArg = Annotated[str, typer.Argument(help="the inventory's name of the host")]
WaitOpt = Annotated[float, typer.Option(help="seconds to wait for the host's ranks to leave or come back; 0: none")]


def _source(inventory: Path, job_id: str) -> Callable[[], dict[str, dict[str, Any]]]:
    """Every host's state of the job, as a following controller reads it: from the hosts' exporters, through
    playbooks/status.yml where one gives none (the files themselves where the hosts write into this checkout)."""
    found = cluster(inventory)
    if not found.remote:
        return lambda: {h: dict(s) for h, s in local_source(runs_dir() / job_id, found.hosts)().items()}
    targets = [monitor.target(h, found.hostvars.get(h, {})) for h in found.hosts]
    remote = RemoteSource(inventory, job_id, runs_dir() / ".control" / "status", found.hosts, found.main_host,
                          ExporterStates(targets, job_id))  # fmt: skip
    return lambda: {h: dict(s) for h, s in remote().items()}


def _asked(inventory: Path, job_id: str, host: str, action: str,
           why: str | None) -> tuple[Callable[[], dict[str, dict[str, Any]]], float]:  # fmt: skip
    """Check that ``action`` (release or lend) can be done now (ugro/run/lending.py), then write the host's request
    (``why``) or remove it (playbooks/lend.yml): where the hosts' states come from, and when it was asked."""
    statuses = _source(inventory, job_id)
    refusal = (lending.release_refusal if action == "release" else lending.lend_refusal)(statuses(), host, job_id)
    if refusal is not None:
        raise fail(refusal)
    began = time.time()
    extravars: dict[str, Any] = {"ugro_job_id": job_id, "ugro_lend_action": action}
    if why is not None:
        extravars["ugro_lend_request"] = {"since": round(began, 3), "by": "hand", "why": why}
    run = run_playbook("lend.yml", inventory, extravars, runs_dir() / ".control" / "lend", limit=[host])
    if not run.ok:
        message = next(iter(run.failures.values()), "") or "the lend playbook failed"
        raise fail(f"{host}: {message.splitlines()[0]}", code=1)
    return statuses, began


def _wait(statuses: Callable[[], dict[str, dict[str, Any]]], host: str, done: Any,
          seconds: float) -> dict[str, Any] | None:  # fmt: skip
    deadline = time.monotonic() + seconds
    while True:
        status = statuses().get(host, {})
        if done(status):
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(1.0)


def release(
    host: HostArg,
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    job_id: JobIdOpt = None,
    why: Annotated[str, typer.Option(help="the reason, for the run's records")] = "taken back with make release",
    wait: WaitOpt = 60.0,
) -> None:
    """Take HOST back from the running job: its ranks leave after the step under way, its GPU is free; the others go
    on without it, nothing redone."""
    job_id = job_id_or_latest(job_id)
    statuses, began = _asked(inventory, job_id, host, "release", why)
    console.print(f"{host}: taken back from job {job_id}; its ranks leave after the step under way", highlight=False)
    if wait <= 0:
        return
    status = _wait(statuses, host, lambda s: s.get("state") != "running", wait)
    lent = (status or {}).get("lent") or {}
    if status is None or status.get("state") != "lent":
        state = "still training" if status is None else status.get("state")
        raise fail(f"{host}: its ranks have not left within {wait:g} s ({state}); `make status` shows where it is",
                   code=1)  # fmt: skip
    console.print(f"{host}: its ranks left after step {lent.get('step')} ({time.time() - began:.1f} s); "
                  f"{lent.get('main')} keeps the run's records. `make lend HOST={host}` lends it again",
                  highlight=False)  # fmt: skip


def lend(
    host: HostArg,
    inventory: InventoryOpt = DEFAULT_INVENTORY,
    job_id: JobIdOpt = None,
    wait: WaitOpt = 120.0,
) -> None:
    """Lend HOST to the running job again: its ranks start, rejoin the group after a step and train on."""
    job_id = job_id_or_latest(job_id)
    statuses, began = _asked(inventory, job_id, host, "lend", None)
    console.print(f"{host}: lent to job {job_id} again; its ranks load and rejoin the group", highlight=False)
    if wait <= 0:
        return
    status = _wait(statuses, host, _back, wait)
    if status is None:
        raise fail(f"{host}: its ranks are not back in the group within {wait:g} s; `make status` shows where it is",
                   code=1)  # fmt: skip
    console.print(f"{host}: training again ({time.time() - began:.1f} s)", highlight=False)


def _back(status: dict[str, Any]) -> bool:
    """The host's ranks train in the group again: running, not lent, not waiting to be taken in."""
    return status.get("state") == "running" and not status.get("rejoining") and not status.get("lent")


def register(app: typer.Typer) -> None:
    app.command()(release)
    app.command()(lend)
