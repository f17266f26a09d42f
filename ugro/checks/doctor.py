"""``make doctor``: read a run's collected logs and name each known failure's host, cause and fix.

Reads ``runs/<id>/logs/<host>-rank<N>.log`` and ``<host>-torchrun.log`` (what ``make logs`` and the
end of ``make train`` collect), ``hosts/<host>/torchrun.log`` when the run was local, and
``run.json``. Each known failure is a regular expression over those lines; a host that has a
torchrun log but no rank log never joined.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ugro.run.records import RunRecord


@dataclass(frozen=True)
class Known:
    key: str
    pattern: re.Pattern[str]
    cause: str
    fix: str


def _k(key: str, pattern: str, cause: str, fix: str) -> Known:
    return Known(key, re.compile(pattern, re.I), cause, fix)


# Most specific first: the first match of a line wins.
KNOWN = (
    _k(
        "driver-mismatch",
        r"Driver/library version mismatch",
        "the NVIDIA kernel module and its user-space libraries differ (the driver was upgraded, the host not rebooted)",
        "reboot the host; hold the driver (apt-mark hold) and keep it out of unattended-upgrades (make provision)",
    ),
    _k(
        "sm120",
        r"sm_\d+ is not compatible with the current PyTorch installation|no kernel image is available",
        "this PyTorch build has no kernels for the GPU (RTX 50-series is sm_120; CUDA 13 builds dropped cards below "
        "sm_75)",
        "make provision on that host: the lock's torch (its CUDA 13.0 build, cu130) has kernels for sm_75 to sm_120 "
        "and needs driver R580 (>= 580.65.06) with open modules; a card below sm_75 has none (preflight: gpu arch)",
    ),
    _k(
        "cuda-oom",
        r"CUDA out of memory|torch\.OutOfMemoryError|OutOfMemoryError: CUDA",
        "a rank ran out of GPU memory",
        "lower rank_local.micro_batch_size in that host's /etc/ugro/profile.yaml or set "
        "rank_local.gradient_checkpointing: true; make preflight measures the fit",
    ),
    _k(
        "nccl-cuda",
        r"unhandled cuda error",
        "NCCL hit a CUDA error (often an OOM inside NCCL, a driver fault, or mismatched driver/CUDA across hosts)",
        "rerun with NCCL_DEBUG=INFO to see the call; make preflight checks that drivers and torch CUDA match",
    ),
    _k(
        "nan",
        r"non-finite|\bloss[=: ]+(nan|inf)\b|\bloss is nan\b",
        "the loss or gradient went NaN/Inf; the run stopped before the bad update",
        "lower optim.lr, raise schedule.warmup_steps or lower optim.grad_clip, then `make train RESUME=auto`",
    ),
    _k(
        "ddp-ready-twice",
        r"mark a variable ready only once|marked as ready twice",
        "DDP saw a parameter's gradient twice in one backward (reentrant checkpointing or a module used twice)",
        "use non-reentrant gradient checkpointing (use_reentrant=False) and find_unused_parameters=False",
    ),
    _k(
        "name-resolution",
        r"Name or service not known|Temporary failure in name resolution|"
        r"nodename nor servname|getaddrinfo\b.*fail|failed to resolve|No address associated with hostname",
        "a host could not resolve another host's name",
        "put every host's cluster address and name in /etc/hosts on every node; make preflight checks it",
    ),
    _k(
        "connect",
        r"connect\(\) failed|Connection refused|Connection timed out|RendezvousTimeoutError|"
        r"RendezvousConnectionError|rendezvous.*tim(ed|e) ?out|client socket has timed out|"
        r"Socket Timeout|Timed out (after|waiting).*(connect|store|peer)",
        "a host could not connect to the rendezvous (TCPStore) or to a peer",
        "allow tcp 29500 and the ephemeral range 32768-60999 from the cluster subnet on every host; "
        "check NCCL/GLOO_SOCKET_IFNAME; make preflight tests both",
    ),
    _k(
        "never-joined",
        r"store_based_barrier.*worker_count|Timed out initializing process group|"
        r"waiting for .* ranks? to join|num_workers_joined",
        "a rank never joined the process group",
        "find the host without a rank log below; check that it started (torchrun.log) and reaches the rendezvous",
    ),
)


# The fix for each kind of ending the ranks (train/recovery/failure.py) and the controller (ugro/run/recovery.py)
# record.
FIXES = {
    "oom": "lower rank_local.micro_batch_size in that host's /etc/ugro/profile.yaml or set "
    "rank_local.gradient_checkpointing: true; make preflight measures the fit",
    "collective": "a peer was lost or a collective waited longer than distributed.timeout_s; the other findings "
    "name the host that went first",
    "config": "fix the key the message names, then launch again",
    "non_finite": "lower optim.lr, raise schedule.warmup_steps or lower optim.grad_clip, then `make train RESUME=auto`",
    "stopped": "the rank was told to stop (make stop, or torchrun ending it because another rank failed)",
    "error": "read the rank's log for the traceback",
    "vanished": "look at the host's kernel log (`journalctl -k`: the OOM killer, a segfault) and the rank's log",
    "lost": "the host rebooted, crashed or lost every job process: check its uptime and journal; it rejoins the "
    "job at the next relaunch once it answers",
    "unreachable": "the host stopped answering over SSH: check its power, cable or Wi-Fi and sleep settings",
    "launch": "a relaunch could not start there: read the message, fix the host, `make train RESUME=auto`",
    "crashed": "a rank crashed on a host that stayed up; its ranks were started again to rejoin the others: look at "
    "the host's kernel log (`journalctl -k`) and the rank's log for why it crashed",
    "rejoined": "nothing to fix: the host's ranks came back into the group after a crash",
    "rejoin": "the host's ranks were started again after a crash but found no group to rejoin (the run had ended or "
    "every other host was gone); `make follow` relaunches a run that did not finish",
}


@dataclass
class Finding:
    host: str
    key: str
    cause: str
    fix: str
    evidence: str  # file:line: text


def _host_of(path: Path) -> str:
    name = path.stem
    if path.parent.name != "logs":  # hosts/<host>/torchrun.log
        return path.parent.name
    return re.sub(r"-(rank\d+|torchrun)$", "", name)


def _log_files(run_dir: Path) -> list[Path]:
    files = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []
    collected = {_host_of(f) for f in files if f.stem.endswith("-torchrun")}
    for local in sorted((run_dir / "hosts").glob("*/torchrun.log")):
        if local.parent.name not in collected:
            files.append(local)
    return files


def _recorded(run_dir: Path) -> list[Finding]:
    """The causes the run recorded: every restart's, and how it ended if it did not finish (run.json)."""
    record = RunRecord.read(run_dir)
    if record is None:
        return []
    causes = [(f"run.json restarts[{i}]", r.cause) for i, r in enumerate(record.restarts)]
    if record.state in ("failed", "stopped") and record.cause is not None:
        causes.append(("run.json cause", record.cause))
    found = []
    for where, cause in causes:
        rank = f" rank {cause.rank}" if cause.rank is not None else ""
        found.append(Finding(cause.host, cause.kind, f"{cause.kind}{rank}: {cause.message}",
                             FIXES.get(cause.kind, FIXES["error"]), where))  # fmt: skip
    return found


