#!/usr/bin/python
"""Ansible module: every fact ugro needs about a host, gathered in one place.

Every role, playbook and preflight check reads ``ansible_facts.ugro_host`` from this module instead
of detecting things itself. Keys (each subset of O(gather_subset); a subset whose option is not given
is left out under C(all)):

=================  =========  ==================================================================
key                subset     what
=================  =========  ==================================================================
host, hostname     always     O(host) (the inventory name) and the host's own hostname
interfaces         network    interface -> its IPv4 addresses (psutil.net_if_addrs), lo included
cluster            network    {address, interface, prefix, subnet, why}: who holds O(cluster_address)
gpu                gpu        {gpus: [{index, name, memory_mib, memory_bytes, compute_cap}], count,
                              driver, smi, why, pci_devices}: nvidia-smi --query-gpu, the only GPU
                              detection; compute_cap "8.6" (null from an nvidia-smi without the field)
python             versions   {executable, exists, version, why}: the job's Python (O(python))
versions           versions   python, torch, cuda runtime (torch's CUDA), nccl, transformers, peft,
                              unsloth: from that Python's site-packages metadata, torch not imported
code               code       {path, hash, why}: tree hash of O(code_dir) (module_utils ugro_codetree)
running_job        job        {job, pgid} of the job this host runs now (runs/active-job), or null
job                job        with O(job_id): {job, host, run_dir, state, exit_code, pids, ...}
disk               disk       {path, measured_at, free_bytes, total_bytes} at O(disk_path)
memory             memory     {total_bytes, available_bytes} (psutil.virtual_memory)
port_range         ports      the ephemeral port range, "32768-60999"
range_listeners    ports      [{port, address, process}]: TCP sockets listening inside that range on more than
                              loopback, other than the job's (role firewall closes the range to non-members)
env_file           env        {path, exists, error, ifnames} of O(env_file) (NCCL/GLOO_SOCKET_IFNAME)
profile_exists     env        whether O(profile_file) exists
resolve            resolve    name -> {address, error}: what each of O(names) resolves to here
time               clock      the host's clock, seconds since the epoch
firewall           firewall   {nftables, ufw, why}: the live input rules of the nftables table O(firewall_table)
                              ({table, present, rules, error}) and of ufw ({active, default_incoming, ipv6 (its
                              IPV6 setting), rules, error}); each rule {action: accept|reject|drop, sources: [CIDR]
                              or null (any), ports: [[low, high]] or null (any), family: ipv4|ipv6 or null
                              (both)}, in the order they match; as root, or through `sudo -n` (never part of C(all))
kernel             kernel     {running, installed, newest, headers, modules, loaded, secure_boot, driver_packages}:
                              the kernels (oldest first), each one's headers and NVIDIA module {path, version,
                              error}, the module loaded now, Secure Boot {state, mok_key, mok_enrolled} and the
                              driver's installed packages [{name, version, held, sources, from_repository}]
                              (O(driver_repository); module_utils
                              ugro_kernel; never part of C(all))
checkpoint         checkpoint with O(job_id): {name, step, path} of the newest checkpoint of the run here
                              that passes its sha256 manifest, or null (never part of C(all): it
                              reads every checkpoint file)
=================  =========  ==================================================================
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_host_facts
short_description: Gather the host facts every ugro role and check reads
description:
  - Returns C(ansible_facts.ugro_host) with the host's cluster interface, IPv4 addresses, NVIDIA GPUs
    (name, memory, compute capability, driver), the job Python's package versions, the code tree hash, free
    disk, memory, ephemeral port range, and the state of a job (its recorded processes, alive or not).
  - The one place ugro detects GPUs (C(nvidia-smi --query-gpu)) and the interface holding the cluster
    address (psutil); where there is no GPU, C(gpu.why) says why (no nvidia-smi, its error, hung).
  - Package versions are read from the metadata of the job Python's site-packages without importing
    torch; the job Python only reports its version and path.
  - Needs psutil in the Python that runs the module (Debian/Ubuntu package C(python3-psutil)); fails
    naming the host and the fix without it.
  - Never changes anything.
options:
  host:
    description: Inventory name of the host (C(inventory_hostname)); names the host in errors and its
      directory of a job's run (C(runs/<job>/hosts/<host>)). Defaults to the hostname.
    type: str
  gather_subset:
    description:
      - What to gather. C(all) is every subset whose option is given (C(versions) needs O(python),
        C(code) and C(job) need O(code_dir), C(disk) needs O(disk_path), C(env) needs O(env_file),
        C(resolve) needs O(names), C(files) needs O(paths)); a subset named explicitly without its option fails.
    type: list
    elements: str
    default: [all]
    choices: [all, network, gpu, versions, code, job, disk, memory, ports, env, resolve, clock, checkpoint, firewall,
      files, kernel]
  cluster_address:
    description: The host's IPv4 cluster address; C(cluster) reports the interface holding it.
    type: str
  cluster_interface_required:
    description: Fail, naming the host, the address and its IPv4 addresses, when no interface holds
      O(cluster_address).
    type: bool
    default: false
  python:
    description: The job's Python (a virtual environment's C(bin/python)); its packages are C(versions).
    type: path
  code_dir:
    description: The code directory on the host; C(code) hashes it, C(job) reads its C(runs/).
    type: path
  job_id:
    description: A job id (C(default-20261121-190000)); C(job) is the state of C(<code_dir>/runs/<job_id>).
    type: str
  main_host:
    description: Whether this host keeps the run's metrics; C(job) then adds the last step, loss,
      tokens/s, ETA and the run's state and error.
    type: bool
    default: false
  follow_poll_s:
    description: Greater than 0 where the controller that follows the run asks, every that many seconds; C(job)
      then records when it asked (C(runs/<job_id>/hosts/<host>/followed.json)), so that the ranks know whether a
      controller will name who is left after a lost host or they agree on it themselves.
    type: float
    default: 0.0
  disk_path:
    description: Where free disk space is measured (its nearest existing parent when it does not exist).
    type: path
  env_file:
    description: The NCCL/gloo environment file; C(env_file) reports the interface names it sets.
    type: path
  profile_file:
    description: The memory profile; C(profile_exists) says whether it exists.
    type: path
  names:
    description: Host names to resolve (IPv4), as torchrun on this host would.
    type: list
    elements: str
    default: []
  paths:
    description: Paths for C(files) to look at (whether each exists, is a regular file and is executable), keyed in
      the facts exactly as given.
    type: list
    elements: str
    default: []
  nvidia_smi:
    description: The nvidia-smi to ask; by default the one on C(PATH), C(/usr/local/bin) or C(/usr/bin).
    type: path
  firewall_table:
    description: The nftables table (family C(inet)) of role C(firewall); C(firewall) reads its rules.
    type: str
    default: ugro
  driver_repository:
    description: The URL of the driver's apt repository (role nvidia_repository's); C(kernel) says of each
      installed driver package whether its installed version comes from there (C(from_repository)).
    type: str
  timeout_s:
    description: Seconds before C(nvidia-smi), the job Python or a name lookup counts as hung.
    type: float
    default: 15
author: ugro
"""

