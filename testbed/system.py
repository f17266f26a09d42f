"""This machine's side of the test cluster: running a command, finding a tool (installing its package where
allowed), and whether a network namespace or a link exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from testbed.state import TestbedError

PACKAGES = ("iproute2", "bubblewrap", "openssh-server", "openssh-client")
TOOLS = {"ip": "iproute2", "bwrap": "bubblewrap", "sshd": "openssh-server", "ssh-keygen": "openssh-client"}


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise TestbedError(
            f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def ensure_tools(install: bool = True) -> None:
    """Make sure ip, bwrap, sshd and ssh-keygen exist; apt-get installs the missing packages if allowed."""
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None and not _sbin(tool)})
    if not missing:
        return
    if not install or shutil.which("apt-get") is None:
        raise TestbedError(f"missing packages {', '.join(missing)}: apt-get install -y {' '.join(PACKAGES)}")
    print(f"testbed: installing {', '.join(missing)} with apt-get", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise TestbedError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-2000:]}")


def _sbin(tool: str) -> str | None:
    for base in ("/usr/sbin", "/sbin", "/usr/bin"):
        if os.access(f"{base}/{tool}", os.X_OK):
            return f"{base}/{tool}"
    return None


def tool(name: str) -> str:
    """The path of ``name`` (ip, bwrap, sshd, ssh-keygen), in PATH or an sbin directory."""
    path = shutil.which(name) or _sbin(name)
    if path is None:
        raise TestbedError(f"{name} not found (package {TOOLS.get(name, name)})")
    return path


def link_exists(name: str) -> bool:
    return run("ip", "link", "show", "dev", name, check=False).returncode == 0


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()
