"""The preflight's stack rows: Python and the job's packages alike on every host, the NVIDIA driver against the
CUDA runtime of the locks, the cards' architectures against torch's build, and the backend each host runs."""

from __future__ import annotations

from typing import Any

from ugro.checks.preflight_report import Cell, Check, Report, same_everywhere
from ugro.stack import cuda as stack
from ugro.stack import lockfile as locks

VERSION_ROWS = ("python", "torch", "cuda runtime", "nccl", "transformers", "peft", "unsloth")


def python_row(facts: dict[str, dict[str, Any]]) -> Check:
    """Each host's Python must have a lock: every lock pins the same versions, so Pythons may differ by host."""
    check = Check("python")
    supported = sorted(p.parent.name.removeprefix("py") for p in locks.LOCKS.glob("py3.*/node.txt"))
    for host, f in facts.items():
        version = str(f["versions"].get("python") or "?")
        minor = ".".join(version.split(".")[:2])
        if minor in supported:
            check.cells[host] = Cell("PASS", version)
        else:
            check.cells[host] = Cell(
                "FAIL",
                version,
                f"{host} runs Python {version}, which has no lock (requirements/locks: {', '.join(supported)})",
                f"install one of Python {', '.join(supported)} on {host}, set python_env_interpreter to it and run "
                "make provision",
            )
    return check


def unsloth_row(facts: dict[str, dict[str, Any]], values: dict[str, str | None], main_host: str, fix: str) -> Check:
    """unsloth where it is installed must be one version; a host without it is fine unless it has a GPU."""
    installed: dict[str, str | None] = {h: v for h, v in values.items() if v}
    check = same_everywhere("unsloth", installed, main_host, fix) if installed else Check("unsloth")
    for host in values:
        if host in installed:
            continue
        if facts[host].get("gpu", {}).get("gpus"):
            check.cells[host] = Cell(
                "WARN",
                "not installed",
                f"{host} has a GPU but no unsloth: it trains with transformers + peft",
                f"make provision ANSIBLE_ARGS='--limit {host}' (a GPU host gets requirements/locks/py3.X/gpu.txt)",
            )
        else:
            check.cells[host] = Cell("PASS", "not installed (no GPU)")
    return check


def lock_cuda() -> tuple[str | None, str]:
    """The CUDA runtime of the node lock (what torch runs on the GPU hosts), or None and why not."""
    try:
        cuda = stack.lock_cuda_runtime(locks.LOCKS)
        stack.min_driver(cuda)
        stack.torch_build(cuda)
    except (stack.StackError, OSError) as exc:
        return None, str(exc)
    return cuda, ""


def _torch(facts: dict[str, Any]) -> str:
    return str(facts.get("versions", {}).get("torch") or "?")


def _cards(facts: dict[str, Any]) -> str:
    return ", ".join(sorted({str(g.get("name")) for g in facts.get("gpu", {}).get("gpus") or []})) or "its GPU"


def _driver_fix(host: str) -> str:
    return (
        f'set nvidia_driver_version: "{stack.pinned_driver()}" (role nvidia_driver\'s default, R580) for every node, '
        f"run make provision ANSIBLE_ARGS='--tags nvidia_driver --limit {host}' and reboot {host} "
        "(nvidia_driver_reboot_allowed: true lets the role do it)"
    )


def _runs(driver: str, cuda: str) -> bool:
    try:
        return stack.driver_ok(driver, cuda)
    except stack.StackError:  # not a version nvidia-smi should print: not one that runs anything
        return False


def driver_row(facts: dict[str, dict[str, Any]], main_host: str, cuda: str | None) -> Check:
    """Every GPU host's driver: new enough for torch's CUDA runtime (the lock's), and the same everywhere."""
    drivers = {h: str(f["gpu"]["driver"]) for h, f in facts.items() if f.get("gpu", {}).get("driver")}
    check = same_everywhere(
        "driver", dict(drivers), main_host, "install driver {ref} on {host} and hold it (apt-mark hold), then reboot"
    )
    if cuda is None:
        return check
    floor = stack.min_driver(cuda)
    for host, driver in drivers.items():
        if not _runs(driver, cuda):
            check.cells[host] = Cell(
                "FAIL",
                f"{driver} < {floor}",
                f"{host} ({_cards(facts[host])}) runs driver {driver}, older than the {floor} that CUDA {cuda} "
                f"(torch {_torch(facts[host])}'s runtime) needs: torch sees no GPU there",
                _driver_fix(host),
            )
        elif check.cells[host].status == "PASS":
            check.cells[host] = Cell("PASS", f"{driver} (CUDA {cuda} needs >= {floor})")
    return check


