#!/usr/bin/env python3
"""The test cluster ("testbed"): a few real hosts on this machine, reachable over real SSH.

Each host is a network namespace joined to a Linux bridge on the controller by a veth pair, and a
bubblewrap sandbox inside it with its own hostname, PID namespace, /etc (a copy with the host's
/etc/hostname and an /etc/hosts naming every host), /root, /tmp, /run and /opt/ugro, running its
own sshd. The rest of the root filesystem (this repository and its .venv included) is shared and
writable: a host is a sandbox for tests, not a security boundary.

    python -m testbed up --hosts 3 [--dir .testbed] [--subnet 10.213.7.0/24 | auto]
    python -m testbed down [--dir .testbed]

`up` writes <dir>/inventory.yml (group ugro_cluster), <dir>/ssh_config (`ssh -F <dir>/ssh_config tb1`)
and <dir>/state.json, the record of every namespace, link and process it made; `down` undoes
exactly what that record names and removes <dir>. Both need root. A testbed left by an interrupted
run (its processes gone, its bridge and namespaces still there) is taken down by the next `up` that
wants its subnet. From Python:

    from testbed import up, down
    bed = up(".testbed", hosts=3)
    ...
    down(bed.dir)

Why not containers: no Docker engine here and podman fails (see shared/DESIGN.md). Why a PID
namespace per host: whatever a test starts on a host (torchrun, a detached job) dies with the host,
so `down` never has to look for processes by name.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec

import yaml

from testbed import aptrepo, inventory, procs
from testbed import rootfs as roots  # not `rootfs`: up() has a flag of that name

REPO = Path(__file__).resolve().parent.parent


DEFAULT_DIR = ".testbed"
DEFAULT_SUBNET = "10.213.7.0/24"
# Held while a testbed comes up (machine-wide: every session and scenario on this machine takes it).
P = ParamSpec("P")
UP_LOCK = (Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")) / "ugro-testbed-up.lock"
DEFAULT_IFNAMES = ("eth0", "enp5s0", "ens3")
# Non-members (up's non_members) get the addresses .201, .202, ... of the subnet.
NON_MEMBER_BASE = 200
SSH_PORT = 22
STATE_FILE = "state.json"
PACKAGES = ("iproute2", "bubblewrap", "openssh-server", "openssh-client")
TOOLS = {"ip": "iproute2", "bwrap": "bubblewrap", "sshd": "openssh-server", "ssh-keygen": "openssh-client"}
# A clean environment for the sandboxes: nothing of the caller's (venv, proxies, tokens) leaks in.
SANDBOX_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class TestbedError(RuntimeError):
    """Raised for anything that keeps a testbed from coming up or going down, with the reason."""

    __test__ = False  # not a pytest test class


@dataclass(frozen=True)
class TestbedHost:
    name: str
    address: str
    interface: str
    namespace: str

    __test__ = False


@dataclass(frozen=True)
class Testbed:
    dir: Path
    hosts: list[TestbedHost]
    inventory: Path
    key: Path
    ssh_config: Path
    bridge: str
    bridge_address: str
    subnet: str
    rootfs: bool = False
    outside_address: str = ""

    __test__ = False

    def host(self, name: str) -> TestbedHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @classmethod
    def load(cls, directory: str | Path) -> Testbed:
        """The testbed that `up` left in `directory` (for example by `make testbed-up`)."""
        state = _read_state(Path(directory).resolve())
        if state is None or not state.get("complete"):
            raise TestbedError(f"no complete testbed in {directory}: run `python -m testbed up` first")
        return _testbed_from_state(state)


def _testbed_from_state(state: dict[str, Any]) -> Testbed:
    directory = Path(state["dir"])
    return Testbed(
        dir=directory,
        hosts=[TestbedHost(h["name"], h["address"], h["interface"], h["namespace"]) for h in state["hosts"]],
        inventory=directory / "inventory.yml",
        key=directory / "id_ed25519",
        ssh_config=directory / "ssh_config",
        bridge=state["bridge"],
        bridge_address=state["bridge_address"],
        subnet=state["subnet"],
        rootfs=bool(state.get("rootfs")),
        outside_address=state.get("outside_address", ""),
    )


# --------------------------------------------------------------------------------------------------
# Small helpers: commands, the state file, processes.


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise TestbedError(
            f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def _suffix(directory: Path) -> str:
    """Six hex digits from the testbed's directory: two testbeds in two directories never share a name."""
    return hashlib.sha256(str(directory).encode()).hexdigest()[:6]


