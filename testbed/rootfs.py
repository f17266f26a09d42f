"""Test hosts with a root filesystem of their own, for the provisioning roles' Molecule scenarios.

A provisioning role really installs packages, so its test host cannot share this machine's `/` the
way the training tests' hosts do. Each such host gets an overlay over one cached, debootstrapped
Debian 12 or 13 (minbase + what a fresh cloud image has: python3, python3-apt, openssh-server, iproute2,
and python3-psutil for ugro's host modules), and reaches Debian's packages only through an
apt-cacher-ng proxy that the testbed runs on its bridge address: the hosts have no route out.

    python -m testbed.rootfs build [12] [13]  # build the cache of Debian 12 (the default) or 13 now (~1 min each,
                                              # once; up does it too)

The cache lives in /var/cache/ugro-testbed (UGRO_TESTBED_CACHE overrides it), keyed by the package
list, and is built in a temporary directory and renamed into place, so a half-built one is never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

# The Debian releases a test host may run, by version: 12 has Python 3.11, 13 has Python 3.13.
SUITES = {"12": "bookworm", "13": "trixie"}
MIRROR = "http://deb.debian.org/debian"
# What a fresh Debian/Ubuntu cloud image already has, and Ansible needs, beyond minbase; and psutil,
# which ugro's host modules need (on a real host the roles that call them install python3-psutil).
PACKAGES = ("python3", "python3-apt", "python3-psutil", "openssh-server", "iproute2", "ca-certificates", "sudo")
CACHE_ENV = "UGRO_TESTBED_CACHE"
DEFAULT_CACHE = Path("/var/cache/ugro-testbed")
ACNG_PORT = 3142
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


class RootfsError(RuntimeError):
    """Raised when the cached root filesystem or the apt proxy cannot be had, with the reason."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _key(suite: str) -> str:
    spec = f"{suite} minbase {','.join(PACKAGES)} v1"
    return hashlib.sha256(spec.encode()).hexdigest()[:10]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock, so two testbeds starting at once build the cache once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _apt_install(*packages: str) -> None:
    def installed(package: str) -> bool:
        query = ["dpkg-query", "-W", "-f=${Status}", package]
        return subprocess.run(query, capture_output=True, text=True, check=False).stdout == "install ok installed"

    missing = [p for p in packages if not installed(p)]
    if not missing:
        return
    print(f"testbed: installing {', '.join(missing)} with apt-get", file=sys.stderr)
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=APT_ENV, check=False)
        if proc.returncode != 0:
            raise RootfsError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-2000:]}")


def ensure_base(debian: str = "12", log: Path | None = None) -> Path:
    """The cached root filesystem of Debian `debian` (12 or 13; a read-only lower layer); built first if missing."""
    if debian not in SUITES:
        raise RootfsError(f"Debian {debian!r} is not a test host release: one of {', '.join(SUITES)}")
    suite = SUITES[debian]
    base = cache_dir() / f"debian{debian}-{_key(suite)}"
    if (base / ".complete").is_file():
        return base / "root"
    with locked(cache_dir() / ".lock"):
        if (base / ".complete").is_file():
            return base / "root"
        _apt_install("debootstrap")
        tmp = cache_dir() / f".building-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        started = time.monotonic()
        print(f"testbed: debootstrapping Debian {debian} into {base} (a few minutes, once)", file=sys.stderr)
        try:
            with open(log or tmp / "debootstrap.log", "w") as out:
                proc = subprocess.run(
                    ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite,
                     str(tmp / "root"), MIRROR],
                    stdout=out, stderr=subprocess.STDOUT, check=False,
                )  # fmt: skip
            if proc.returncode != 0:
                raise RootfsError(f"debootstrap failed ({proc.returncode}); see {log or tmp / 'debootstrap.log'}")
            root = tmp / "root"
            for key in (root / "etc" / "ssh").glob("ssh_host_*"):
                key.unlink()  # every host makes its own
            shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            (root / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)
            (tmp / ".complete").write_text(f"built in {time.monotonic() - started:.0f} s\n")
            if base.exists():
                shutil.rmtree(base)
            tmp.rename(base)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return base / "root"


def ensure_proxy_tools() -> None:
    _apt_install("apt-cacher-ng")


def _shared_cache() -> Path:
    return cache_dir() / "apt-cacher-ng"


def _copy_cache(src: Path, dst: Path) -> None:
    """Copy the proxy's cached files (not its statistics), skipping any that vanish meanwhile."""
    for folder, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "_xstore"]
        target = dst / Path(folder).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                source, dest = Path(folder) / name, target / name
                have = dest.stat() if dest.exists() else None
                new = source.stat()
                if have is None or have.st_size != new.st_size or have.st_mtime < new.st_mtime:
                    shutil.copy2(source, dest)


