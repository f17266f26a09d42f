"""`up`: a test cluster brought up, step by step, each step recorded before it is made (testbed/state.py), and
everything made undone when one fails. One testbed comes up at a time on this machine."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec

from testbed import inventory, links, procs, sandbox, services, sshd, subnets
from testbed import rootfs as roots  # not `rootfs`: up() has a flag of that name
from testbed.state import (
    DEFAULT_DIR,
    Testbed,
    TestbedError,
    name_suffix,
    read_state,
    record_process,
    testbed_from_state,
    write_state,
)
from testbed.system import ensure_tools, link_exists, netns_exists, run, tool
from testbed.teardown import down

DEFAULT_SUBNET = "10.213.7.0/24"
DEFAULT_IFNAMES = ("eth0", "enp5s0", "ens3")
# Held while a testbed comes up (machine-wide: every session and scenario on this machine takes it).
UP_LOCK = (Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")) / "ugro-testbed-up.lock"
P = ParamSpec("P")


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
    ifnames = [name for name in ifnames if name]
    net = _checked(directory, hosts, subnet, ifnames, non_members, install)
    ensure_tools(install)
    outside = subnets.outside_network(net)
    subnets.reclaim_dead(net)
    subnets.check_subnet_free(net)
    lowers: dict[str, str] = {}
    if rootfs:
        subnets.reclaim_dead(outside)
        subnets.check_subnet_free(outside)
        try:
            lowers = {release: str(roots.ensure_base(release)) for release in dict.fromkeys(debian)}
            roots.ensure_proxy_tools()
        except RuntimeError as exc:
            raise TestbedError(str(exc)) from exc

    state = _plan(directory, hosts, net, ifnames, lowers, debian, non_members)
    state["session_env"] = dict(session_env or {})
    directory.mkdir(parents=True, exist_ok=True)
    write_state(state)  # from here on `down` can undo whatever was made
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
    return testbed_from_state(state)


def _checked(
    directory: Path, hosts: int, subnet: str, ifnames: Sequence[str], non_members: int, install: bool
) -> ipaddress.IPv4Network:
    """The subnet to use, after refusing what `up` cannot do (not root, bad names, no room, a directory in use)."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces, bridges, bind mounts)")
    if hosts < 1:
        raise TestbedError(f"--hosts must be at least 1, not {hosts}")
    if not ifnames or any(len(n) > 15 or n == "lo" or "/" in n or " " in n for n in ifnames):
        raise TestbedError(f"bad interface names {list(ifnames)!r}: 1 to 15 characters each, not lo")
    if subnet == "auto":
        ensure_tools(install)
        subnet = subnets.free_subnet()
    try:
        net = ipaddress.IPv4Network(subnet, strict=False)
    except ValueError as exc:
        raise TestbedError(f"bad subnet {subnet!r}: {exc}") from exc
    if net.num_addresses < 10 + hosts + 2:
        raise TestbedError(f"subnet {net} is too small for {hosts} hosts (addresses .{10 + 1}..)")
    base = links.NON_MEMBER_BASE
    if non_members < 0 or (non_members and net.num_addresses < base + non_members + 2):
        raise TestbedError(f"--non-members {non_members}: subnet {net} has no room for them (addresses .{base + 1}..)")
    if read_state(directory) is not None:
        raise TestbedError(f"a testbed already exists in {directory}: `python -m testbed down --dir {directory}`")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise TestbedError(f"{directory} exists and is not an empty directory: `down` would remove it whole")
    return net


def _plan(
    directory: Path,
    hosts: int,
    net: ipaddress.IPv4Network,
    ifnames: Sequence[str],
    lowers: Mapping[str, str],
    debian: Sequence[str],
    non_members: int,
) -> dict[str, Any]:
    """The testbed's record before anything is made: names, addresses, and the empty lists of what will be.

    ``lowers``: the cached Debian root of each release in ``debian`` (rootfs hosts), or empty."""
    suffix = name_suffix(directory)
    releases = [debian[(i - 1) % len(debian)] for i in range(1, hosts + 1)]
    host_list = [
        {
            "name": f"tb{i}",
            "address": str(net.network_address + 10 + i),
            "interface": ifnames[(i - 1) % len(ifnames)],
            "namespace": f"ugro-tb{i}-{suffix}",
            "veth": f"ugv{i}-{suffix}",
            **({"debian": releases[i - 1], "lower": lowers[releases[i - 1]]} if lowers else {}),
        }
        for i in range(1, hosts + 1)
    ]
    strangers = [
        {
            "name": f"nm{i}",
            "address": str(net.network_address + links.NON_MEMBER_BASE + i),
            "namespace": f"ugro-nm{i}-{suffix}",
            "veth": f"ugn{i}-{suffix}",
        }
        for i in range(1, non_members + 1)
    ]
    for host in [*host_list, *strangers]:
        if netns_exists(host["namespace"]) or link_exists(host["veth"]):
            raise TestbedError(
                f"{host['namespace']} or {host['veth']} already exists: a testbed left over in {directory}?"
            )
    base = lowers[debian[0]] if lowers else ""
    outside = subnets.outside_network(net)
    return {
        "version": 1,
        "dir": str(directory),
        "suffix": suffix,
        "subnet": str(net),
        "bridge": f"ugbr-{suffix}",
        "bridge_address": str(net.network_address + 1),
        "control_path_dir": _control_path_dir(directory, suffix),
        "hosts": host_list,
        "non_members": strangers,
        "session_env": {},
        "namespaces": [],
        "links": [],
        "mounts": [],
        "processes": [],
        "complete": False,
        "rootfs": base,
        "outside_address": str(outside.network_address + 1) if base else "",
        "outside_subnet": str(outside) if base else "",
    }


