"""A test host's sandbox: what it sees as its own, and the bubblewrap command that starts its sshd as pid 1's child
in a PID namespace of its own (whatever a test starts on the host dies with it).

A host shares this machine's root filesystem except for its private /etc (its hostname, an /etc/hosts naming every
host, its own sshd keys), /root, /tmp, /run and /opt (its own /opt/ugro); or, with ``--rootfs``, it has a root of its
own: an overlay over a cached Debian (testbed/rootfs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed import inventory
from testbed import rootfs as roots
from testbed.sshd import sshd_config
from testbed.state import TestbedError, write_state
from testbed.system import run, tool

REPO = Path(__file__).resolve().parent.parent
PRIVATE_DIRS = ("etc", "root", "tmp", "run", "opt")
# The private /etc and /run live on a tmpfs of the testbed's own: copying /etc (1,200 files, most
# of them symlinks) takes ~1 s per host on a slow disk and ~25 ms on tmpfs; a real /run is a tmpfs too.
ON_TMPFS = ("etc", "run")
# A clean environment for the sandboxes: nothing of the caller's (venv, proxies, tokens) leaks in.
SANDBOX_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def hosts_file(hosts: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# Written by testbed/sandbox.py: every testbed host, so names resolve without DNS.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    lines += [f"{h['address']}\t{h['name']}" for h in hosts]
    return "\n".join(lines) + "\n"


def host_paths(directory: Path, name: str) -> dict[str, Path]:
    """Where each of a host's private directories lives on the controller."""
    return {sub: directory / ("tmpfs" if sub in ON_TMPFS else "") / name / sub for sub in PRIVATE_DIRS}


def prepare_host_dirs(
    paths: dict[str, Path],
    host: dict[str, Any],
    hosts: Sequence[dict[str, Any]],
    pubkey: str,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Create the host's /etc, /root, /tmp, /run, /opt; return the extra bwrap binds for /opt."""
    for path in paths.values():
        path.parent.mkdir(mode=0o700, exist_ok=True)
    _prepare_etc(paths["etc"], host, hosts, env)

    root = paths["root"]
    (root / ".ssh").mkdir(parents=True)
    root.chmod(0o700)
    (root / ".ssh").chmod(0o700)
    (root / ".ssh" / "authorized_keys").write_text(pubkey)
    (root / ".ssh" / "authorized_keys").chmod(0o600)

    paths["tmp"].mkdir()
    paths["tmp"].chmod(0o1777)
    run_dir = paths["run"]
    (run_dir / "sshd").mkdir(parents=True)  # sshd's privilege separation directory
    run_dir.chmod(0o755)
    (run_dir / "sshd").chmod(0o755)
    return _prepare_opt(paths["opt"])


def _prepare_etc(
    etc: Path, host: dict[str, Any], hosts: Sequence[dict[str, Any]], env: Mapping[str, str] | None
) -> None:
    """A copy of this machine's /etc with the host's name, every host's address, and sshd keys of its own."""
    run("cp", "-a", "/etc", str(etc))
    (etc / "hostname").write_text(host["name"] + "\n")
    (etc / "hosts").unlink(missing_ok=True)
    (etc / "hosts").write_text(hosts_file(hosts))
    (etc / "resolv.conf").unlink(missing_ok=True)
    (etc / "resolv.conf").write_text("# testbed host: no DNS, no route out; names come from /etc/hosts\n")
    (etc / "machine-id").unlink(missing_ok=True)
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    ssh_dir = etc / "ssh"
    ssh_dir.mkdir(exist_ok=True)
    for old in ssh_dir.glob("ssh_host_*"):
        old.unlink()  # never copy this machine's own host keys into a test host
    run(tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host['name']}",
        "-f", str(ssh_dir / "ssh_host_ed25519_key"))  # fmt: skip
    (ssh_dir / "sshd_config").write_text(sshd_config(host["address"], env=env))


def _prepare_opt(opt: Path) -> list[str]:
    """The host's own empty /opt/ugro beside this machine's /opt entries (wheelhouses and the like), so nothing is
    created on this machine's filesystem for the mount point; returns the binds of those entries."""
    (opt / "ugro").mkdir(parents=True)
    opt.chmod(0o755)
    binds: list[str] = []
    real_opt = Path("/opt")
    if real_opt.is_dir():
        for entry in sorted(real_opt.iterdir()):
            if entry.name == "ugro":
                continue
            if entry.is_symlink():
                (opt / entry.name).symlink_to(os.readlink(entry))
                continue
            if entry.is_dir():
                (opt / entry.name).mkdir()
            else:
                (opt / entry.name).touch()
            binds += ["--bind", str(entry), str(entry)]
    return binds


