"""What rootfs hosts get their packages from, served on the bridge: an apt proxy (apt-cacher-ng, Debian's
packages; the hosts have no route out) and the local apt repository of dummy NVIDIA packages (testbed/aptrepo.py)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testbed import aptrepo, procs
from testbed import rootfs as roots
from testbed.state import TestbedError, record_process, write_state

APT_REPO_PORT = 8642


def start_services(state: dict[str, Any]) -> None:
    """The apt proxy (Debian's packages) and the local apt repository (dummy NVIDIA packages)."""
    address = state["bridge_address"]
    _start_service(state, "apt-proxy", roots.acng_argv(Path(state["dir"]), address), roots.ACNG_PORT)
    state["apt_proxy"] = f"http://{address}:{roots.ACNG_PORT}"
    try:
        info = aptrepo.build(roots.cache_dir() / "aptrepo")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise TestbedError(f"building the local apt repository failed: {exc}") from exc
    argv = [sys.executable, "-m", "http.server", str(APT_REPO_PORT), "--bind", address, "--directory", str(info.dest)]
    _start_service(state, "apt-repo", argv, APT_REPO_PORT)
    url = f"http://{address}:{APT_REPO_PORT}/"
    state["apt_repo"] = {
        "url": url,
        "keyring_url": url + info.keyring_deb,
        # What role nvidia_repository checks before root installs it (its pins are NVIDIA's own files').
        "keyring_sha256": hashlib.sha256((Path(info.dest) / info.keyring_deb).read_bytes()).hexdigest(),
        **{k: v for k, v in vars(info).items() if k not in ("dest", "keyring_deb")},
    }
    write_state(state)


def _start_service(state: dict[str, Any], role: str, argv: list[str], port: int) -> None:
    log_path = Path(state["dir"]) / f"{role}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    record_process(state, popen.pid, role, "controller")
    service = {**state["processes"][-1], "log": str(log_path)}
    state.setdefault("services", []).append(service)
    write_state(state)
    _wait_listening(state["bridge_address"], port, service)


def _wait_listening(address: str, port: int, service: dict[str, Any], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
            return
        if not procs.is_ours(service):
            break
        time.sleep(0.05)
    log = Path(service["log"])
    tail = log.read_text()[-1500:] if log.is_file() else ""
    raise TestbedError(f"{service['role']} is not listening on {address}:{port}; {log}:\n{tail}")
