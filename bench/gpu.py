"""`python -m bench.gpu OUT_DIR`: the CUDA path on a real GPU, the figures of docs/gpu-results.md.

Run on a machine with an NVIDIA GPU and the job's Python (torch with CUDA, transformers, peft, bitsandbytes):

- ``env``: the GPU, its driver, torch's CUDA runtime and architecture list, bitsandbytes' CUDA library, whether
  unsloth imports, and what the project's stack rules (ugro/stack/cuda.py) say of this card and runtime;
- ``train``: the trainer's own worker under torchrun (one rank, NCCL) on the default job's architecture
  (SmolLM2-135M's config, seeded random weights saved to disk first, ``materialize``: the pretrained weights do
  not travel to such a machine), 16-bit and
  4-bit NF4 with transformers + peft; tokens/s after the first steps, peak ``torch.cuda.max_memory_allocated``,
  held-out loss before and after (the trainer maps each local rank to its own GPU: two ranks need two GPUs);
- ``profiles``: the shipped memory profiles (role memory_profile) on the default job under their card's memory;
- ``exporter``: the node exporter's GPU series (NVML), scraped while a job trains;
- ``compare``: the trainer against a bare loop, cell by cell (bench/gpu_compare.py): positions/s and peak memory
  of Qwen2.5-1.5B in 16 and 4 bits with both backends, Llama-3-8B in 4 bits at micro-batch 1 against the stage
  planner's estimate (``UGRO_GPU_CELLS=0,3`` runs those cells only);
- ``packing``: examples packed into one row see only themselves, on CUDA, with both backends;
- ``multirank``: several ranks' semantics on one GPU (bench/gpu_multirank.py): an NCCL group of one for the stream
  order, the recorded error and a grouped abort, ugro's DDP hook on a CUDA model, three ranks over gloo with CUDA
  tensors; without CUDA its dry form on CPU, which says what the GPU parts would show;
- ``probe``: the preflight's memory probe (train/tools/memprobe.py, 5 steps) of Qwen2.5-14B's architecture in
  4-bit QLoRA under the reference cluster's memory caps (``torch.cuda.set_per_process_memory_fraction``).

Every result is one JSON line in OUT_DIR/gpu.jsonl, and printed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench import gpu_compare, gpu_multirank

REPO = Path(__file__).resolve().parent.parent
SMOLLM = "models/configs/smollm2-135m-instruct"
QWEN14 = "models/configs/qwen2.5-14b"
TOKENIZER = "models/tiny-llama"  # ids below every model's vocabulary; the weights are random anyway
SCRATCH = Path(os.environ.get("UGRO_GPU_SCRATCH", "/tmp/ugro-gpu"))


def child_env() -> dict[str, str]:
    """The environment of every process this benchmark starts: the checkout first on the path, no hub."""
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                         "HF_HUB_OFFLINE": "1"}  # fmt: skip


def materialize(config_dir: str) -> Path:
    """The architecture of ``config_dir`` with seeded random bf16 weights, saved as a model directory: 4-bit
    quantization applies to weights loaded from disk (``init: pretrained``), not to a model built in memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = SCRATCH / Path(config_dir).name
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(1234)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 14B model's init takes minutes on CPU
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / config_dir), dtype=torch.bfloat16)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(REPO / TOKENIZER).save_pretrained(target)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return target


def _emit(out: Path, record: dict[str, Any]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with (out / "gpu.jsonl").open("a") as fh:
        fh.write(line + "\n")


def env(out: Path) -> None:
    import torch

    from ugro.stack import cuda

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                          "--format=csv,noheader"], capture_output=True, text=True, check=False)  # fmt: skip
    name, driver, memory, cc = (x.strip() for x in smi.stdout.splitlines()[0].split(","))
    runtime = str(torch.version.cuda)
    record: dict[str, Any] = {"what": "env", "gpu": name, "driver": driver, "memory": memory, "compute_cap": cc,
                              "torch": torch.__version__, "cuda_runtime": runtime,
                              "arch_list": torch.cuda.get_arch_list(), "python": sys.version.split()[0]}  # fmt: skip
    try:
        import bitsandbytes as bnb
        from bitsandbytes.cextension import lib

        record["bitsandbytes"] = {"version": bnb.__version__, "library": str(getattr(lib, "_name", lib))}
    except Exception as exc:  # reported, not raised: it is a finding
        record["bitsandbytes"] = {"error": str(exc)[:300]}
    try:
        import unsloth  # type: ignore[import-not-found]  # noqa: F401

        record["unsloth"] = "imports"
    except Exception as exc:
        record["unsloth"] = f"does not import: {str(exc)[:200]}"
    record["stack"] = {
        "driver_ok": cuda.driver_ok(driver, runtime),
        "min_driver": cuda.min_driver(runtime),
        "support": str(cuda.support(cc, runtime)),
        "runs_natively": cuda.runs_natively(cc, runtime),
        "backend_policy_auto": cuda.policy("auto", runtime),
    }
    _emit(out, record)


