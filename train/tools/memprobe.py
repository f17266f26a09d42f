"""The preflight memory probe: the job's first steps on this host, with this host's profile.

    python -m train.tools.memprobe --job jobs/x.yaml --profile /etc/ugro/profile.yaml --host NAME

One process, no process group: the model as the job loads it (train.model.load.load_model), the job's
data (train.data.blocks.prepare), micro-batches of the profile's size through the job's token-weighted
backward (train.balance.step.backward) and an AdamW step, --steps times. Prints one line
``UGRO_MEMPROBE {json}``: peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: peak RSS),
what the device has, and on an out-of-memory error which knob to change. Exit 0 even then; 2 when
the job or profile is broken (the message names the file and key).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from train.config import ConfigError, apply_profile, load_job, load_profile

MARK = "UGRO_MEMPROBE"


def _emit(result: dict[str, Any]) -> None:
    print(f"{MARK} {json.dumps(result)}", flush=True)


def _mem_available() -> int:
    return int(psutil.virtual_memory().available)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(exc).lower()


def probe(job_file: Path, profile: Path | None, host: str, steps: int, code_dir: Path) -> dict[str, Any]:
    from train.balance.step import StepClock, backward
    from train.data.blocks import prepare
    from train.data.pairblocks import prepare_pairs
    from train.layout.engine import preference_step
    from train.model.load import load_model

    job = load_job(job_file)
    if profile is not None:
        job = apply_profile(job, load_profile(profile, host), f"{profile} on host {host}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    micro = job.micro_batch_cap
    result: dict[str, Any] = {
        "host": host,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "total_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "micro_batch_size": micro,
        "micro_batch_tokens": job.rank_local.micro_batch_tokens,
        "gradient_checkpointing": job.rank_local.gradient_checkpointing,
        "profile": str(profile) if profile is not None else None,
        "steps": 0,
        "oom": None,
    }
    start = time.monotonic()
    try:
        torch.manual_seed(job.train.seed)
        model, tokenizer, backend = load_model(job, code_dir, device)
        result["backend"] = backend
        preference = preference_step(job, model)  # a preference method's pairs: its own step (two rows a pair)
        blocks = prepare(job.data, tokenizer, code_dir, job.train.seed) if preference is None else \
            prepare_pairs(job, tokenizer, code_dir)  # fmt: skip
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=job.optim.lr)
        model.train()
        for step in range(steps):
            picked = [(step * micro + i) % len(blocks) for i in range(micro)]
            if preference is not None:
                preference.backward(model, [blocks.batch(picked, device)], device, StepClock(), None)
            else:
                rows = [blocks[i] for i in picked]
                batch = {k: torch.stack([r[k] for r in rows]).to(device) for k in rows[0]}
                backward(model, [batch], device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result["steps"] = step + 1
    except Exception as exc:
        if not _is_oom(exc):
            raise
        result["oom"] = str(exc).splitlines()[0][:300]
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["available_bytes"] = _mem_available()
    result["seconds"] = round(time.monotonic() - start, 2)
    result["estimate_bytes"] = _estimate_bytes(job, code_dir, "cuda" if cuda else "cpu", result.get("backend", "hf"))
    return result


def _estimate_bytes(job: Any, code_dir: Path, device_kind: str, backend: str) -> int | None:
    """What the stage planner (train/layout/stageplan.py) estimates the whole model needs here, with the backend that
    loaded it: the probe checks it."""
    from train.layout import stageplan

    try:
        shape = stageplan.read_shape(job, code_dir)
    except stageplan.PlanError:
        return None  # a hub model: no local config.json to size it from
    found = stageplan.estimate(shape, job, stageplan.Span(shape.layers), device_kind, backend=backend)
    return int(found.total * stageplan.GIB)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--profile", type=Path, default=None, help="used when the file exists")
    parser.add_argument("--host", default=os.uname().nodename)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--code-dir", type=Path, default=Path.cwd())
    args = parser.parse_args(argv)
    profile = args.profile if args.profile is not None and args.profile.is_file() else None
    try:
        result = probe(args.job, profile, args.host, args.steps, args.code_dir)
    except ConfigError as exc:
        _emit({"host": args.host, "config_error": str(exc)})
        return 2
    _emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
