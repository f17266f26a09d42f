"""Atomic, verified checkpoints written by rank 0 and restored to every rank without shared storage.

Layout of ``<run>/checkpoints/step-000120/``:

* ``adapter/`` — the LoRA adapter in peft ``save_pretrained`` form (usable on its own);
* ``state.pt`` — trainable weights, optimizer, scheduler, step, every rank's RNG states;
* ``manifest.json`` — sha256 of every file above, written last.

A checkpoint is written into a temporary directory, fsynced, renamed into place, then re-read
and checked against its manifest. A directory whose manifest is missing or does not match its
files (a kill or a full disk mid-write) is never loaded.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.digest import sha256_file
from train.dist import comm
from train.dist.health import GroupHealth

log = logging.getLogger(__name__)

PREFIX = "step-"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Restored:
    step: int
    path: Path
    extra: dict[str, Any]  # what the run saved beside the weights (world size, batch plan, ...)


def _fsync_tree(root: Path) -> None:
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def verify(path: Path) -> str | None:
    """None when the checkpoint is intact, else why it must not be loaded.

    ``ugro/module_utils/ugro_checkpoints.py`` ``problem`` applies the same rule for the host fact module and the
    controller: Ansible ships that file alone to hosts, where ``train/`` is not importable, and the ranks do not
    import Ansible's module_utils (the node receives ``train/`` only). tests/test_checkpoint.py holds them equal."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the write never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, str] = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    for rel, expected in files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if sha256_file(file) != expected:
            return f"{rel} does not match its checksum"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_valid(run_dir: Path) -> Path | None:
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def gather_rngs(health: GroupHealth | None = None) -> list[Any]:
    """Collective: every rank's RNG states, by rank (abandoned, like a step's all-reduce, when ``health`` says a peer
    is lost)."""
    if not dist.is_initialized():
        return [rng_state()]
    return (health or GroupHealth()).gather_objects(rng_state(), comm.control_group())


def save(
    run_dir: Path,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keep_last: int,
    is_main: bool,
    extra: dict[str, Any],
) -> Path | None:
    """Collective: every rank contributes its RNG state (``extra["rng"]`` where the caller gathered them already); the
    main rank writes. Returns the path on the main rank."""
    rngs = extra["rng"] if "rng" in extra else gather_rngs()
    if not is_main:
        return None
    state = {
        "step": step,
        "trainable": trainable_state(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rngs,
        **extra,
    }

    def adapter(folder: Path) -> None:
        model.save_pretrained(str(folder), save_embedding_layers=False)

    return write(run_dir, step, state, keep_last, adapter)


def write(run_dir: Path, step: int, state: dict[str, Any], keep_last: int, adapter: Callable[[Path], None]) -> Path:
    """Write ``state.pt`` and the adapter (``adapter(dir)`` writes it) atomically, verify, drop old checkpoints."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    adapter(tmp / "adapter")
    torch.save(state, tmp / "state.pt")
    files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_tree(root)
    problem = verify(final)
    if problem is not None:
        raise OSError(f"checkpoint {final} failed verification right after writing: {problem}")
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: Path) -> dict[str, Any] | None:
    """A checkpoint's ``state.pt`` with tensors and plain values only (``weights_only``): nothing in it runs. The
    manifest proves a checkpoint whole, not who wrote it (a shared run directory, a copy from another host): one that
    holds anything else is refused and named in the log, never unpickled."""
    try:
        state: dict[str, Any] = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, TypeError, ValueError, AttributeError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        log.warning("checkpoint %s refused: its state.pt holds more than tensors and plain values (%s); not loaded",
                    path, first.strip()[:200])  # fmt: skip
        return None
    return state


def newest_loadable(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that is intact and holds only tensors and plain values, with its state."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify(path)
        if problem is not None:
            log.warning("skipping checkpoint %s: %s", path, problem)
            continue
        state = load_state(path)
        if state is not None:
            return path, state
    return None


def fetch(run_dir: Path, rank: int, src: int = 0) -> tuple[Path, dict[str, Any]] | None:
    """Collective: rank ``src`` loads the newest intact checkpoint's state and broadcasts it to every rank."""
    payload: tuple[str, dict[str, Any]] | None = None
    if rank == src:
        found = newest_loadable(run_dir)
        if found is not None:
            payload = (str(found[0]), found[1])
    if dist.is_initialized():
        payload = comm.broadcast_objects(payload, src)
    if payload is None:
        return None
    path_str, state = payload
    return Path(path_str), state


def restore_rng(state: dict[str, Any], rank: int) -> None:
    """The rank's RNG states from a checkpoint written by as many ranks, else a seed of its own."""
    rngs = state["rng"]
    if len(rngs) == (dist.get_world_size() if dist.is_initialized() else 1):
        set_rng_state(rngs[rank])
    else:
        torch.manual_seed(hash((state["step"], rank)) & 0xFFFFFFFF)


def restored(path: Path, state: dict[str, Any]) -> Restored:
    known = {"step", "trainable", "optimizer", "scheduler", "rng"}
    extra = {k: v for k, v in state.items() if k not in known}
    return Restored(step=int(state["step"]), path=path, extra=extra)


def restore(
    run_dir: Path, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int, src: int = 0
) -> Restored | None:
    """Collective: rank ``src`` loads the newest intact checkpoint and broadcasts it to every rank."""
    fetched = fetch(run_dir, rank, src)
    if fetched is None:
        return None
    path, state = fetched
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state["trainable"].items():
            params[name].copy_(value.to(params[name].device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(state, rank)
    return restored(path, state)


def name_base(adapter: Path, source: str) -> None:
    """Record the base as the job names it (a repository path like models/x, or a hub name), not this node's
    absolute path, so that the adapter loads on the controller and anywhere the repository is checked out."""
    config = adapter / "adapter_config.json"
    record = json.loads(config.read_text())
    record["base_model_name_or_path"] = source
    config.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