def diagnose(run_dir: Path) -> list[Finding]:
    """The causes the run recorded, then every known failure in its logs (first occurrence per host and cause)."""
    findings: list[Finding] = _recorded(run_dir)
    seen: set[tuple[str, str]] = set()
    files = _log_files(run_dir)
    for path in files:
        host = _host_of(path)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            for known in KNOWN:
                if known.pattern.search(line):
                    if (host, known.key) not in seen:
                        seen.add((host, known.key))
                        rel = path.relative_to(run_dir)
                        findings.append(
                            Finding(host, known.key, known.cause, known.fix, f"{rel}:{number}: {line.strip()[:200]}")
                        )
                    break
    hosts = {_host_of(f) for f in files} | {p.name for p in (run_dir / "hosts").glob("*") if p.is_dir()}
    ranked = {_host_of(f) for f in files if re.search(r"-rank\d+$", f.stem)}
    if ranked:  # some rank started: a host with none never joined
        for host in sorted(hosts - ranked):
            findings.append(
                Finding(
                    host,
                    "never-joined",
                    f"no rank on {host} ever started: it never joined the job",
                    f"read {host}'s torchrun.log; check its Python, code sync and that it reaches "
                    "the main host (make preflight)",
                    f"logs/{host}-rank*.log missing",
                )
            )
    status = run_dir / "run.json"
    if not findings and status.is_file():
        try:
            error = json.loads(status.read_text()).get("error")
        except ValueError:
            error = None
        if error:
            findings.append(Finding("main", "error", str(error)[:300], "see the message", "run.json"))
    return findings


def to_json(run_dir: Path, findings: list[Finding]) -> str:
    return json.dumps({"run": str(run_dir), "findings": [asdict(f) for f in findings]}, indent=2)


def render(run_dir: Path, findings: list[Finding], console: Console) -> None:
    if not findings:
        console.print(f"{run_dir}: no known failure in its logs ({len(_log_files(run_dir))} files read)")
        return
    table = Table(title=f"doctor: {run_dir}", title_justify="left", show_lines=True)
    for column in ("host", "cause", "fix", "evidence"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(f.host, f.cause, f.fix, f.evidence)
    console.print(table)
