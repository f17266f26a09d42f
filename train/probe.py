"""What preflight measures on one host: facts, and a TCP listener/connector for the network checks.

The preflight role copies this one file to every host and runs it with the host's job Python
(``ugro_python``), before the code is synced: it uses the standard library only and never imports
torch (reading versions from package metadata takes milliseconds, importing torch seconds).

    python probe.py all ARGS       all three below at once (what the preflight role runs)
    python probe.py facts ARGS     versions, GPU, disk, name resolution, interfaces, clock
    python probe.py listen ARGS    bind the ports, accept the expected peers (or time out), exit
    python probe.py connect ARGS   connect to every target with a timeout, measure clock offset

ARGS is base64 of a JSON object (no quoting trouble on any shell). Every subcommand prints one JSON
object on stdout and exits 0 unless its arguments are broken.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# The packages whose versions must match on every host (distribution name -> label).
PACKAGES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "unsloth": "unsloth"}
NCCL_DISTS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
# What the code sync ships (ugro/codesync.py SYNCED); a host never synced is hashed by walking these.
SYNCED = ("train", "jobs", "models", "data", "requirements", "pyproject.toml")
MANIFEST = ".ugro-code-manifest"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch_cuda() -> str | None:
    """torch.version.cuda without importing torch: read torch/version.py."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        match = re.search(r"^cuda(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", path.read_text(), re.M)
    except OSError:
        return None
    return match[1] if match else None


def _nccl() -> str | None:
    for dist in NCCL_DISTS:
        version = _version(dist)
        if version:
            return version
    return None


def _gpus() -> dict[str, Any]:
    """nvidia-smi's view: GPUs with name, total memory (MiB) and driver, or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"gpus": [], "driver": None, "smi": "no nvidia-smi"}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"gpus": [], "driver": None, "smi": "nvidia-smi hung for 15 s"}
    if out.returncode != 0:
        return {"gpus": [], "driver": None, "smi": (out.stderr or out.stdout).strip()[:300] or f"rc {out.returncode}"}
    gpus = []
    driver = None
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append({"index": parts[0], "name": parts[1], "memory_mib": float(parts[2] or 0)})
            driver = parts[3]
    return {"gpus": gpus, "driver": driver, "smi": "ok"}


def _code_hash(code_dir: Path) -> dict[str, Any]:
    manifest = code_dir / MANIFEST
    if manifest.is_file():
        files = [line for line in manifest.read_text().splitlines() if line]
    else:
        found: set[str] = set()
        for name in SYNCED:
            path = code_dir / name
            for file in path.rglob("*") if path.is_dir() else [path]:
                payload = (file.parent / "ugro-model.yaml").is_file() and file.name not in (
                    "ugro-model.yaml",
                    ".gitignore",
                )
                if file.is_file() and not payload and not SKIP_PARTS.intersection(file.relative_to(code_dir).parts):
                    found.add(file.relative_to(code_dir).as_posix())
        files = sorted(found)
    if not files:
        return {"hash": None, "why": f"no code in {code_dir}"}
    digest = hashlib.sha256()
    for rel in files:
        try:
            data = (code_dir / rel).read_bytes()
        except OSError:
            return {"hash": None, "why": f"{code_dir / rel} is missing"}
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(data).digest())
    return {"hash": digest.hexdigest(), "why": None}


def _disk(path: Path) -> dict[str, Any]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return {"path": str(path), "measured_at": str(probe), "free_bytes": usage.free, "total_bytes": usage.total}


def _resolve(names: dict[str, str], timeout_s: float) -> dict[str, Any]:
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
            results[name] = {"address": None, "error": f"no answer within {timeout_s:.0f} s (DNS hangs?)"}
    pool.shutdown(wait=False, cancel_futures=True)
    return results


def _interfaces() -> dict[str, list[str]]:
    """Interface -> IPv4 addresses, from `ip -o -4 addr show`."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        out = subprocess.run([ip, "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            found.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
    return found


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (optionally `export KEY=...`, quoted values); comments and blanks skipped."""
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if sep and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key.strip()):
            values[key.strip()] = value.strip().strip("'\"")
    return values


def _meminfo() -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return found


def _port_range() -> str | None:
    """The host's ephemeral port range ("32768-60999"): where NCCL/gloo peers connect back to."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return None
    return f"{low}-{high}"


def _running_job(code_dir: Path) -> dict[str, Any] | None:
    """The job this host runs now: ``runs/active-job`` holds "<job id> <process group>" while it lives."""
    try:
        parts = (code_dir / "runs" / "active-job").read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return None  # left behind by a job that is gone: the launch replaces it
    except PermissionError:
        pass  # alive, owned by another user
    return {"job": parts[0], "pgid": int(parts[1])}


def facts(args: dict[str, Any]) -> dict[str, Any]:
    code_dir = Path(args["code_dir"])
    env_file = Path(args["env_file"])
    env: dict[str, str] | None = None
    env_error = None
    if env_file.is_file():
        try:
            env = read_env_file(env_file)
        except (OSError, UnicodeDecodeError) as exc:
            env_error = str(exc)
    versions = {label: _version(dist) for dist, label in PACKAGES.items()}
    versions["python"] = platform.python_version()
    versions["cuda runtime"] = _torch_cuda()
    versions["nccl"] = _nccl()
    return {
        "hostname": socket.gethostname(),
        "python_executable": sys.executable,
        "versions": versions,
        "gpu": _gpus(),
        "code": _code_hash(code_dir),
        "running_job": _running_job(code_dir),
        "disk": _disk(Path(args["checkpoint_dir"])),
        "resolve": _resolve(args.get("names", {}), float(args.get("timeout_s", 3))),
        "interfaces": _interfaces(),
        "env_file": {
            "path": str(env_file),
            "exists": env_file.is_file(),
            "error": env_error,
            "ifnames": {k: v for k, v in (env or {}).items() if k in IFNAME_VARS},
        },
        "profile_exists": Path(args["profile_file"]).is_file(),
        "memory": _meminfo(),
        "port_range": _port_range(),
        "time": time.time(),
    }


def listen(args: dict[str, Any], ready: threading.Event | None = None) -> dict[str, Any]:
    """Bind every requested port on the host's cluster address and accept `expect[label]` connections
    per port (answering each with this host's clock), or stop at listen_timeout_s."""
    address = args["address"]
    servers: dict[str, socket.socket] = {}
    errors: dict[str, str] = {}
    for label, port in args["ports"].items():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, int(port)))
            sock.listen(64)
        except OSError as exc:
            errors[label] = f"cannot listen on {address}:{port}: {exc.strerror or exc}"
            sock.close()
            continue
        servers[label] = sock
    if ready is not None:
        ready.set()
    ports = {label: sock.getsockname()[1] for label, sock in servers.items()}
    peers: dict[str, list[str]] = {label: [] for label in servers}
    deadline = time.monotonic() + float(args["listen_timeout_s"])

    def serve(label: str, sock: socket.socket) -> None:
        expect = int(args["expect"][label])
        while len(peers[label]) < expect and time.monotonic() < deadline:
            sock.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
            try:
                conn, peer = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack("!d", time.time()))
            peers[label].append(str(peer[0]))
        sock.close()

    threads = [threading.Thread(target=serve, args=item, daemon=True) for item in servers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"ports": ports, "errors": errors, "peers": peers}


