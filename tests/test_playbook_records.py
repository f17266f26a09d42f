"""What ansible-runner records of the controller's environment: a playbook's record is cut down to Ansible's own
variables when it ends, and one left by a controller that ended before its playbook (killed, its laptop off) is cut
down by the next playbook the controller starts, so a user's HF_TOKEN stays in no file of the runs directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ugro.hosts import playbook


def _record(path: Path, env: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    (path / "command").write_text(json.dumps({"command": ["ansible-playbook"], "env": env}))
    return path / "command"


def test_a_record_left_by_a_controller_that_died_is_cut_down_by_the_next_playbook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(playbook.RUNS_ENV, str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # in the shell that runs make train
    env = {"HF_TOKEN": "hf_secret", "PATH": "/usr/bin", "ANSIBLE_CONFIG": "ansible.cfg"}
    left = [_record(tmp_path / "job-1" / ".control" / "train" / "artifacts" / "abc", env),
            _record(tmp_path / ".control" / "status" / "artifacts" / "def", env)]  # fmt: skip
    (tmp_path / "inventory.yml").write_text("all:\n  hosts: {}\n")
    run = playbook.run_playbook("status.yml", tmp_path / "inventory.yml", {"ugro_job_id": "job-1"}, tmp_path / "p")
    assert run.runner is not None
    for record in [*left, *(tmp_path / "p" / "artifacts").glob("*/command")]:
        text = record.read_text()
        assert "hf_secret" not in text and json.loads(text)["env"].get("PATH"), record