def arch_row(facts: dict[str, dict[str, Any]], cuda: str | None, why: str) -> Check:
    """Every GPU's compute capability against the architectures torch's CUDA build was compiled for."""
    check = Check("gpu arch")
    for host, f in facts.items():
        gpus = f.get("gpu", {}).get("gpus") or []
        if not gpus:
            check.cells[host] = Cell("PASS", "no GPU")
            continue
        if cuda is None:
            check.cells[host] = Cell("WARN", "not judged", f"no CUDA runtime to judge against: {why}", "run make lock")
            continue
        seen: dict[str, str] = {}
        dead: list[tuple[str, str]] = []
        unknown: list[str] = []
        for g in gpus:
            name, cc = str(g.get("name")), g.get("compute_cap")
            if cc is None:
                unknown.append(name)
            elif stack.support(cc, cuda) == "none":
                dead.append((name, cc))
            else:
                cubin = stack.cubin_for(cc, cuda)
                seen.setdefault(
                    name, f"{cc} {cubin}" if cubin == f"sm_{cc.replace('.', '')}" else f"{cc} runs {cubin or 'PTX'}"
                )
        build = stack.torch_build(cuda)
        torch = _torch(f)
        if dead:
            name, cc = dead[0]
            check.cells[host] = Cell(
                "FAIL",
                f"{cc} unsupported",
                f"{host}'s {name} is compute capability {cc}: torch {torch}'s CUDA {cuda} build has kernels for "
                f"{build.arch_list()} only (CUDA 13 dropped Maxwell, Pascal and Volta)",
                f"replace the {name} in {host} with a Turing (7.5) or newer card, or take {host} out of ugro_cluster",
            )
        elif unknown:
            check.cells[host] = Cell(
                "WARN",
                "not reported",
                f"nvidia-smi on {host} does not report the compute capability of {', '.join(unknown)}",
                f"install the pinned driver on {host} (make provision ANSIBLE_ARGS='--tags nvidia_driver')",
            )
        else:
            check.cells[host] = Cell("PASS", "; ".join(seen.values()))
    return check


def backend_row(facts: dict[str, dict[str, Any]], cuda: str | None, requested: str, report: Report) -> Check:
    """What each host trains with: unsloth or transformers + peft, on CUDA or on CPU (train/model/load.py's choice)."""
    check = Check("backend")
    for host, f in facts.items():
        gpus = f.get("gpu", {}).get("gpus") or []
        if cuda is None:
            label = "hf (CPU, gloo)" if not gpus else "not judged"
            check.cells[host] = Cell(
                "PASS" if not gpus else "WARN", label, "no CUDA runtime in the lock", "run make lock"
            )
            continue
        choice = stack.backend(
            [g.get("compute_cap") for g in gpus],
            f.get("gpu", {}).get("driver"),
            cuda,
            bool(f.get("versions", {}).get("unsloth")),
            requested,
        )
        report.measurements.setdefault(host, {})["backend"] = {"name": choice.name, "device": choice.device}
        if choice.ok:
            check.cells[host] = Cell("PASS", choice.label())
            continue
        fixes = {
            "no gpu": "use model.backend 'auto' (unsloth where it can run) or 'hf' in the job file",
            "driver": _driver_fix(host),
            "arch": f"replace the card in {host} with a Turing (7.5) or newer one, or take {host} out of ugro_cluster",
            "no unsloth": "make provision (GPU hosts get requirements/locks/py3.X/gpu.txt) or model.backend 'auto'",
        }
        shown = f"{choice.name}, CPU (no CUDA)" if choice.problem == "driver" else choice.label()
        check.cells[host] = Cell("FAIL", shown, f"{host} ({_cards(f)}): {choice.why}", fixes[choice.problem or ""])
    return check
