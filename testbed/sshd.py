"""Each test host's sshd: its configuration, and waiting until every host's answers with its banner."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed import procs
from testbed.state import TestbedError

SSH_PORT = 22


def sshd_config(address: str, key_types: Sequence[str] = ("ed25519",), env: Mapping[str, str] | None = None) -> str:
    """sshd_config of one host: root by key only, on the host's cluster address; ``env``: sshd's SetEnv."""
    host_keys = "".join(f"HostKey /etc/ssh/ssh_host_{kind}_key\n" for kind in key_types)
    set_env = f"SetEnv {' '.join(f'{k}={v}' for k, v in sorted(env.items()))}\n" if env else ""
    return f"""\
# Written by testbed/sshd.py for one testbed host.
ListenAddress {address}:{SSH_PORT}
{host_keys}PidFile /run/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PrintMotd no
AcceptEnv LANG LC_*
{set_env}Subsystem sftp internal-sftp
LogLevel INFO
"""


def _banner(address: str, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((address, SSH_PORT), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def wait_for_sshd(state: dict[str, Any], popens: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Until every host's sshd answers; raises with the log of a host whose sandbox exited, or of a service."""
    pending = {h["name"]: h for h in state["hosts"]}
    deadline = time.monotonic() + timeout_s
    while pending:
        for name, host in list(pending.items()):
            if popens[name].poll() is not None:
                log = Path(state["dir"], name, "sshd.log")
                tail = log.read_text()[-1500:] if log.exists() else ""
                raise TestbedError(f"host {name}: bwrap/sshd exited with {popens[name].returncode}:\n{tail}")
            for service in state.get("services", []):
                if not procs.is_ours(service):
                    raise TestbedError(f"{service['role']} exited; see {service['log']}")
            if _banner(host["address"]):
                del pending[name]
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{n} ({h['address']}:{SSH_PORT})" for n, h in pending.items())
            raise TestbedError(f"sshd did not accept connections within {timeout_s:.0f} s on {names}")
        if pending:
            time.sleep(0.05)
