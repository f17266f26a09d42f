"""`ugro follow`: follow a running job again, and do what only a controller does (ugro/run/attach.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ugro.commands import ending
from ugro.commands.common import JobIdOpt, clock, cluster, console, fail, job_id_or_latest, load, warn
from ugro.hosts.playbook import REPO, runs_dir
from ugro.run import attach, launch
from ugro.run.supervisor import Supervisor
from ugro.tracking.feed import Feed


def follow(
    job_id: JobIdOpt = None,
    poll: Annotated[float | None, typer.Option(help="seconds between status polls (default: the launch's)")] = None,
) -> None:
    """Follow a running job again (after Ctrl-C, a closed terminal or a controller that died): its progress and
    faults, and what only a controller does: relaunching after a fault, copying checkpoints and results here."""
    job_id = job_id_or_latest(job_id)
    run_dir = runs_dir() / job_id
    launched = attach.Launch.read(run_dir)
    if launched is None:
        raise fail(f"{run_dir}: no launch record (.control/launch.json): `make follow` takes up runs that "
                   "`make train` launched from this checkout")  # fmt: skip
    live = attach.follower(run_dir)
    if live is not None:
        since = clock(live.get("since"))
        raise fail(f"job {job_id} is followed already: process {live.get('pid')} on {live.get('machine')} since "
                   f"{since}; end that one (Ctrl-C) or follow from there")  # fmt: skip
    job = load(Path(launched.job_file))
    inventory = Path(launched.inventory)
    hosts = cluster(inventory, f"the run's inventory is gone; put it back to follow job {job_id}")
    left = attach.Supervision.read(run_dir) or attach.Supervision(list(hosts.hosts), hosts.main_host, [], [])
    console.print(f"following job [bold]{job_id}[/] on {', '.join(left.hosts)} (main host {left.main}); "
                  f"{len(left.restarts)} restart(s) so far", highlight=False)  # fmt: skip
    for restart in left.restarts:
        console.print(f"[yellow]{escape(restart.line())}[/]", highlight=False)
    # The tracker runs `make train` opened (runs/<job-id>/tracking.json), continued.
    code_hash = str(launched.extravars.get("ugro_code_hash") or "")
    feed = Feed.start(job, run_dir, code_hash, list(hosts.hosts), hosts.remote, warn, REPO)
    supervisor = Supervisor(job, hosts, inventory, run_dir, launched.extravars, console, poll or launched.poll_s,
                            on_poll=feed.poll)  # fmt: skip
    try:
        with attach.following(run_dir):
            outcome = supervisor.run(False, attached=left)
    except KeyboardInterrupt:
        feed.detach()
        raise ending.detached(job_id) from None
    except BaseException:
        feed.finish("failed")
        raise
    launch.conclude(outcome, inventory, run_dir)
    feed.finish(outcome.state)
    ending.report(outcome, run_dir)


def register(app: typer.Typer) -> None:
    app.command()(follow)