def _read_state(directory: Path) -> dict[str, Any] | None:
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _write_state(state: dict[str, Any]) -> None:
    path = Path(state["dir"]) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def _record_process(state: dict[str, Any], pid: int, role: str, host: str) -> None:
    stat = procs.proc_stat(pid)
    if stat is None:
        return  # it has gone already; nothing to stop later
    state["processes"].append({"pid": pid, "starttime": stat[2], "role": role, "host": host})
    _write_state(state)


def _link_exists(name: str) -> bool:
    return _run("ip", "link", "show", "dev", name, check=False).returncode == 0


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


# --------------------------------------------------------------------------------------------------
# Checks before anything is created.


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


def _tool(tool: str) -> str:
    path = shutil.which(tool) or _sbin(tool)
    if path is None:
        raise TestbedError(f"{tool} not found (package {TOOLS.get(tool, tool)})")
    return path


def _testbed_dirs() -> dict[str, Path]:
    """The directory of every testbed that has its tmpfs mounted on this machine, by suffix."""
    found: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, source = left.split(), right.split()
        if len(fields) > 4 and len(source) > 1 and re.fullmatch(r"ugro-testbed-[0-9a-f]{6}", source[1]):
            mount_point = fields[4].replace("\\040", " ")
            found[source[1].rsplit("-", 1)[1]] = Path(mount_point).parent
    return found


def _is_dead(state: dict[str, Any]) -> bool:
    """A testbed none of whose recorded processes runs any more: its hosts are gone, only its devices are left.

    One still being brought up (incomplete, written in the last minutes) is never dead.
    """
    if any(procs.is_ours(proc) for proc in state.get("processes", [])):
        return False
    age_s = time.time() - (Path(state["dir"]) / STATE_FILE).stat().st_mtime
    return bool(state.get("complete")) or age_s > 600


def reclaim_dead(net: ipaddress.IPv4Network) -> list[Path]:
    """Take down every dead testbed whose bridge holds an address in `net` (left by an interrupted run).

    A testbed is found by its tmpfs mount and taken down from its own state file, like `down` would;
    one with a process still running is left alone.
    """
    dirs = _testbed_dirs()
    addrs = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    reclaimed = []
    for link in addrs:
        name = str(link.get("ifname", ""))
        overlaps = any(
            ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}").network.overlaps(net)
            for info in link.get("addr_info", [])
        )
        directory = dirs.get(name.removeprefix("ugbr-")) if name.startswith("ugbr-") else None
        state = _read_state(directory) if overlaps and directory else None
        if state is None or directory is None or state.get("bridge") != name or not _is_dead(state):
            continue
        print(f"testbed: taking down the dead testbed in {directory} ({state['subnet']}, left by an "
              "interrupted run: none of its processes runs)", file=sys.stderr)  # fmt: skip
        down(directory)
        reclaimed.append(directory)
    return reclaimed


def free_subnet(first: int = 100, last: int = 199) -> str:
    """The first 10.213.N.0/24 (N in first..last) that neither it nor its outside network overlaps anything here."""
    for octet in range(first, last + 1):
        net = ipaddress.IPv4Network(f"10.213.{octet}.0/24")
        with contextlib.suppress(TestbedError):
            reclaim_dead(net)
            _check_subnet_free(net)
            _check_subnet_free(_outside_network(net))
            return str(net)
    raise TestbedError(f"no free subnet in 10.213.{first}.0/24..10.213.{last}.0/24: `ip -br addr` shows who holds them")


def _check_subnet_free(net: ipaddress.IPv4Network) -> None:
    """Refuse a subnet that any address or route on this machine already overlaps."""
    addrs = json.loads(_run("ip", "-j", "-4", "addr", "show").stdout or "[]")
    for link in addrs:
        for info in link.get("addr_info", []):
            iface = ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}")
            if iface.network.overlaps(net):
                raise TestbedError(
                    f"subnet {net} overlaps {iface} on {link['ifname']} (another testbed? pass --subnet)"
                )
    routes = json.loads(_run("ip", "-j", "-4", "route", "show").stdout or "[]")
    for route in routes:
        dst = route.get("dst", "")
        if dst and dst != "default" and ipaddress.IPv4Network(dst, strict=False).overlaps(net):
            raise TestbedError(f"subnet {net} overlaps the route to {dst} via {route.get('dev')}; pass --subnet")