def seed_proxy_cache(private: Path) -> None:
    """A testbed's proxy starts from a copy of the shared cache: two testbeds never write one file."""
    with locked(cache_dir() / ".acng-lock"):
        private.mkdir(parents=True, exist_ok=True)
        if _shared_cache().is_dir():
            _copy_cache(_shared_cache(), private)


def merge_proxy_cache(private: Path) -> None:
    """What a testbed's proxy fetched goes back into the shared cache (its proxy has stopped)."""
    if private.is_dir():
        with locked(cache_dir() / ".acng-lock"):
            _copy_cache(private, _shared_cache())


def acng_argv(state_dir: Path, address: str) -> list[str]:
    """apt-cacher-ng in the foreground on the bridge address, with a cache of its testbed's own.

    Its own configuration, not /etc/apt-cacher-ng's: no mirror remapping, so it fetches exactly the
    URL a host asks for (deb.debian.org here), the way this machine's own apt does.
    """
    cache = state_dir / "acng-cache"
    seed_proxy_cache(cache)
    conf = state_dir / "acng-conf"
    logs = state_dir / "acng-log"
    conf.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    (conf / "acng.conf").write_text(
        "# Written by testbed/rootfs.py: the test hosts' only way to Debian's packages.\n"
        f"CacheDir: {cache}\nLogDir: {logs}\nSupportDir: /usr/lib/apt-cacher-ng\n"
        f"BindAddress: {address}\nPort: {ACNG_PORT}\nPidFile: {state_dir / 'acng.pid'}\n"
        f"SocketPath: {state_dir / 'acng.socket'}\nForeGround: 1\nExThreshold: 30\n"
        "PassThroughPattern: ^$\n"
    )
    binary = shutil.which("apt-cacher-ng") or "/usr/sbin/apt-cacher-ng"
    return [binary, "-c", str(conf)]


def prepare_root(root: Path, name: str, sshd_config: str, pubkey: str, proxy: str) -> None:
    """Make the merged overlay `root` a host of its own: name, keys, sshd, the apt proxy."""
    etc = root / "etc"
    (etc / "hostname").write_text(name + "\n")
    # Like a fresh box: itself and localhost only. Naming the other nodes is cluster_network's job.
    (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (etc / "resolv.conf").unlink(missing_ok=True)
    (etc / "resolv.conf").write_text("# test host: no DNS and no route out; packages come through the apt proxy\n")
    (etc / "machine-id").write_text(uuid.uuid4().hex + "\n")
    ssh_dir = etc / "ssh"
    for kind in ("ed25519", "rsa"):
        key = ssh_dir / f"ssh_host_{kind}_key"
        if not key.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"root@{name}", "-f", str(key)],
                           check=True, capture_output=True)  # fmt: skip
    (ssh_dir / "sshd_config").write_text(sshd_config)
    dot_ssh = root / "root" / ".ssh"
    dot_ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
    (dot_ssh / "authorized_keys").write_text(pubkey)
    (dot_ssh / "authorized_keys").chmod(0o600)
    apt_conf = etc / "apt" / "apt.conf.d"
    bridge = proxy.split("//", 1)[1].rsplit(":", 1)[0]
    (apt_conf / "01testbed-proxy").write_text(
        "// Written by testbed/rootfs.py: the only way out of a test host. The controller's own\n"
        "// services (the local apt repository) are reached directly.\n"
        f'Acquire::http::Proxy "{proxy}";\nAcquire::http::Proxy::{bridge} "DIRECT";\n'
    )
    # No init system in a test host: package scripts must not start daemons (Debian's container default).
    policy = root / "usr" / "sbin" / "policy-rc.d"
    policy.write_text("#!/bin/sh\n# Written by testbed/rootfs.py: no services start in a test host.\nexit 101\n")
    policy.chmod(0o755)


def bwrap_argv(bwrap: str, root: Path, name: str, info_fd: int) -> list[str]:
    """The host's sandbox: its own root, /dev, /proc, /run and /tmp; sshd of its own Debian as init's child."""
    return [
        bwrap, "--bind", str(root), "/",
        "--dev", "/dev", "--proc", "/proc",
        "--tmpfs", "/run", "--dir", "/run/sshd", "--perms", "1777", "--tmpfs", "/tmp",
        "--unshare-uts", "--hostname", name, "--unshare-pid", "--unshare-ipc",
        "--cap-add", "ALL",  # root in a test host may manage its firewall and packages
        "--info-fd", str(info_fd), "--chdir", "/root", "--setenv", "HOME", "/root",
        "--", "/usr/sbin/sshd", "-D", "-e", "-f", "/etc/ssh/sshd_config",
    ]  # fmt: skip


def main(argv: list[str]) -> int:
    if argv[1:2] != ["build"] or any(release not in SUITES for release in argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        for release in argv[2:] or ["12"]:
            print(ensure_base(release))
    except RootfsError as exc:
        print(f"rootfs: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
