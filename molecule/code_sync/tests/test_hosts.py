"""Role code_sync on each host: the copy in /opt/ugro is the controller's, file for file, by the host
module's tree hash (the one a launch checks) and by one file's checksum.

A hand edit put back and a wrong hash refused are verify.yml's (molecule/conftest.py runs it last): they run the role.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

testinfra_hosts = ["ansible://ugro_cluster"]

PROJECT = Path(os.environ["MOLECULE_PROJECT_DIRECTORY"])


@pytest.fixture(scope="module")
def controller_hash() -> str:
    """Pack this checkout as converge did (pack.yml): the hash every host must hold."""
    archive = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "code" / "code.tar.gz"
    python = str(PROJECT / ".venv" / "bin" / "python")
    argv = [python, "-m", "ugro.hosts.codesync", "pack", str(PROJECT), str(archive)]
    return subprocess.run(argv, cwd=PROJECT, check=True, capture_output=True, text=True).stdout.strip()


def test_the_tree_hash_is_the_controllers(host: Any, controller_hash: str) -> None:
    tree = host.ansible("ugro_code_tree", "path=/opt/ugro", check=False)
    assert tree["hash"] == controller_hash, tree


def test_a_synced_file_has_the_controllers_checksum(host: Any) -> None:
    worker = hashlib.sha256((PROJECT / "train" / "worker.py").read_bytes()).hexdigest()
    assert host.file("/opt/ugro/train/worker.py").sha256sum == worker
    assert host.file("/opt/ugro/.ugro-code-manifest").is_file
