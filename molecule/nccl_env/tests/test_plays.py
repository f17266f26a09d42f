"""What the role does when applied again: a host interface override wins over detection, an obsolete knob
is refused naming host and knob, and writes nothing (verify.yml, with Molecule's inventory and settings)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def test_verify_play() -> None:
    inventory = Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    play = Path(__file__).resolve().parent.parent / "verify.yml"
    run = subprocess.run(["ansible-playbook", "-i", str(inventory), str(play)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