# --------------------------------------------------------------------------------------------------
# Building one host's private directories.


def _hosts_file(hosts: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# Written by testbed/cluster.py: every testbed host, so names resolve without DNS.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    lines += [f"{h['address']}\t{h['name']}" for h in hosts]
    return "\n".join(lines) + "\n"


def _sshd_config(address: str, key_types: Sequence[str] = ("ed25519",), env: Mapping[str, str] | None = None) -> str:
    host_keys = "".join(f"HostKey /etc/ssh/ssh_host_{kind}_key\n" for kind in key_types)
    set_env = f"SetEnv {' '.join(f'{k}={v}' for k, v in sorted(env.items()))}\n" if env else ""
    return f"""\
# Written by testbed/cluster.py for one testbed host.
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


PRIVATE_DIRS = ("etc", "root", "tmp", "run", "opt")
# The private /etc and /run live on a tmpfs of the testbed's own: copying /etc (1,200 files, most
# of them symlinks) takes ~1 s per host on a slow disk and ~25 ms on tmpfs; a real /run is a tmpfs too.
ON_TMPFS = ("etc", "run")


def _host_paths(directory: Path, name: str) -> dict[str, Path]:
    """Where each of a host's private directories lives on the controller."""
    return {sub: directory / ("tmpfs" if sub in ON_TMPFS else "") / name / sub for sub in PRIVATE_DIRS}


def _prepare_host_dirs(
    paths: dict[str, Path],
    host: dict[str, Any],
    hosts: Sequence[dict[str, Any]],
    pubkey: str,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Create the host's /etc, /root, /tmp, /run, /opt; return the extra bwrap binds for /opt."""
    for path in paths.values():
        path.parent.mkdir(mode=0o700, exist_ok=True)
    _run("cp", "-a", "/etc", str(paths["etc"]))
    etc = paths["etc"]
    (etc / "hostname").write_text(host["name"] + "\n")
    (etc / "hosts").unlink(missing_ok=True)
    (etc / "hosts").write_text(_hosts_file(hosts))
    (etc / "resolv.conf").unlink(missing_ok=True)
    (etc / "resolv.conf").write_text("# testbed host: no DNS, no route out; names come from /etc/hosts\n")
    (etc / "machine-id").unlink(missing_ok=True)
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    ssh_dir = etc / "ssh"
    ssh_dir.mkdir(exist_ok=True)
    for old in ssh_dir.glob("ssh_host_*"):
        old.unlink()  # never copy this machine's own host keys into a test host
    _run(_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host['name']}",
         "-f", str(ssh_dir / "ssh_host_ed25519_key"))  # fmt: skip
    (ssh_dir / "sshd_config").write_text(_sshd_config(host["address"], env=env))

    root = paths["root"]
    (root / ".ssh").mkdir(parents=True)
    root.chmod(0o700)
    (root / ".ssh").chmod(0o700)
    (root / ".ssh" / "authorized_keys").write_text(pubkey)
    (root / ".ssh" / "authorized_keys").chmod(0o600)

    paths["tmp"].mkdir()
    paths["tmp"].chmod(0o1777)
    run = paths["run"]
    (run / "sshd").mkdir(parents=True)  # sshd's privilege separation directory
    run.chmod(0o755)
    (run / "sshd").chmod(0o755)

    # /opt: the host's own empty /opt/ugro beside this machine's /opt entries (wheelhouses and the like),
    # so nothing is created on this machine's filesystem for the mount point.
    opt = paths["opt"]
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


def _bwrap_argv(host: dict[str, Any], paths: dict[str, Path], opt_binds: list[str], info_fd: int) -> list[str]:
    argv = [_tool("ip"), "netns", "exec", host["namespace"], _tool("bwrap"), "--bind", "/", "/"]
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
        "--", _tool("sshd"), "-D", "-e", "-f", "/etc/ssh/sshd_config",
    ]  # fmt: skip
    return argv


def _read_info(fd: int, timeout_s: float) -> dict[str, Any]:
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