EXAMPLES = r"""
- name: Find the interface that holds the cluster address
  ugro_host_facts:
    host: "{{ inventory_hostname }}"
    gather_subset: [network]
    cluster_address: "{{ ugro_cluster_address }}"
    cluster_interface_required: true

- name: Count the GPUs
  ugro_host_facts:
    host: "{{ inventory_hostname }}"
    gather_subset: [gpu]

- name: Use them
  ansible.builtin.debug:
    msg: "{{ ansible_facts.ugro_host.cluster.interface }}, {{ ansible_facts.ugro_host.gpu.count }} GPU(s)"
"""

RETURN = r"""
ansible_facts:
  description: The facts, under C(ugro_host); see the module's docstring for every key.
  returned: always
  type: dict
  contains:
    ugro_host:
      description: This host's facts.
      type: dict
      returned: always
      sample:
        host: node4070
        hostname: node4070
        interfaces: {lo: [127.0.0.1], enp5s0: [192.168.1.12]}
        cluster: {address: 192.168.1.12, interface: enp5s0, prefix: 24, subnet: 192.168.1.0/24, why: null}
        gpu:
          gpus: [{index: 0, name: NVIDIA GeForce RTX 4070, memory_mib: 8188, memory_bytes: 8585740288,
                  compute_cap: "8.9"}]
          count: 1
          driver: "580.173.02"
          smi: ok
          why: null
          pci_devices: ["0000:01:00.0"]
        versions: {python: 3.12.3, torch: 2.13.0, cuda runtime: "13.0", nccl: 2.29.7, transformers: 5.17.0,
                   peft: 0.21.2, unsloth: 2026.10.1}
        job: {job: default-20261121-190000, host: node4070, state: running, exit_code: null,
              pids: {launcher: 4242, worker-rank1: 4300}, attempt: 0, ranks: [1], failures: []}
        files: {/opt/ugro/.venv/bin/python: {exists: true, regular: true, executable: true}}
"""

