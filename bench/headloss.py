"""`make bench-headloss`: the loss from the full logits against the loss from hidden states (train/model/headloss.py).

One head the size of Qwen2.5-0.5B's (151,936-token vocabulary, hidden 896), fp32, at seq 1,024 and micro-batch 4,
every position labelled (the new path skips unlabelled ones, which this leaves out of the comparison). Loss and
backward run once per rep, by the old path (the head's full logits, ``train/balance/step.py`` ``logits_loss``: upcast,
shift, cross-entropy summed) and by the new one (``train/model/headloss.py`` ``summed_loss``), each in a fresh
subprocess so their memory peaks do not mix. The head (``--head``): ``frozen`` (the default job's: LoRA on the
decoder only, the gradient goes to the hidden states), ``lora`` (peft's LoRA, r 16, on the frozen head, as when a
job lists ``lm_head``) or ``trained`` (the head's weight gets a gradient too; no ugro job does that).

Each rep is one loss + backward in a fresh process per path, the paths taking turns. Printed per path: the peak
memory of the loss part (the child's peak RSS, ``resource.getrusage`` ``ru_maxrss``, minus the same figure taken
in that child once its inputs exist and before any loss; tracemalloc does not see torch's allocations), the
median wall time and CPU time (all threads) of the reps, and the largest relative difference between the paths
of the loss and of every gradient (max |new - old| / max |old|). The goals: the new peak at most 1/4 of the old,
differences at most 1e-5, the new path no slower. Figures, not pass/fail: docs/results.md records a run.

    python -m bench.headloss [--head frozen|lora|trained] [--reps 2]
                             [--vocab 151936] [--hidden 896] [--seq 1024] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from train.balance.step import logits_loss
from train.model import headloss

REPO = Path(__file__).resolve().parent.parent


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor]:
    """The hidden states, the head (a Linear, or peft's LoRA Linear around one) and the labels, from a fixed seed."""
    torch.manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    linear = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.02)
    linear.weight.requires_grad_(args.head == "trained")
    head: torch.nn.Module = linear
    if args.head == "lora":
        from peft import LoraConfig, get_peft_model

        holder = torch.nn.Module()
        holder.lm_head = linear
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["lm_head"])
        lora_head: Any = cast(Any, get_peft_model(holder, lora)).base_model.model.lm_head
        with torch.no_grad():
            lora_head.lora_B["default"].weight.normal_(0, 0.02)  # peft starts B at 0: no gradient of A to compare
        head = lora_head
    labels = torch.randint(0, args.vocab, (args.batch, args.seq))
    return hidden, head, labels


def child(args: argparse.Namespace) -> None:
    """One loss + backward by one path, in this process: its figures as one JSON line, its loss and gradients into
    the file ``args.child``."""
    hidden, head, labels = _inputs(args)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    wall, cpu = time.perf_counter(), time.process_time()
    loss = logits_loss(head(hidden), labels) if args.path == "old" else headloss.summed_loss(head, hidden, labels)
    loss.backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    grads = {"hidden": hidden.grad} | {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
    torch.save({"loss": loss.detach(), **grads}, args.child)
    print(json.dumps({"peak_mib": peak / 1024, "wall_s": wall, "cpu_s": cpu}))


def run(path: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    shape = [f"--{key}={getattr(args, key)}" for key in ("vocab", "hidden", "seq", "batch")]
    argv = [sys.executable, "-m", "bench.headloss", "--child", str(out), "--path", path, "--head", args.head, *shape]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the {path} path failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", choices=["frozen", "lora", "trained"], default="frozen",
                        help="frozen; frozen with peft's LoRA (r 16) on it; its weight trained")  # fmt: skip
    parser.add_argument("--reps", type=int, default=2, help="processes per path; the median time is printed")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="the micro-batch")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=["old", "new"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    head = {"frozen": "a frozen head", "lora": "LoRA r 16 on a frozen head", "trained": "a trained head"}[args.head]
    print(f"vocab {args.vocab}, hidden {args.hidden}, seq {args.seq}, micro-batch {args.batch}, fp32, {head}; "
          f"{args.reps} runs per path, {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    figures: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="ugro-bench-headloss-") as tmp:
        for rep in range(args.reps):  # the paths take turns, so a change in the machine's load hits both alike
            for path in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                figures[path].append(run(path, args, Path(tmp) / f"{path}.pt"))
        old, new = (torch.load(Path(tmp) / f"{path}.pt") for path in ("old", "new"))
    summary = {}
    for path, runs in figures.items():
        peak = max(r["peak_mib"] for r in runs)
        wall, cpu = statistics.median(r["wall_s"] for r in runs), statistics.median(r["cpu_s"] for r in runs)
        summary[path] = (peak, wall, cpu)
        each = ", ".join(f"{r['wall_s']:.1f}" for r in runs)
        print(f"{path}: peak {peak:.0f} MiB above the inputs; {wall:.2f} s median ({each}), {cpu:.2f} CPU-s median")
    diffs = {name: float((new[name] - ref).abs().max() / ref.abs().max()) for name, ref in old.items()}
    print("largest relative difference: " + ", ".join(f"{name} {d:.1e}" for name, d in diffs.items()))
    ratios = [summary["new"][i] / summary["old"][i] for i in range(3)]
    print(json.dumps({"peak_new_over_old": round(ratios[0], 4), "time_new_over_old": round(ratios[1], 3),
                      "cpu_new_over_old": round(ratios[2], 3), "max_rel_diff": max(diffs.values())}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