def _banner(address: str, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((address, SSH_PORT), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _wait_for_sshd(state: dict[str, Any], popens: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
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


# --------------------------------------------------------------------------------------------------
# Inventory and ssh_config.


def _control_path_dir(directory: Path, suffix: str) -> str:
    """Where Ansible keeps its ssh ControlMaster sockets: per testbed, so a later testbed on the same
    addresses never reuses a stale master of an earlier one; short enough for a unix socket path."""
    inside = directory / "cp"
    return str(inside) if len(str(inside)) <= 48 else f"/tmp/ugro-testbed-cp-{suffix}"


# --------------------------------------------------------------------------------------------------
# Hosts with a root filesystem of their own (--rootfs), and the services they get packages from.

APT_REPO_PORT = 8642


def _outside_network(net: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    """A network beside the cluster subnet (10.213.12.0/24 -> 10.214.12.0/24): "the rest of the LAN"."""
    return ipaddress.IPv4Network((int(net.network_address) + (1 << 16), net.prefixlen))


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


def _start_service(state: dict[str, Any], role: str, argv: list[str], port: int) -> None:
    log_path = Path(state["dir"]) / f"{role}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    _record_process(state, popen.pid, role, "controller")
    service = {**state["processes"][-1], "log": str(log_path)}
    state.setdefault("services", []).append(service)
    _write_state(state)
    _wait_listening(state["bridge_address"], port, service)


def _start_services(state: dict[str, Any]) -> None:
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
    _write_state(state)


def _rootfs_paths(state: dict[str, Any], name: str) -> dict[str, Path]:
    base = Path(state["dir"]) / name
    return {sub: base / sub for sub in ("upper", "work", "root")}


def _prepare_rootfs_host(state: dict[str, Any], host: dict[str, Any], pubkey: str) -> None:
    paths = _rootfs_paths(state, host["name"])
    for path in paths.values():
        path.mkdir(parents=True, mode=0o755)
    state["mounts"].append(str(paths["root"]))
    _write_state(state)
    layers = f"lowerdir={host.get('lower', state['rootfs'])},upperdir={paths['upper']},workdir={paths['work']}"
    _run("mount", "-t", "overlay", f"ugro-{host['name']}-{state['suffix']}", "-o", layers, str(paths["root"]))
    config = _sshd_config(host["address"], ("ed25519", "rsa"))
    roots.prepare_root(paths["root"], host["name"], config, pubkey, state["apt_proxy"])


def _rootfs_bwrap_argv(state: dict[str, Any], host: dict[str, Any], info_fd: int) -> list[str]:
    root = _rootfs_paths(state, host["name"])["root"]
    inner = roots.bwrap_argv(_tool("bwrap"), root, host["name"], info_fd)
    return [_tool("ip"), "netns", "exec", host["namespace"], *inner]


# --------------------------------------------------------------------------------------------------
# up / down.


def _one_at_a_time(bring_up: Callable[P, Testbed]) -> Callable[P, Testbed]:
    """One testbed comes up at a time on this machine (UP_LOCK): choosing a free subnet and taking it with a
    bridge is then one step, so scenarios and sessions side by side never pick the same one."""

    @functools.wraps(bring_up)
    def locked(*args: P.args, **kwargs: P.kwargs) -> Testbed:
        with roots.locked(UP_LOCK):
            return bring_up(*args, **kwargs)

    return locked


@_one_at_a_time
def up(
    directory: str | Path = DEFAULT_DIR,
    hosts: int = 3,
    subnet: str = DEFAULT_SUBNET,
    ifnames: Sequence[str] = DEFAULT_IFNAMES,
    *,
    install: bool = True,
    timeout_s: float = 20.0,
    rootfs: bool = False,
    debian: Sequence[str] = ("12",),
    non_members: int = 0,
    session_env: Mapping[str, str] | None = None,
) -> Testbed:
    """Bring up `hosts` testbed hosts tb1..tbN; on any failure undo everything and raise TestbedError.

    With `rootfs`, every host has a Debian root filesystem of its own (an overlay over a cached
    debootstrap) instead of sharing this machine's, its packages come through an apt proxy on the
    bridge, and a local apt repository with dummy NVIDIA packages is served beside it: what the
    provisioning roles' Molecule scenarios need. The bridge also gets an address outside the subnet
    (`outside_address`) that the hosts route to, to test what is refused from outside the subnet.

    `non_members` adds that many bare hosts nm1..nmN on the same bridge and subnet (a network namespace
    with an address, no sshd), left out of the inventory's hosts: a device of the LAN that is no member
    of the cluster. The inventory names them in `testbed_non_members` ({name, address, namespace}).

    `session_env`: variables every SSH session on a host gets (sshd's SetEnv), so every process Ansible starts there:
    the tests' ``UGRO_NCCL_LIKE=1``, which runs the ranks' default group on the backend that behaves as NCCL does.
    """
    directory = Path(directory).resolve()
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, bridges, bind mounts)")
    if hosts < 1:
        raise TestbedError(f"--hosts must be at least 1, not {hosts}")
    ifnames = [name for name in ifnames if name]
    if not ifnames or any(len(n) > 15 or n == "lo" or "/" in n or " " in n for n in ifnames):
        raise TestbedError(f"bad interface names {ifnames!r}: 1 to 15 characters each, not lo")
    if subnet == "auto":
        ensure_tools(install)
        subnet = free_subnet()
    try:
        net = ipaddress.IPv4Network(subnet, strict=False)
    except ValueError as exc:
        raise TestbedError(f"bad subnet {subnet!r}: {exc}") from exc
    if net.num_addresses < 10 + hosts + 2:
        raise TestbedError(f"subnet {net} is too small for {hosts} hosts (addresses .{10 + 1}..)")
    if non_members < 0 or (non_members and net.num_addresses < NON_MEMBER_BASE + non_members + 2):
        raise TestbedError(
            f"--non-members {non_members}: subnet {net} has no room for them (addresses .{NON_MEMBER_BASE + 1}..)"
        )
    if _read_state(directory) is not None:
        raise TestbedError(f"a testbed already exists in {directory}: `python -m testbed down --dir {directory}`")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise TestbedError(f"{directory} exists and is not an empty directory: `down` would remove it whole")
    ensure_tools(install)
    outside = _outside_network(net)
    reclaim_dead(net)
    _check_subnet_free(net)
    base = None
    lowers: dict[str, str] = {}
    if rootfs:
        reclaim_dead(outside)
        _check_subnet_free(outside)
        try:
            lowers = {release: str(roots.ensure_base(release)) for release in dict.fromkeys(debian)}
            base = lowers[debian[0]]
            roots.ensure_proxy_tools()
        except RuntimeError as exc:
            raise TestbedError(str(exc)) from exc

    suffix = _suffix(directory)
    releases = [debian[(i - 1) % len(debian)] for i in range(1, hosts + 1)]
    host_list = [
        {
            "name": f"tb{i}",
            "address": str(net.network_address + 10 + i),
            "interface": ifnames[(i - 1) % len(ifnames)],
            "namespace": f"ugro-tb{i}-{suffix}",
            "veth": f"ugv{i}-{suffix}",
            **({"debian": releases[i - 1], "lower": lowers[releases[i - 1]]} if base else {}),
        }
        for i in range(1, hosts + 1)
    ]
    strangers = [
        {
            "name": f"nm{i}",
            "address": str(net.network_address + NON_MEMBER_BASE + i),
            "namespace": f"ugro-nm{i}-{suffix}",
            "veth": f"ugn{i}-{suffix}",
        }
        for i in range(1, non_members + 1)
    ]
    for host in [*host_list, *strangers]:
        if _netns_exists(host["namespace"]) or _link_exists(host["veth"]):
            raise TestbedError(
                f"{host['namespace']} or {host['veth']} already exists: a testbed left over in {directory}?"
            )

    directory.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        "version": 1,
        "dir": str(directory),
        "suffix": suffix,
        "subnet": str(net),
        "bridge": f"ugbr-{suffix}",
        "bridge_address": str(net.network_address + 1),
        "control_path_dir": _control_path_dir(directory, suffix),
        "hosts": host_list,
        "non_members": strangers,
        "session_env": dict(session_env or {}),
        "namespaces": [],
        "links": [],
        "mounts": [],
        "processes": [],
        "complete": False,
        "rootfs": str(base) if base else "",
        "outside_address": str(outside.network_address + 1) if base else "",
        "outside_subnet": str(outside) if base else "",
    }
    _write_state(state)  # from here on `down` can undo whatever was made
    try:
        _bring_up(state, timeout_s)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            down(directory)
        if isinstance(exc, TestbedError):
            raise TestbedError(f"testbed up failed (everything made was removed): {exc}") from exc
        if isinstance(exc, Exception):
            raise TestbedError(f"testbed up failed (everything made was removed): {exc!r}") from exc
        raise
    return _testbed_from_state(state)


def _bring_up(state: dict[str, Any], timeout_s: float) -> None:
    directory = Path(state["dir"])
    key = directory / "id_ed25519"
    _run(_tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "ugro-testbed", "-f", str(key))
    pubkey = (directory / "id_ed25519.pub").read_text()

    ip = _tool("ip")
    bridge = state["bridge"]
    state["links"].append(bridge)
    _write_state(state)
    _run(ip, "link", "add", "name", bridge, "type", "bridge")
    _run(ip, "addr", "add", f"{state['bridge_address']}/{ipaddress.IPv4Network(state['subnet']).prefixlen}",
         "dev", bridge)  # fmt: skip
    _run(ip, "link", "set", "dev", bridge, "up")
    if state["rootfs"]:
        outside_prefix = ipaddress.IPv4Network(state["outside_subnet"]).prefixlen
        _run(ip, "addr", "add", f"{state['outside_address']}/{outside_prefix}", "dev", bridge)
        _start_services(state)

    tmpfs = directory / "tmpfs"
    tmpfs.mkdir(mode=0o700)
    state["mounts"].append(str(tmpfs))
    _write_state(state)
    size_mib = max(64, 32 * len(state["hosts"]))  # a limit, not an allocation: ~4 MiB per host is used
    _run("mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", f"ugro-testbed-{state['suffix']}", str(tmpfs))

    prefixlen = ipaddress.IPv4Network(state["subnet"]).prefixlen
    opt_binds: dict[str, list[str]] = {}
    for host in state["hosts"]:
        ns, veth, ifname = host["namespace"], host["veth"], host["interface"]
        state["namespaces"].append(ns)
        state["links"].append(veth)
        _write_state(state)
        _run(ip, "netns", "add", ns)
        # The namespace end is created inside the namespace under the host's interface name.
        _run(ip, "link", "add", "name", veth, "type", "veth", "peer", "name", ifname, "netns", ns)
        _run(ip, "link", "set", "dev", veth, "master", bridge, "up")
        _run(ip, "-n", ns, "addr", "add", f"{host['address']}/{prefixlen}", "dev", ifname)
        _run(ip, "-n", ns, "link", "set", "dev", ifname, "up")
        _run(ip, "-n", ns, "link", "set", "dev", "lo", "up")
        if state["rootfs"]:
            # The LAN beyond the cluster subnet: the hosts can answer it, so "refused" can be tested.
            _run(ip, "-n", ns, "route", "add", state["outside_subnet"], "dev", ifname)
            _prepare_rootfs_host(state, host, pubkey)
            continue
        opt_binds[host["name"]] = _prepare_host_dirs(_host_paths(directory, host["name"]), host, state["hosts"], pubkey,
                                                     state.get("session_env"))  # fmt: skip

    for stranger in state.get("non_members", []):
        _add_non_member(state, stranger, prefixlen)

    popens: dict[str, subprocess.Popen[bytes]] = {}
    inits: dict[str, int] = {}
    for host in state["hosts"]:
        read_fd, write_fd = os.pipe()
        try:
            with open(directory / host["name"] / "sshd.log", "wb") as log:
                argv = (
                    _rootfs_bwrap_argv(state, host, write_fd)
                    if state["rootfs"]
                    else _bwrap_argv(host, _host_paths(directory, host["name"]), opt_binds[host["name"]], write_fd)
                )
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,), env=SANDBOX_ENV,
                    start_new_session=True,  # outlives `make testbed-up` and its terminal
                )  # fmt: skip
            popens[host["name"]] = popen
            # `ip netns exec` execs bwrap in place, so this pid is bwrap's own.
            _record_process(state, popen.pid, "bwrap", host["name"])
            os.close(write_fd)
            write_fd = -1
            info = _read_info(read_fd, timeout_s)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        inits[host["name"]] = int(info["child-pid"])
        _record_process(state, inits[host["name"]], "init", host["name"])

    _wait_for_sshd(state, popens, timeout_s)
    for host in state["hosts"]:
        for pid in procs.children(inits[host["name"]]):
            _record_process(state, pid, "sshd", host["name"])

    inventory.write(state)
    state["complete"] = True
    _write_state(state)