def _venv_base_binds() -> list[str]:
    """A read-only bind of the venv's base interpreter when a host's private dirs would hide it.

    `.venv/bin/python` is a symlink to the Python it was made from; from pyenv that lives under
    /root/.pyenv, which each host's own /root would otherwise hide ("interpreter not found").
    """
    cfg = inventory.VENV_PYTHON.parent.parent / "pyvenv.cfg"
    if not cfg.is_file():
        return []
    home = next((line.split("=", 1)[1].strip() for line in cfg.read_text().splitlines()
                 if line.split("=", 1)[0].strip() == "home"), "")  # fmt: skip
    if not home:
        return []
    prefix = Path(home).resolve().parent
    hidden = any(prefix.is_relative_to(f"/{sub}") for sub in PRIVATE_DIRS)
    return ["--ro-bind", str(prefix), str(prefix)] if hidden and prefix.is_dir() else []


def _repo_binds() -> list[str]:
    """The repository itself (its .venv is every host's Python) when a host's private dirs would hide it.

    CI clones into a temporary directory: a checkout under /tmp or /root is invisible inside a host
    whose /tmp and /root are its own, unless it is bound back in, read-only.
    """
    hidden = any(REPO.is_relative_to(f"/{sub}") for sub in PRIVATE_DIRS)
    return ["--ro-bind", str(REPO), str(REPO)] if hidden else []


def bwrap_argv(host: dict[str, Any], paths: dict[str, Path], opt_binds: list[str], info_fd: int) -> list[str]:
    """The command that starts a shared-root host: bwrap inside its namespace, sshd in the foreground."""
    argv = [tool("ip"), "netns", "exec", host["namespace"], tool("bwrap"), "--bind", "/", "/"]
    for sub in PRIVATE_DIRS:
        argv += ["--bind", str(paths[sub]), f"/{sub}"]
    argv += opt_binds
    argv += _venv_base_binds()
    argv += _repo_binds()
    argv += [
        "--dev", "/dev",
        "--proc", "/proc",
        "--unshare-uts", "--hostname", host["name"],
        # Own PID namespace: when its init dies every process of the host dies with it.
        "--unshare-pid", "--unshare-ipc",
        "--info-fd", str(info_fd),
        "--chdir", "/root",
        "--setenv", "HOME", "/root",
        "--", tool("sshd"), "-D", "-e", "-f", "/etc/ssh/sshd_config",
    ]  # fmt: skip
    return argv


def _rootfs_paths(state: dict[str, Any], name: str) -> dict[str, Path]:
    base = Path(state["dir"]) / name
    return {sub: base / sub for sub in ("upper", "work", "root")}


def prepare_rootfs_host(state: dict[str, Any], host: dict[str, Any], pubkey: str) -> None:
    """A rootfs host's root: an overlay over its Debian release's cached root, prepared as a fresh cloud host."""
    paths = _rootfs_paths(state, host["name"])
    for path in paths.values():
        path.mkdir(parents=True, mode=0o755)
    state["mounts"].append(str(paths["root"]))
    write_state(state)
    layers = f"lowerdir={host.get('lower', state['rootfs'])},upperdir={paths['upper']},workdir={paths['work']}"
    run("mount", "-t", "overlay", f"ugro-{host['name']}-{state['suffix']}", "-o", layers, str(paths["root"]))
    config = sshd_config(host["address"], ("ed25519", "rsa"))
    roots.prepare_root(paths["root"], host["name"], config, pubkey, state["apt_proxy"])


def rootfs_bwrap_argv(state: dict[str, Any], host: dict[str, Any], info_fd: int) -> list[str]:
    """The command that starts a rootfs host: bwrap over its own root inside its namespace."""
    root = _rootfs_paths(state, host["name"])["root"]
    inner = roots.bwrap_argv(tool("bwrap"), root, host["name"], info_fd)
    return [tool("ip"), "netns", "exec", host["namespace"], *inner]


def read_info(fd: int, timeout_s: float) -> dict[str, Any]:
    """bwrap's --info-fd JSON: the global pid of the sandbox's init (pid 1 inside)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            info: dict[str, Any] = json.loads(data)
            return info
    raise TestbedError(f"bwrap reported no child pid within {timeout_s:.0f} s (got {data!r})")
