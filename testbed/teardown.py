"""`down`: a test cluster taken apart from its record (<dir>/state.json), processes first, then namespaces, links
and mounts, and its directory removed. Safe twice and after a partial `up`."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from testbed import procs
from testbed import rootfs as roots
from testbed.state import DEFAULT_DIR, TestbedError, read_state
from testbed.system import link_exists, netns_exists, run, tool


def down(directory: str | Path = DEFAULT_DIR) -> bool:
    """Undo what `up` recorded in <directory>/state.json and remove the directory.

    Safe to run twice and after a partial `up`. Returns False when there was no testbed there.
    """
    directory = Path(directory).resolve()
    state = read_state(directory)
    if state is None:
        return False
    problems: list[str] = []

    left = procs.stop_processes(state.get("processes", []))
    problems += [f"process {p['pid']} ({p['role']} of {p['host']}) survived SIGKILL" for p in left]
    if state.get("rootfs") and not left:
        with contextlib.suppress(OSError, shutil.Error):  # only a cache: losing it costs a download
            roots.merge_proxy_cache(directory / "acng-cache")

    ip = tool("ip")
    for ns in state.get("namespaces", []):
        if netns_exists(ns):
            run(ip, "netns", "delete", ns, check=False)
    for link in reversed(state.get("links", [])):  # the veths, then the bridge
        if link_exists(link):
            run(ip, "link", "delete", "dev", link, check=False)
    problems += [f"namespace {ns} remains" for ns in state.get("namespaces", []) if netns_exists(ns)]
    problems += [f"link {link} remains" for link in state.get("links", []) if link_exists(link)]
    for mount in reversed(state.get("mounts", [])):
        if os.path.ismount(mount) and run("umount", mount, check=False).returncode != 0:
            run("umount", "--lazy", mount, check=False)  # busy: detach it now, freed when unused
    problems += [f"mount {mount} remains" for mount in state.get("mounts", []) if os.path.ismount(mount)]

    cp_dir = Path(state.get("control_path_dir") or directory / "cp")
    _close_control_masters(cp_dir)
    if problems:
        raise TestbedError(f"testbed down in {directory} left: " + "; ".join(problems))
    if cp_dir.is_dir() and not cp_dir.is_relative_to(directory):
        shutil.rmtree(cp_dir, ignore_errors=True)
    shutil.rmtree(directory)
    return True


def _close_control_masters(cp_dir: Path) -> None:
    """Ask Ansible's ssh ControlMasters for the testbed's hosts to exit (`ssh -O exit`, no signals)."""
    if not cp_dir.is_dir():
        return
    ssh = shutil.which("ssh")
    for sock in cp_dir.iterdir():
        if ssh and sock.is_socket():
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run([ssh, "-o", f"ControlPath={sock}", "-O", "exit", "testbed"],
                               capture_output=True, timeout=5, check=False)  # fmt: skip