def _connect_one(address: str, port: int, timeout_s: float, retry_s: float = 0.0) -> dict[str, Any]:
    """One connection (a refused one is retried for retry_s: the peer may not listen yet)."""
    retry_until = time.monotonic() + retry_s
    while True:
        result = _attempt(address, port, timeout_s)
        if result["ok"] or "refused" not in str(result["error"]) or time.monotonic() >= retry_until:
            return result
        time.sleep(0.1)


def _attempt(address: str, port: int, timeout_s: float) -> dict[str, Any]:
    t0 = time.time()
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            data = b""
            while len(data) < 8:
                chunk = conn.recv(8 - len(data))
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return {"ok": False, "error": f"timed out after {timeout_s:g} s (packets dropped: a firewall?)"}
    except ConnectionRefusedError:
        return {"ok": False, "error": "connection refused (nothing listens, or a firewall rejects it)"}
    except OSError as exc:
        return {"ok": False, "error": str(exc.strerror or exc)}
    t1 = time.time()
    result: dict[str, Any] = {"ok": True, "rtt_s": t1 - t0, "error": None}
    if len(data) == 8:
        (remote,) = struct.unpack("!d", data)
        result["offset_s"] = remote - (t0 + t1) / 2  # the peer's clock minus ours
    return result


def connect(args: dict[str, Any]) -> list[dict[str, Any]]:
    """targets: [{host, label, address, port}]; all tried at once, each with the timeout."""
    timeout_s = float(args["timeout_s"])
    retry_s = float(args.get("retry_s", 0))
    targets = args["targets"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        futures = [pool.submit(_connect_one, t["address"], int(t["port"]), timeout_s, retry_s) for t in targets]
        return [{**t, **f.result()} for t, f in zip(targets, futures, strict=True)]


def everything(args: dict[str, Any]) -> dict[str, Any]:
    """facts, listen and connect at once: what one preflight task runs on every host."""
    ready = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        listening = pool.submit(listen, args, ready)
        ready.wait(timeout=10)
        # Peers start within a second or two of each other: a refused connection is retried meanwhile.
        connecting = pool.submit(
            connect, {**args, "retry_s": max(0.0, float(args["listen_timeout_s"]) - float(args["timeout_s"]) - 1)}
        )
        found = facts(args)
        return {"facts": found, "connect": connecting.result(), "listen": listening.result()}


def main(argv: list[str]) -> int:
    commands: dict[str, Any] = {"all": everything, "facts": facts, "listen": listen, "connect": connect}
    if len(argv) != 2 or argv[0] not in commands:
        print(f"usage: probe.py {{{'|'.join(commands)}}} <base64 of json args>", file=sys.stderr)
        return 2
    try:
        args = json.loads(base64.b64decode(argv[1]))
        result = commands[argv[0]](args)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"probe.py {argv[0]}: bad arguments: {exc!r}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
