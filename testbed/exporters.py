"""Each test host's node exporter started or stopped as `make provision` does it (playbooks/provision.yml, tag
exporter): for the tests and the benchmarks that read the hosts' state over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def set_state(inventory: Path, state: str = "started", timeout_s: float = 600) -> None:
    """Role exporter on every host of ``inventory``, ``started`` (where it does not run; left alone where it does)
    or ``stopped``; raises RuntimeError with the play's end when it fails."""
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "playbooks/provision.yml",
            "--tags", "exporter", "-e", f"exporter_state={state}"]  # fmt: skip
    env = os.environ | {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"role exporter ({state}) failed:\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