import concurrent.futures
import csv
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ugro_checkpoints import newest_intact
from ansible.module_utils.ugro_codetree import current_hash
from ansible.module_utils.ugro_jobstate import HAS_PSUTIL, JOB_ID, psutil_missing, running_job, status
from ansible.module_utils.ugro_kernel import facts as kernel_facts

if HAS_PSUTIL:
    import psutil

SUBSETS = (
    "network", "gpu", "versions", "code", "job", "disk", "memory", "ports", "env", "resolve", "clock", "checkpoint",
    "firewall", "files", "kernel",
)  # fmt: skip
# The option each subset needs; subsets not listed need none.
NEEDS = {"versions": "python", "code": "code_dir", "job": "code_dir", "disk": "disk_path", "env": "env_file",
         "resolve": "names", "checkpoint": "job_id", "files": "paths"}  # fmt: skip
# Subsets that C(all) leaves out: slow, or needing root.
EXPLICIT_ONLY = ("checkpoint", "firewall", "kernel")
# Distribution name -> version label (the labels preflight compares across hosts).
PACKAGES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "unsloth": "unsloth"}
NCCL_DISTS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Where nvidia-smi lives when the module's PATH is short (the driver packages put it in /usr/bin).
SMI_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/bin", "/usr/bin", "/bin"])
# What the job Python reports about itself: its version and where it finds packages.
PYTHON_SELF = "import json, platform, sys; print(json.dumps([platform.python_version(), sys.path]))"


def network(cluster_address: str | None) -> dict[str, Any]:
    interfaces: dict[str, list[str]] = {}
    holders: list[dict[str, Any]] = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for addr in addrs:
            if addr.family != socket.AF_INET:
                continue
            interfaces.setdefault(name, []).append(addr.address)
            if addr.address == cluster_address:
                iface = ipaddress.IPv4Interface(f"{addr.address}/{addr.netmask or '255.255.255.255'}")
                holders.append({"interface": name, "prefix": iface.network.prefixlen, "subnet": str(iface.network)})
    found: dict[str, Any] = {"interfaces": interfaces}
    if cluster_address is not None:
        # A host holding the address twice (lo and eth0): the real interface wins.
        holders.sort(key=lambda h: h["interface"] == "lo")
        held = holders[0] if holders else {"interface": None, "prefix": None, "subnet": None}
        others = ", ".join(f"{n} {'/'.join(a)}" for n, a in interfaces.items() if n != "lo") or "none"
        why = None if holders else f"no interface holds {cluster_address} (IPv4 addresses here: {others})"
        found["cluster"] = {"address": cluster_address, **held, "why": why}
    return found


def files(paths: list[str]) -> dict[str, dict[str, bool]]:
    """Whether each path exists, is a regular file and is executable here (what a launch is about to run)."""
    found: dict[str, dict[str, bool]] = {}
    for path in paths:
        target = Path(path)
        found[path] = {"exists": target.exists(), "regular": target.is_file(), "executable": os.access(target, os.X_OK)}
    return found


def _pci_gpus() -> list[str]:
    """PCI display devices of vendor 10de (NVIDIA), as lspci lists them: a GPU even without its driver."""
    root = Path("/sys/bus/pci/devices")
    found = []
    for device in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            vendor = (device / "vendor").read_text().strip()
            klass = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            found.append(device.name)
    return found