def _job(path: Path, source: Path, quantization: str, steps: int, seq_len: int, batch: int, **extra: Any) -> Path:
    job = {
        "name": path.stem,
        "model": {"source": str(source), "init": "pretrained", "quantization": quantization, "dtype": "bfloat16"},
        "lora": {"target_modules": "all-linear"},
        "data": {"source": "data/sample/train.jsonl", "seq_len": seq_len},
        "schedule": {"warmup_steps": 2},
        "train": {"max_steps": steps, "global_batch_size": batch, "log_every": 1, "seed": 1234},
        "checkpoint": {"every": steps, "keep_last": 1},
        "eval": {"source": "data/sample/eval.jsonl", "every": steps, "samples": 1, "max_new_tokens": 8},
    } | extra
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def torchrun(job: Path, run_dir: Path, nproc: int, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    port = 29500 + nproc
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0", "--module",
            "train.worker", "--job", str(job), "--run-dir", str(run_dir), "--resume", "none",
            "--code-dir", str(REPO)]  # fmt: skip
    return subprocess.run(
        argv, cwd=REPO, env=child_env() | env_extra, capture_output=True, text=True, timeout=900, check=False
    )


def _summary(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines() if x.strip()]
    later = rows[len(rows) // 2 :]
    tokens = sum(r["tokens"] for r in later)
    seconds = later[-1]["elapsed_s"] - rows[len(rows) // 2 - 1]["elapsed_s"] if len(rows) > 1 else 0.0
    logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*rank*.log")))
    peaks = [float(x) for x in re.findall(r"peak memory of this rank: ([0-9.]+) GiB", logs)]
    backend = re.search(r"backend=(\w+) device=(\S+)", logs)
    return {"steps": len(rows), "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "peak_gib": peaks, "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "eval_before": evals[0]["eval_loss"], "eval_after": evals[-1]["eval_loss"],
            "backend": backend.group(0) if backend else None,
            "shares": rows[-1].get("ranks", {}).get("share")}  # fmt: skip


def train(out: Path) -> None:
    work = SCRATCH / "work"
    work.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[str, str, int, dict[str, str]]] = [
        ("smollm2-135m bf16, 1 rank nccl", "none", 1, {}),
        ("smollm2-135m 4bit nf4, 1 rank nccl", "4bit", 1, {}),
    ]
    source = materialize(SMOLLM)
    for label, quant, nproc, extra in cases:
        stem = re.sub(r"[^a-z0-9]+", "-", label)
        job = _job(work / f"{stem}.yaml", source, quant, steps=30, seq_len=512, batch=8)
        started = time.monotonic()
        done = torchrun(job, work / stem, nproc, extra)
        record: dict[str, Any] = {"what": "train", "case": label, "exit": done.returncode,
                                  "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
        if done.returncode == 0:
            record |= _summary(work / stem)
        else:
            record["tail"] = (done.stdout + done.stderr)[-1500:]
        _emit(out, record)


PROBE = """
import runpy, sys, torch
cap = float(sys.argv[1])
torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.get_device_properties(0).total_memory)
profile = ["--profile", sys.argv[4]] if len(sys.argv) > 4 else []
sys.argv = ["memprobe", "--job", sys.argv[2], "--steps", "5", "--code-dir", sys.argv[3], *profile]
runpy.run_module("train.tools.memprobe", run_name="__main__")
"""


def probe(out: Path) -> None:
    work = SCRATCH / "work"
    work.mkdir(parents=True, exist_ok=True)
    source = materialize(QWEN14)
    cells = [(12, 1024, 1, True), (8, 1024, 1, True), (12, 2048, 1, True)]
    for cap, seq_len, micro, ckpt in cells[: int(os.environ.get("UGRO_GPU_PROBES", len(cells)))]:
        stem = f"qwen14-{cap}g-{seq_len}-mb{micro}-{'ckpt' if ckpt else 'nockpt'}"
        rank_local = {"micro_batch_size": micro, "gradient_checkpointing": ckpt}
        job = _job(work / f"{stem}.yaml", source, "4bit", steps=5, seq_len=seq_len, batch=micro, rank_local=rank_local)
        started = time.monotonic()
        result = _probe(cap, job, None)
        _emit(out, {"what": "probe", "case": stem, "cap_gib": cap, "wall_s": round(time.monotonic() - started, 1)}
              | result)  # fmt: skip


def _probe(cap: float, job: Path, profile: Path | None) -> dict[str, Any]:
    argv = [sys.executable, "-c", PROBE, str(cap), str(job), str(REPO)] + ([str(profile)] if profile else [])
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900, check=False)
    found = re.search(r"UGRO_MEMPROBE (\{.*\})", done.stdout)
    return {"exit": done.returncode} | (
        {"probe": json.loads(found.group(1))} if found else {"tail": (done.stdout + done.stderr)[-1500:]}
    )


def profiles(out: Path) -> None:
    """The shipped memory profiles (role memory_profile) on the default job, 16-bit and 4-bit, under their card's
    memory: the probe's peak must stay below 0.94 of it."""
    work = SCRATCH / "work"
    work.mkdir(parents=True, exist_ok=True)
    shipped = yaml.safe_load((REPO / "roles/memory_profile/defaults/main.yml").read_text())["memory_profile_profiles"]
    source = materialize(SMOLLM)
    default = yaml.safe_load((REPO / "jobs/default.yaml").read_text())
    for name, cap in (("gpu_12gb", 12), ("gpu_8gb", 8)):
        profile = work / f"{name}.yaml"
        profile.write_text(yaml.safe_dump(shipped[name]))
        for quant in ("none", "4bit"):
            job = work / f"default-{name}-{quant}.yaml"
            model = default["model"] | {"source": str(source), "init": "pretrained", "quantization": quant}
            job.write_text(yaml.safe_dump(default | {"model": model}, sort_keys=False))
            result = _probe(cap, job, profile)
            peak = (result.get("probe") or {}).get("peak_bytes")
            fits = peak is not None and not result["probe"].get("oom") and peak <= 0.94 * cap * 2**30
            _emit(out, {"what": "profile", "profile": name, "cap_gib": cap, "quantization": quant, "fits": fits,
                        "peak_gib": round(peak / 2**30, 2) if peak else None} | result)  # fmt: skip


def exporter(out: Path) -> None:
    """The node exporter on this GPU, scraped every second while the default job's architecture trains."""
    from prometheus_client.parser import text_string_to_metric_families

    work = SCRATCH / "work"
    work.mkdir(parents=True, exist_ok=True)
    port = 9839
    serve = subprocess.Popen([sys.executable, "-m", "ugro.module_utils.ugro_exporter", "serve", "--port", str(port),
                              "--runs-dir", str(work)], cwd=REPO, env=child_env())  # fmt: skip
    seen: dict[str, list[float]] = {}
    try:
        job = _job(work / "exporter.yaml", materialize(SMOLLM), "none", steps=40, seq_len=512, batch=8)
        trainer = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--nnodes=1", "--rdzv-backend=c10d",
             "--rdzv-endpoint=127.0.0.1:29531", "--max-restarts=0", "--module", "train.worker", "--job", str(job),
             "--run-dir", str(work / "exporter-run"), "--resume", "none", "--code-dir", str(REPO)],
            cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        text = ""
        while trainer.poll() is None:
            time.sleep(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                    text = answer.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.startswith("ugro_gpu_"):
                        seen.setdefault(sample.name, []).append(sample.value)
        (out / "metrics.txt").write_text(text)
        _emit(
            out,
            {
                "what": "exporter",
                "trainer_exit": trainer.returncode,
                "scrapes": len(seen.get("ugro_gpu_utilization_ratio", [])),
                "series": {k: [min(v), max(v)] for k, v in sorted(seen.items())},
            },
        )
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    parts = sys.argv[2:] or ["env", "train", "probe"]
    for part in parts:
        if part in ("compare", "packing"):
            getattr(gpu_compare, part)(out, _emit, materialize)
            continue
        if part == "multirank":
            gpu_multirank.multirank(out, _emit)
            continue
        {"env": env, "train": train, "probe": probe, "profiles": profiles, "exporter": exporter}[part](out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