def _add_non_member(state: dict[str, Any], host: dict[str, Any], prefixlen: int) -> None:
    """A bare host of the subnet, not in the inventory: a namespace on the bridge with an address, nothing else."""
    ip = _tool("ip")
    state["namespaces"].append(host["namespace"])
    state["links"].append(host["veth"])
    _write_state(state)
    _run(ip, "netns", "add", host["namespace"])
    _run(ip, "link", "add", "name", host["veth"], "type", "veth", "peer", "name", "eth0", "netns", host["namespace"])
    _run(ip, "link", "set", "dev", host["veth"], "master", state["bridge"], "up")
    _run(ip, "-n", host["namespace"], "addr", "add", f"{host['address']}/{prefixlen}", "dev", "eth0")
    _run(ip, "-n", host["namespace"], "link", "set", "dev", "eth0", "up")
    _run(ip, "-n", host["namespace"], "link", "set", "dev", "lo", "up")


def down(directory: str | Path = DEFAULT_DIR) -> bool:
    """Undo what `up` recorded in <directory>/state.json and remove the directory.

    Safe to run twice and after a partial `up`. Returns False when there was no testbed there.
    """
    directory = Path(directory).resolve()
    state = _read_state(directory)
    if state is None:
        return False
    problems: list[str] = []

    left = procs.stop_processes(state.get("processes", []))
    problems += [f"process {p['pid']} ({p['role']} of {p['host']}) survived SIGKILL" for p in left]
    if state.get("rootfs") and not left:
        with contextlib.suppress(OSError, shutil.Error):  # only a cache: losing it costs a download
            roots.merge_proxy_cache(directory / "acng-cache")

    ip = _tool("ip")
    for ns in state.get("namespaces", []):
        if _netns_exists(ns):
            _run(ip, "netns", "delete", ns, check=False)
    for link in reversed(state.get("links", [])):  # the veths, then the bridge
        if _link_exists(link):
            _run(ip, "link", "delete", "dev", link, check=False)
    problems += [f"namespace {ns} remains" for ns in state.get("namespaces", []) if _netns_exists(ns)]
    problems += [f"link {link} remains" for link in state.get("links", []) if _link_exists(link)]
    for mount in reversed(state.get("mounts", [])):
        if os.path.ismount(mount) and _run("umount", mount, check=False).returncode != 0:
            _run("umount", "--lazy", mount, check=False)  # busy: detach it now, freed when unused
    problems += [f"mount {mount} remains" for mount in state.get("mounts", []) if os.path.ismount(mount)]

    _close_control_masters(Path(state.get("control_path_dir") or directory / "cp"))
    if problems:
        raise TestbedError(f"testbed down in {directory} left: " + "; ".join(problems))
    cp_dir = Path(state.get("control_path_dir") or directory / "cp")
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