def gpu(nvidia_smi: str | None, timeout_s: float) -> dict[str, Any]:
    """nvidia-smi's GPUs, or why there are none. smi: ok | missing | no devices | failed | hung."""
    result: dict[str, Any] = {"gpus": [], "count": 0, "driver": None, "pci_devices": _pci_gpus()}
    smi = shutil.which(nvidia_smi or "nvidia-smi", path=SMI_PATH)
    if smi is None:
        return {**result, "smi": "missing", "why": f"no nvidia-smi{f' at {nvidia_smi}' if nvidia_smi else ''}"}
    fields = "index,name,memory.total,driver_version"
    try:
        out = _smi_query(smi, fields + ",compute_cap", timeout_s)
        if out.returncode != 0 and "compute_cap" in out.stderr + out.stdout:  # a driver older than the field
            out = _smi_query(smi, fields, timeout_s)
    except subprocess.TimeoutExpired:
        return {**result, "smi": "hung", "why": f"nvidia-smi hung for {timeout_s:g} s"}
    except OSError as exc:
        return {**result, "smi": "failed", "why": f"{smi}: {exc.strerror or exc}"}
    said = (out.stderr.strip() or out.stdout.strip())[:300]
    if "No devices were found" in said:
        return {**result, "smi": "no devices", "why": f"nvidia-smi: {said}"}
    if out.returncode != 0:
        return {**result, "smi": "failed", "why": f"nvidia-smi failed (rc {out.returncode}): {said or 'no output'}"}
    gpus = []
    for row in csv.reader(out.stdout.splitlines(), skipinitialspace=True):
        if len(row) not in (4, 5) or not row[0].strip().isdigit():
            continue
        index, name, memory, driver, *rest = (part.strip() for part in row)
        mib = int(float(memory)) if re.fullmatch(r"[0-9.]+", memory) else 0
        cap = rest[0] if rest and re.fullmatch(r"[0-9]+\.[0-9]+", rest[0]) else None
        gpus.append(
            {"index": int(index), "name": name, "memory_mib": mib, "memory_bytes": mib << 20, "compute_cap": cap}
        )
        result["driver"] = driver
    if not gpus:
        return {**result, "smi": "no devices", "why": f"nvidia-smi lists no GPU ({said or 'no output'})"}
    return {**result, "gpus": gpus, "count": len(gpus), "smi": "ok", "why": None}