def _control_path_dir(directory: Path, suffix: str) -> str:
    """Where Ansible keeps its ssh ControlMaster sockets: per testbed, so a later testbed on the same
    addresses never reuses a stale master of an earlier one; short enough for a unix socket path."""
    inside = directory / "cp"
    return str(inside) if len(str(inside)) <= 48 else f"/tmp/ugro-testbed-cp-{suffix}"


def _bring_up(state: dict[str, Any], timeout_s: float) -> None:
    """Key, bridge (and services), tmpfs, each host's namespace and files, their sandboxes; then the inventory."""
    directory = Path(state["dir"])
    key = directory / "id_ed25519"
    run(tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", "ugro-testbed", "-f", str(key))
    pubkey = (directory / "id_ed25519.pub").read_text()

    links.add_bridge(state)
    if state["rootfs"]:
        services.start_services(state)
    _mount_tmpfs(state)
    opt_binds: dict[str, list[str]] = {}
    for host in state["hosts"]:
        links.add_host(state, host, host["interface"])
        if state["rootfs"]:
            links.add_outside_route(state, host)
            sandbox.prepare_rootfs_host(state, host, pubkey)
            continue
        paths = sandbox.host_paths(directory, host["name"])
        opt_binds[host["name"]] = sandbox.prepare_host_dirs(paths, host, state["hosts"], pubkey,
                                                            state.get("session_env"))  # fmt: skip
    for stranger in state.get("non_members", []):
        links.add_non_member(state, stranger)

    popens: dict[str, subprocess.Popen[bytes]] = {}
    inits: dict[str, int] = {}
    for host in state["hosts"]:
        popens[host["name"]], inits[host["name"]] = _start_host(state, host, opt_binds.get(host["name"], []), timeout_s)

    sshd.wait_for_sshd(state, popens, timeout_s)
    for host in state["hosts"]:
        for pid in procs.children(inits[host["name"]]):
            record_process(state, pid, "sshd", host["name"])

    inventory.write(state)
    state["complete"] = True
    write_state(state)


def _mount_tmpfs(state: dict[str, Any]) -> None:
    """The testbed's own tmpfs, for the hosts' private /etc and /run (sandbox.ON_TMPFS)."""
    tmpfs = Path(state["dir"]) / "tmpfs"
    tmpfs.mkdir(mode=0o700)
    state["mounts"].append(str(tmpfs))
    write_state(state)
    size_mib = max(64, 32 * len(state["hosts"]))  # a limit, not an allocation: ~4 MiB per host is used
    run("mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", f"ugro-testbed-{state['suffix']}", str(tmpfs))


def _start_host(
    state: dict[str, Any], host: dict[str, Any], opt_binds: list[str], timeout_s: float
) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``host``'s sandbox (bwrap, then sshd inside); its process and the global pid of its init, both
    recorded."""
    directory = Path(state["dir"])
    read_fd, write_fd = os.pipe()
    try:
        with open(directory / host["name"] / "sshd.log", "wb") as log:
            argv = (
                sandbox.rootfs_bwrap_argv(state, host, write_fd)
                if state["rootfs"]
                else sandbox.bwrap_argv(host, sandbox.host_paths(directory, host["name"]), opt_binds, write_fd)
            )
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(write_fd,), env=sandbox.SANDBOX_ENV,
                start_new_session=True,  # outlives `make testbed-up` and its terminal
            )  # fmt: skip
        # `ip netns exec` execs bwrap in place, so this pid is bwrap's own.
        record_process(state, popen.pid, "bwrap", host["name"])
        os.close(write_fd)
        write_fd = -1
        info = sandbox.read_info(read_fd, timeout_s)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    init = int(info["child-pid"])
    record_process(state, init, "init", host["name"])
    return popen, init