# --------------------------------------------------------------------------------------------------
# Faults: what the recovery tests and `make bench-recovery` do to a host mid-job.


def _members(directory: str | Path, host: str) -> list[int]:
    """The pids (as this machine sees them) of every process inside ``host``."""
    state = _read_state(Path(directory).resolve())
    if state is None:
        raise TestbedError(f"no testbed in {directory}")
    inits = [p for p in state["processes"] if p.get("role") == "init" and p.get("host") == host]
    return [pid for init in inits for pid in procs.namespace_members(init)]


def _read_proc(pid: int, name: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def host_processes(directory: str | Path, host: str, marker: str) -> list[int]:
    """The pids (as this machine sees them) of the processes inside ``host`` whose command line has ``marker``."""
    return [pid for pid in _members(directory, host) if marker in (_read_proc(pid, "cmdline") or "")]


def host_ranks(directory: str | Path, host: str) -> list[int]:
    """The pids (as this machine sees them) of the ranks inside ``host``: processes named ``ugro-rank<N>`` (a rank
    names itself so, whether torchrun started it or train/launcher.py forked it with the launcher's command line)."""
    return [pid for pid in _members(directory, host) if (_read_proc(pid, "comm") or "").startswith("ugro-rank")]


def kill_ranks(directory: str | Path, host: str) -> list[int]:
    """SIGKILL every rank inside ``host`` (a crashed rank, the launcher on that host left running)."""
    pids = host_ranks(directory, host)
    procs.send(pids, signal.SIGKILL)
    return pids


def one_rank_per_host(bed: Testbed, path: Path) -> Path:
    """A copy of the testbed's inventory at ``path`` where every host starts one CPU rank with one thread: the
    test hosts share this machine's cores, and three ranks are what the multi-host tests and benchmarks run."""
    data = yaml.safe_load(Path(bed.inventory).read_text())
    for host in data["all"]["children"]["ugro_cluster"]["hosts"].values():
        host |= {"ugro_cpu_procs_per_node": 1, "ugro_omp_num_threads": 1}
    path.write_text(yaml.safe_dump(data))
    return path


def kill_processes(directory: str | Path, host: str, marker: str) -> list[int]:
    """SIGKILL every process inside ``host`` whose command line has ``marker`` (a host crash, as the job sees it)."""
    pids = host_processes(directory, host, marker)
    procs.send(pids, signal.SIGKILL)
    return pids


def set_link(directory: str | Path, host: str, up: bool) -> None:
    """Bring ``host``'s cluster interface down (a pulled cable: no RST, packets just stop) or back up."""
    bed = Testbed.load(directory)
    target = bed.host(host)
    _run(_tool("ip"), "netns", "exec", target.namespace, _tool("ip"), "link", "set", target.interface,
         "up" if up else "down")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Command line.


def _iter_summary(bed: Testbed) -> Iterator[str]:
    yield f"testbed up in {bed.dir}: bridge {bed.bridge} {bed.bridge_address}/{bed.subnet.split('/')[1]}"
    for h in bed.hosts:
        yield f"  {h.name:5} {h.address:15} {h.interface:8} netns {h.namespace}"
    yield f"inventory: {bed.inventory}"
    yield f"try:       ssh -F {bed.ssh_config} {bed.hosts[0].name} hostname"
    yield f"           ansible -i {bed.inventory} ugro_cluster -m ansible.builtin.ping"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring the test hosts up")
    p_up.add_argument("--hosts", type=int, default=3, help="number of hosts tb1..tbN (default 3)")
    p_up.add_argument("--dir", default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_up.add_argument("--subnet", default=DEFAULT_SUBNET,
                      help=f"private IPv4 subnet, or auto: the first free 10.213.N.0/24 from N=100 "
                      f"(default {DEFAULT_SUBNET})")  # fmt: skip
    p_up.add_argument("--ifnames", default=",".join(DEFAULT_IFNAMES),
                      help="interface names the hosts get, in rotation (default %(default)s)")  # fmt: skip
    p_up.add_argument("--no-install", action="store_true", help="never apt-get install missing packages")
    p_up.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for the sshds (default 20)")
    p_up.add_argument(
        "--rootfs",
        action="store_true",
        help="give every host its own Debian root filesystem, an apt proxy and the local apt repo",
    )
    p_up.add_argument("--non-members", type=int, default=0,
                      help="bare hosts nm1..nmN on the bridge and subnet, not in the inventory")  # fmt: skip
    p_up.add_argument("--debian", default="12",
                      help="with --rootfs, the Debian release of each host, in rotation: 12 (Python 3.11), "
                      "13 (Python 3.13); e.g. 12,13 (default 12)")  # fmt: skip
    p_down = sub.add_parser("down", help="stop the test hosts and remove everything up made")
    p_down.add_argument("--dir", default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    args = parser.parse_args(argv)

    try:
        if args.command == "up":
            started = time.monotonic()
            bed = up(args.dir, args.hosts, args.subnet, args.ifnames.split(","),
                     install=not args.no_install, timeout_s=args.timeout, rootfs=args.rootfs,
                     debian=args.debian.split(","), non_members=args.non_members)  # fmt: skip
            for line in _iter_summary(bed):
                print(line)
            print(f"({time.monotonic() - started:.1f} s)")
        else:
            started = time.monotonic()
            gone = down(args.dir)
            print(f"testbed in {args.dir} removed ({time.monotonic() - started:.1f} s)" if gone
                  else f"no testbed in {args.dir}")  # fmt: skip
    except TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