def _smi_query(smi: str, fields: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    query = [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    return subprocess.run(query, capture_output=True, text=True, timeout=timeout_s, check=False)


def _torch_cuda(paths: list[str]) -> str | None:
    """torch.version.cuda without importing torch: torch/version.py of the first torch on the path."""
    for entry in paths:
        version_py = Path(entry) / "torch" / "version.py"
        if version_py.is_file():
            try:
                text = version_py.read_text()
            except OSError:
                return None
            match = re.search(r"^cuda(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            return match[1] if match else None
    return None


def versions(python: str, timeout_s: float) -> dict[str, Any]:
    import importlib.metadata

    labels = ["python", *PACKAGES.values(), "cuda runtime", "nccl"]
    found: dict[str, Any] = {"versions": dict.fromkeys(labels)}
    about: dict[str, Any] = {"executable": python, "exists": os.access(python, os.X_OK), "version": None, "why": None}
    found["python"] = about
    if not about["exists"]:
        about["why"] = f"no executable Python at {python}"
        return found
    try:
        out = subprocess.run([python, "-c", PYTHON_SELF], capture_output=True, text=True, timeout=timeout_s, check=True)
        version, path = json.loads(out.stdout)
    except subprocess.TimeoutExpired:
        about["why"] = f"{python} hung for {timeout_s:g} s"
        return found
    except (OSError, subprocess.CalledProcessError, ValueError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        about["why"] = f"{python} does not run: {detail.strip()[-300:]}"
        return found
    paths = [p for p in path if p and Path(p).is_dir()]
    dists: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=paths):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        dists.setdefault(name, dist.version)  # the first on the path wins, as import would
    about["version"] = version
    found["versions"].update(
        {label: dists.get(name) for name, label in PACKAGES.items()},
        python=version,
        nccl=next((dists[d] for d in NCCL_DISTS if d in dists), None),
    )
    found["versions"]["cuda runtime"] = _torch_cuda(paths)
    return found


def disk(path: Path) -> dict[str, Any]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = psutil.disk_usage(str(probe))
    return {"path": str(path), "measured_at": str(probe), "free_bytes": usage.free, "total_bytes": usage.total}


def range_listeners(ports: str | None) -> list[dict[str, Any]]:
    """The TCP sockets listening inside the ephemeral range ``ports`` on more than loopback: services of the host
    (NFS's rpc ports, a container's published port, a development server) that role firewall's reset of the range
    cuts off from every device outside the cluster. A training job's own (torchrun, its ranks) are left out."""
    low, _, high = (ports or "").partition("-")
    if not low:
        return []
    found: dict[int, dict[str, Any]] = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or not int(low) <= conn.laddr.port <= int(high or low):
            continue
        if ipaddress.ip_address(conn.laddr.ip.split("%")[0]).is_loopback:
            continue
        process = "a process of another user"
        if conn.pid is not None:
            try:
                proc = psutil.Process(conn.pid)
                process, cmdline = proc.name(), " ".join(proc.cmdline())
            except psutil.Error:
                cmdline = ""
            if "train.worker" in cmdline or "torch.distributed.run" in cmdline or "train.launcher" in cmdline:
                continue
        found.setdefault(conn.laddr.port, {"port": conn.laddr.port, "address": conn.laddr.ip, "process": process})
    return sorted(found.values(), key=lambda entry: int(entry["port"]))


def port_range() -> str | None:
    """The ephemeral port range ("32768-60999"): where NCCL and gloo peers connect back to."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return None
    return f"{low}-{high}"


def env_file(path: Path) -> dict[str, Any]:
    """The interface names of an env file of KEY=VALUE lines (optionally `export`, quoted values)."""
    found: dict[str, Any] = {"path": str(path), "exists": path.is_file(), "error": None, "ifnames": {}}
    if not found["exists"]:
        return found
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return {**found, "error": str(exc)}
    for raw in text.splitlines():
        line = raw.strip().removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and key.strip() in IFNAME_VARS:
            found["ifnames"][key.strip()] = value.strip().strip("'\"")
    return found


def resolve(names: list[str], timeout_s: float) -> dict[str, Any]:
    """name -> first IPv4 address it resolves to here (what torchrun would use), or the error."""

    def one(name: str) -> dict[str, Any]:
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            return {"address": None, "error": str(exc)}
        return {"address": str(infos[0][4][0]) if infos else None, "error": None if infos else "no IPv4 address"}

    results: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(names)))
    futures = {name: pool.submit(one, name) for name in names}
    deadline = time.monotonic() + timeout_s
    for name, future in futures.items():
        try:
            results[name] = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            results[name] = {"address": None, "error": f"no answer within {timeout_s:g} s (DNS hangs?)"}
    pool.shutdown(wait=False, cancel_futures=True)
    return results


def _as_root(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a command that needs root: as is when root, else through `sudo -n` (never a password prompt)."""
    if os.geteuid() != 0 and shutil.which("sudo", path=SMI_PATH):
        argv = ["sudo", "-n", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)


def _nft_addresses(value: Any, sets: dict[str, list[Any]]) -> list[str] | None:
    """The IPv4 or IPv6 sources of an nft JSON match's right side: an address, a prefix, a range, a set; None if
    unknown."""
    if isinstance(value, str) and value.startswith("@"):
        return _nft_addresses({"set": sets.get(value[1:], [])}, sets)
    if isinstance(value, str):
        return [str(ipaddress.ip_network(value, strict=False))]
    if isinstance(value, dict) and "prefix" in value:
        return [str(ipaddress.ip_network(f"{value['prefix']['addr']}/{value['prefix']['len']}", strict=False))]
    if isinstance(value, dict) and "range" in value:
        low, high = (ipaddress.ip_address(a) for a in value["range"])
        return [str(net) for net in ipaddress.summarize_address_range(low, high)]
    if isinstance(value, dict) and "set" in value:
        found: list[str] = []
        for element in value["set"] if isinstance(value["set"], list) else [value["set"]]:
            more = _nft_addresses(
                element.get("elem", {}).get("val", element)
                if isinstance(element, dict) and "elem" in element
                else element,
                sets,
            )
            if more is None:
                return None
            found += more
        return found
    return None


def _nft_ports(value: Any) -> list[list[int]] | None:
    if isinstance(value, int):
        return [[value, value]]
    if isinstance(value, dict) and "range" in value:
        return [[int(value["range"][0]), int(value["range"][1])]]
    if isinstance(value, dict) and "set" in value:
        found: list[list[int]] = []
        for element in value["set"]:
            more = _nft_ports(element)
            if more is None:
                return None
            found += more
        return found
    return None


def nft_rules(listing: dict[str, Any]) -> list[dict[str, Any]]:
    """The input rules of an `nft -j list table` listing: {action, sources, ports, family}, in order.

    Only rules that match nothing but an IPv4 or IPv6 source, the address family and a TCP destination port (what role
    firewall writes) are kept; a rule that matches anything else (conntrack state, an interface) does not decide who
    reaches a port. ``family`` is "ipv4" or "ipv6" for a rule that matches one family only (`ip saddr`, `ip6 saddr`,
    `meta nfproto`), None for both. The rules of the table's other hooks (its output chain: which local accounts may
    connect out) are left out.
    """
    items = listing.get("nftables", [])
    sets = {i["set"]["name"]: i["set"].get("elem", []) for i in items if "set" in i}
    hooks = {i["chain"]["name"]: i["chain"].get("hook") for i in items if "chain" in i}
    rules: list[dict[str, Any]] = []
    for item in items:
        rule = item.get("rule")
        if not rule or hooks.get(rule.get("chain"), "input") not in ("input", None):
            continue
        action = next((k for e in rule["expr"] for k in ("accept", "reject", "drop") if k in e), None)
        found: dict[str, Any] = {"action": action, "sources": None, "ports": None, "family": None}
        known = action is not None
        for expr in rule["expr"]:
            match = expr.get("match")
            if match is None:
                continue
            left = match.get("left", {}).get("payload", {})
            field = (left.get("protocol"), left.get("field"))
            if field in (("ip", "saddr"), ("ip6", "saddr")) and match.get("op") in ("==", "in"):
                found["sources"] = _nft_addresses(match["right"], sets)
                found["family"] = "ipv4" if field[0] == "ip" else "ipv6"
                known = known and found["sources"] is not None
            elif field == ("tcp", "dport") and match.get("op") in ("==", "in"):
                found["ports"] = _nft_ports(match["right"])
                known = known and found["ports"] is not None
            elif match.get("left", {}).get("meta", {}).get("key") == "nfproto" and match.get("op") in ("==", "in"):
                family = {"ipv4": "ipv4", "ipv6": "ipv6"}.get(str(match.get("right")))
                known = known and family is not None
                found["family"] = family
            else:
                known = False
        if known:
            rules.append(found)
    return rules


def _ufw_ports(spec: str) -> list[list[int]] | None:
    """ufw's `To` column: "29500/tcp", "32768:60999/tcp", "9840,29500/tcp", "Anywhere"; None for any port."""
    spec = spec.split("/")[0]
    if spec in ("Anywhere", "any"):
        return None
    ports = []
    for part in spec.split(","):
        low, _, high = part.partition(":")
        if not low.isdigit() or (high and not high.isdigit()):
            return []  # an application profile or an address: not a port rule this check knows
        ports.append([int(low), int(high or low)])
    return ports


def _ufw_source(source: str) -> tuple[list[str] | None, str | None] | None:
    """ufw's `From` column: (sources or None for anywhere, the family where the column names one); None if unknown."""
    if source.startswith("Anywhere"):
        return None, "ipv6" if "(v6)" in source else None
    try:
        net = ipaddress.ip_network(source.split()[0], strict=False)
    except ValueError:
        return None  # an application profile, an interface: not a source this check knows
    return [str(net)], f"ipv{net.version}"


def ufw_rules(status: str) -> dict[str, Any]:
    """`ufw status verbose`: {active, default_incoming, rules: [{action, sources, ports, family}]} (TCP rules).

    ufw lists its IPv4 rules, then its IPv6 ones ("(v6)", or an IPv6 source): ``family`` is "ipv4" or "ipv6", and
    each family's rules are in the order they match."""
    default = re.search(r"(?m)^Default: (\w+) \(incoming\)", status)
    found: dict[str, Any] = {
        "active": "Status: active" in status,
        "default_incoming": default[1] if default else None,
        "rules": [],
    }
    rule = re.compile(r"^(\S+(?: \(v6\))?)\s+(ALLOW|DENY|REJECT|LIMIT)(?: IN)?\s+(.+?)\s*(?:#.*)?$")
    for line in status.splitlines():
        match = rule.match(line.strip())
        if match is None or "/udp" in match[1]:
            continue
        source = _ufw_source(match[3].strip())
        if source is None:
            continue
        action = {"ALLOW": "accept", "LIMIT": "accept", "REJECT": "reject", "DENY": "drop"}[match[2]]
        family = "ipv6" if "(v6)" in match[1] else source[1] or "ipv4"
        found["rules"].append({"action": action, "sources": source[0], "ports": _ufw_ports(match[1]), "family": family})
    return found


def ufw_ipv6(defaults: Path = Path("/etc/default/ufw")) -> bool | None:
    """Whether ufw applies its rules to IPv6 (IPV6=yes in its defaults); with IPV6=no it drops IPv6, loopback's aside.
    None where the file cannot be read."""
    try:
        setting = re.findall(r"(?m)^\s*IPV6\s*=\s*[\"']?(\w+)", defaults.read_text())
    except OSError:
        return None
    return setting[-1].lower() == "yes" if setting else None


def firewall(table: str, timeout_s: float) -> dict[str, Any]:
    """The live firewall rules that decide who reaches the cluster ports: role firewall's nftables table, and ufw."""
    found: dict[str, Any] = {"nftables": None, "ufw": None, "why": None}
    why = []
    nft = shutil.which("nft", path=SMI_PATH + os.pathsep + "/usr/sbin:/sbin")
    if nft:
        try:
            out = _as_root([nft, "-j", "list", "table", "inet", table], timeout_s)
            if out.returncode == 0:
                found["nftables"] = {"table": table, "present": True, "rules": nft_rules(json.loads(out.stdout))}
            elif "No such file or directory" in out.stderr or "does not exist" in out.stderr:
                found["nftables"] = {"table": table, "present": False, "rules": []}
            else:
                why.append(f"nft list table inet {table}: {(out.stderr.strip() or out.stdout.strip())[:200]}")
        except (OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired) as exc:
            why.append(f"nft: {exc}")
    ufw = shutil.which("ufw", path=SMI_PATH + os.pathsep + "/usr/sbin:/sbin")
    if ufw:
        try:
            out = _as_root([ufw, "status", "verbose"], timeout_s)
            if out.returncode == 0:
                found["ufw"] = ufw_rules(out.stdout) | {"ipv6": ufw_ipv6()}
            else:
                why.append(f"ufw status: {(out.stderr.strip() or out.stdout.strip())[:200]}")
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            why.append(f"ufw: {exc}")
    found["why"] = "; ".join(why) or None
    return found


def gather(params: dict[str, Any], subsets: set[str]) -> dict[str, Any]:
    timeout_s = float(params["timeout_s"])
    facts: dict[str, Any] = {"host": params["host"], "hostname": socket.gethostname()}
    if "network" in subsets:
        facts.update(network(params["cluster_address"]))
    if "gpu" in subsets:
        facts["gpu"] = gpu(params["nvidia_smi"], timeout_s)
    if "versions" in subsets:
        facts.update(versions(params["python"], timeout_s))
    code_dir = Path(params["code_dir"]) if params["code_dir"] else None
    if "code" in subsets and code_dir is not None:
        code_hash, why = current_hash(code_dir)
        facts["code"] = {"path": str(code_dir), "hash": code_hash, "why": why}
    if "job" in subsets and code_dir is not None:
        facts["running_job"] = running_job(code_dir / "runs")
        if params["job_id"]:
            facts["job"] = status(code_dir / "runs" / params["job_id"], params["host"], params["main_host"],
                                  params["follow_poll_s"])  # fmt: skip
    if "checkpoint" in subsets and code_dir is not None:
        facts["checkpoint"] = newest_intact(code_dir / "runs" / params["job_id"])
    if "disk" in subsets:
        facts["disk"] = disk(Path(params["disk_path"]))
    if "memory" in subsets:
        memory = psutil.virtual_memory()
        facts["memory"] = {"total_bytes": memory.total, "available_bytes": memory.available}
    if "ports" in subsets:
        facts["port_range"] = port_range()
        facts["range_listeners"] = range_listeners(facts["port_range"])
    if "env" in subsets:
        facts["env_file"] = env_file(Path(params["env_file"]))
        if params["profile_file"]:
            facts["profile_exists"] = Path(params["profile_file"]).is_file()
    if "resolve" in subsets:
        facts["resolve"] = resolve(params["names"], timeout_s)
    if "files" in subsets:
        facts["files"] = files(params["paths"])
    if "clock" in subsets:
        facts["time"] = time.time()
    if "firewall" in subsets:
        facts["firewall"] = firewall(params["firewall_table"], timeout_s)
    if "kernel" in subsets:
        facts["kernel"] = kernel_facts(params["driver_repository"], timeout_s=timeout_s)
    return facts


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "host": {"type": "str"},
            "gather_subset": {"type": "list", "elements": "str", "default": ["all"], "choices": ["all", *SUBSETS]},
            "cluster_address": {"type": "str"},
            "cluster_interface_required": {"type": "bool", "default": False},
            "python": {"type": "path"},
            "code_dir": {"type": "path"},
            "job_id": {"type": "str"},
            "main_host": {"type": "bool", "default": False},
            "follow_poll_s": {"type": "float", "default": 0.0},
            "disk_path": {"type": "path"},
            "env_file": {"type": "path"},
            "profile_file": {"type": "path"},
            "names": {"type": "list", "elements": "str", "default": []},
            "paths": {"type": "list", "elements": "str", "default": []},
            "nvidia_smi": {"type": "path"},
            "firewall_table": {"type": "str", "default": "ugro"},
            "driver_repository": {"type": "str"},
            "timeout_s": {"type": "float", "default": 15.0},
        },
        supports_check_mode=True,
    )
    params = dict(module.params)
    params["host"] = host = params["host"] or socket.gethostname()
    if not HAS_PSUTIL:
        module.fail_json(msg=psutil_missing(host, "ugro_host_facts"))
    if params["cluster_address"] is not None:
        try:
            ipaddress.IPv4Address(params["cluster_address"])
        except ValueError:
            module.fail_json(
                msg=f"{host}: cluster_address '{params['cluster_address']}' is not an IPv4 address. Fix: set "
                f"ugro_cluster_address of {host} to one of its own IPv4 addresses in the inventory."
            )
    if params["job_id"] is not None and not JOB_ID.match(params["job_id"]):
        module.fail_json(msg=f"{host}: job_id '{params['job_id']}' is not a job id such as default-20261121-190000")
    requested = set(params["gather_subset"])
    if "all" in requested:
        subsets = {s for s in SUBSETS if (s not in NEEDS or params[NEEDS[s]]) and s not in EXPLICIT_ONLY}
    else:
        subsets = requested
        for subset in sorted(subsets):
            if subset in NEEDS and not params[NEEDS[subset]]:
                module.fail_json(msg=f"{host}: gather_subset '{subset}' needs the option {NEEDS[subset]}")
    facts = gather(params, subsets)
    cluster = facts.get("cluster")
    if params["cluster_interface_required"] and cluster is not None and cluster["interface"] is None:
        module.fail_json(
            msg=f"{host}: no interface holds its cluster address {cluster['why'].removeprefix('no interface holds ')}. "
            f"Fix: set ugro_cluster_address of {host} to one of its own addresses (inventory host_vars/{host}.yml), "
            "or bring up the cluster interface.",
            ansible_facts={"ugro_host": facts},
        )
    module.exit_json(changed=False, ansible_facts={"ugro_host": facts})


if __name__ == "__main__":
    main()
