"""Shared by every scenario's testinfra verifier (molecule/<scenario>/tests/).

A scenario's tests/test_hosts.py checks each host's own facts. What one host cannot show (a connection from
another host, the role applied again with other settings) is the scenario's verify.yml, a play: it runs here
as the session's last test, with Molecule's inventory and Ansible settings, because it may change the hosts'
state that the host-fact tests read.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


class VerifyPlay(pytest.Item):
    """The scenario's verify.yml run by ansible-playbook; fails with the play's output."""

    def __init__(self, *, play: Path, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.play = play

    def runtest(self) -> None:
        inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
        run = subprocess.run(
            ["ansible-playbook", "-i", str(inventory), str(self.play)], capture_output=True, text=True, check=False
        )
        if run.returncode != 0:
            raise PlayFailed(run.stdout + run.stderr)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: object = None) -> str:
        if isinstance(excinfo.value, PlayFailed):
            return f"{self.play} failed:\n{excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.play, 0, f"play {self.play.parent.name}/verify.yml"


class PlayFailed(Exception):
    """ansible-playbook ended with a non-zero status."""


def pytest_collection_modifyitems(session: pytest.Session, items: list[pytest.Item]) -> None:
    scenario = os.environ.get("MOLECULE_SCENARIO_DIRECTORY")
    play = Path(scenario) / "verify.yml" if scenario else None
    if play is not None and play.is_file():
        items.append(VerifyPlay.from_parent(session, name=f"{play.parent.name}/verify.yml", play=play))
