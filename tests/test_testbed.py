"""The testbed (testbed/cluster.py and its modules): real hosts on this machine, reached by Ansible over real SSH.

Needs root and `ip netns`; `up` apt-installs bubblewrap/openssh when they are missing.
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO

from testbed import cluster as tb
from testbed import procs, sshd

VENV_BIN = REPO / ".venv" / "bin"
# Subnets of their own, so `make test` runs beside a `make testbed-up` (10.213.7.0/24).
SCRATCH_SUBNET = "10.213.9.0/24"


# Root and network namespaces (skipped without them, failed instead in CI): every test here builds test hosts.
pytestmark = pytest.mark.usefixtures("netns")


def ansible(bed: Any, pattern: str, args: str, module: str = "ansible.builtin.command") -> dict[str, tuple[str, str]]:
    """Run the real `ansible` CLI over SSH; {host: (status, output)} from its one-host-per-block output."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_DEPRECATION_WARNINGS": "False"}
    proc = subprocess.run(
        [str(VENV_BIN / "ansible"), "-i", str(bed.inventory), pattern, "-m", module, "-a", args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    blocks = re.findall(r"^(\S+) \| (\w+)(?: \| rc=\d+)? >>\n(.*?)(?=^\S+ \| \w+|\Z)", proc.stdout, re.M | re.S)
    results = {host: (status, out.strip()) for host, status, out in blocks}
    assert proc.returncode == 0 and results, f"ansible failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return results


def netns_exec(namespace: str, *cmd: str, timeout: float = 30) -> str:
    proc = subprocess.run(["ip", "netns", "exec", namespace, *cmd], capture_output=True, text=True,
                          timeout=timeout, check=True)  # fmt: skip
    return proc.stdout


def leftovers(state: dict[str, Any]) -> list[str]:
    """What of a testbed's recorded namespaces, links, mounts and processes still exists."""
    found = [f"netns {ns}" for ns in state["namespaces"] if Path("/run/netns", ns).exists()]
    found += [
        f"link {link}"
        for link in state["links"]
        if subprocess.run(["ip", "link", "show", "dev", link], capture_output=True, check=False).returncode == 0
    ]
    found += [f"mount {mount}" for mount in state["mounts"] if os.path.ismount(mount)]
    for proc in state["processes"]:
        try:
            stat = Path(f"/proc/{proc['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if stat[0] not in ("Z", "X") and int(stat[19]) == proc["starttime"]:
            found.append(f"process {proc['pid']} ({proc['role']} of {proc['host']})")
    return found


def test_ansible_reaches_every_host_over_ssh(testbed: Any) -> None:
    results = ansible(testbed, "ugro_cluster", "hostname")
    assert {host: out for host, (_, out) in results.items()} == {"tb1": "tb1", "tb2": "tb2", "tb3": "tb3"}


def test_inventory_has_the_cluster_variables(testbed: Any) -> None:
    proc = subprocess.run([str(VENV_BIN / "ansible-inventory"), "-i", str(testbed.inventory), "--host", "tb2"],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")})  # fmt: skip
    host = yaml.safe_load(proc.stdout)
    tb2 = str(ipaddress.ip_network(testbed.subnet)[12])  # 10.213.8.12 on the session's default subnet
    assert host["ansible_host"] == host["ugro_cluster_address"] == tb2
    assert host["ansible_user"] == "root"
    assert Path(host["ansible_ssh_private_key_file"]) == testbed.key
    assert host["ansible_python_interpreter"] == host["ugro_python"] == str(REPO / ".venv" / "bin" / "python")
    assert host["ugro_code_dir"] == "/opt/ugro"
    assert host["testbed_interface"] == "enp5s0"
    # The cluster defaults are role defaults (role ugro, which every playbook loads), not inventory variables.
    assert "ugro_rendezvous_port" not in host and not (testbed.inventory.parent / "group_vars").exists()
    assert tb.Testbed.load(testbed.dir) == testbed


def test_each_host_interface_holds_its_address(testbed: Any) -> None:
    assert [h.interface for h in testbed.hosts] == ["eth0", "enp5s0", "ens3"]
    for host in testbed.hosts:
        addrs = netns_exec(host.namespace, "ip", "-o", "-4", "addr", "show")
        assert re.search(rf"^\d+: {host.interface}\s+inet {re.escape(host.address)}/24 ", addrs, re.M), addrs
        assert re.search(r"^\d+: lo\s+inet 127\.0\.0\.1/8", addrs, re.M), addrs
        # No way out: no default route, only the testbed's own subnet.
        assert netns_exec(host.namespace, "ip", "-4", "route", "show", "default").strip() == ""


def test_hosts_resolve_each_others_names(testbed: Any) -> None:
    status, out = ansible(testbed, "tb1", "getent hosts tb3")["tb1"]
    assert status == "CHANGED"
    assert out.split() == [testbed.host("tb3").address, "tb3"]


def test_a_host_reaches_another_hosts_tcp_port(testbed: Any) -> None:
    tb2 = testbed.host("tb2")
    listener = subprocess.Popen(
        ["ip", "netns", "exec", tb2.namespace, sys.executable, "-c",
         "import socket, sys\n"
         f"srv = socket.create_server(({tb2.address!r}, 29500)); srv.settimeout(60)\n"
         "print('ready', flush=True)\n"
         "conn, peer = srv.accept(); conn.sendall(('pong from ' + peer[0]).encode()); conn.close()"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        client = (
            f'{VENV_BIN / "python"} -c "import socket; '
            f"print(socket.create_connection(('tb2', 29500), timeout=10).recv(64).decode())\""
        )
        _, out = ansible(testbed, "tb1", client)["tb1"]
        assert out == f"pong from {testbed.host('tb1').address}"
        assert listener.wait(timeout=10) == 0
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()


def test_up_refuses_a_subnet_in_use(testbed: Any, tmp_path: Path) -> None:
    with pytest.raises(tb.TestbedError, match="overlaps"):
        tb.up(tmp_path / "clash", hosts=1, subnet=testbed.subnet)
    assert not (tmp_path / "clash").exists()


def test_up_takes_down_a_testbed_an_interrupted_run_left(tmp_path: Path) -> None:
    """A run killed mid-test (Ctrl-C, a session's end) leaves its bridge on the subnet: the next `up` reclaims it."""
    old = tb.up(tmp_path / "old", hosts=1, subnet=SCRATCH_SUBNET)
    old_state = yaml.safe_load((old.dir / "state.json").read_text())
    for proc in old_state["processes"]:  # what being killed does: every process it started is gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc["pid"], signal.SIGKILL)
    # Gone once the kernel has ended them: a SIGKILLed process can run on for a moment (on a loaded machine one was
    # still there when `up` looked, and `up` rightly left the testbed alone).
    deadline = time.monotonic() + 30
    while any(procs.is_ours(proc) for proc in old_state["processes"]):
        assert time.monotonic() < deadline, "a SIGKILLed process of the old testbed still runs after 30 s"
        time.sleep(0.05)
    assert tb.reclaim_dead(ipaddress.IPv4Network("10.213.250.0/24")) == []  # only what overlaps the subnet asked for
    new = tb.up(tmp_path / "new", hosts=1, subnet=SCRATCH_SUBNET)
    try:
        assert leftovers(old_state) == []
        assert not old.dir.exists()
        assert ansible(new, "tb1", "hostname") == {"tb1": ("CHANGED", "tb1")}
    finally:
        tb.down(new.dir)


def test_down_removes_every_namespace_link_and_process(tmp_path: Path) -> None:
    directory = tmp_path / "bed"
    bed = tb.up(directory, hosts=2, subnet=SCRATCH_SUBNET, ifnames=["ens3"])
    state = yaml.safe_load((directory / "state.json").read_text())
    assert [h.interface for h in bed.hosts] == ["ens3", "ens3"]
    # Something a test would leave running on a host: it must go down with the host.
    subprocess.run(["ssh", "-F", str(bed.ssh_config), "tb1", "nohup sleep 300 >/dev/null 2>&1 &"],
                   check=True, timeout=30)  # fmt: skip
    host_pidns = {os.readlink(f"/proc/{p['pid']}/ns/pid") for p in state["processes"] if p["role"] == "init"}
    assert len(host_pidns) == 2

    assert tb.down(directory) is True
    assert leftovers(state) == []
    assert not directory.exists()
    survivors = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and os.readlink(entry / "ns" / "pid") in host_pidns
                and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # zombies are dead
            ):
                survivors.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass  # gone meanwhile
    assert survivors == [], "processes of the hosts survived down"
    suffix = state["suffix"]
    assert suffix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert suffix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tb.down(directory) is False  # twice is fine


def test_failed_up_removes_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def sshd_never_answers(state: dict[str, Any], popens: Any, timeout_s: float) -> None:
        seen.update(copy.deepcopy(state))
        raise tb.TestbedError("sshd did not accept connections (injected)")

    monkeypatch.setattr(sshd, "wait_for_sshd", sshd_never_answers)
    with pytest.raises(tb.TestbedError, match=r"everything made was removed.*injected"):
        tb.up(tmp_path / "bed", hosts=2, subnet=SCRATCH_SUBNET)
    assert len(seen["namespaces"]) == 2 and len(seen["processes"]) == 4  # it got as far as the sshds
    assert leftovers(seen) == []
    assert not (tmp_path / "bed").exists()
