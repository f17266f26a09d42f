"""What needs a connection or a role run: SSH to the other node with strict host key checking, and the
interface entry point (verify.yml, with Molecule's inventory and Ansible settings)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def test_verify_play() -> None:
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    play = Path(__file__).resolve().parent.parent / "verify.yml"
    run = subprocess.run(["ansible-playbook", "-i", str(inventory), str(play)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
