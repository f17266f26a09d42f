"""`ugro chat`: talk to a run's fine-tuned model in the terminal (ugro/model/chat.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from train.config import ConfigError
from ugro.commands.common import JobIdOpt, fail, job_id_or_latest
from ugro.hosts.playbook import REPO, runs_dir


def chat(
    job_id: JobIdOpt = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="the longest answer, in tokens")] = 256,
    system: Annotated[str | None, typer.Option(help="a system message to start every conversation with")] = None,
) -> None:
    """Talk to a run's fine-tuned model in the terminal (its chat template, streamed); /base, /tuned, /reset, /quit."""
    from ugro.model import chat as chat_session

    run_dir = runs_dir() / job_id_or_latest(job_id)
    try:
        raise typer.Exit(chat_session.chat(run_dir, REPO, max_new_tokens=max_new_tokens, system=system))
    except ConfigError as exc:
        raise fail(str(exc)) from None


def register(app: typer.Typer) -> None:
    app.command()(chat)
