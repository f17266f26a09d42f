"""What the loss from hidden states (train/model/headloss.py) holds at once, and which heads it serves.

Torch-free: the stage planner (train/layout/stageplan.py) sizes the loss's memory from the same numbers on the
controller (``make plan``) and on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# One chunk's fp32 logits on CPU: 441 label tokens at a 151,936-token vocabulary. Every chunk reads the whole head
# weight twice (logits, gradient): at 128 MiB the loss at bench/headloss.py's shape took 1.3x the CPU time it takes
# at 256.
CHUNK_BYTES = 256 * 2**20
# On a GPU the chunk is what the loss adds to a step's peak over unsloth's own loss (its chunk and the model-dtype
# copy beside it: 0.375 GiB at 256 MiB for Llama-3-8B, measured 6.76 against 6.39 GiB on an H100,
# docs/gpu-results.md; at 128 MiB it measured 6.40, on an H200); at 128 MiB a chunk still reads the head weight at
# most twice per 261 tokens there.
CUDA_CHUNK_BYTES = 128 * 2**20


def chunk_bytes(device_kind: str) -> int:
    """One chunk's fp32 logits on a device of this kind ("cuda", "cpu")."""
    return CUDA_CHUNK_BYTES if device_kind == "cuda" else CHUNK_BYTES


# Config keys of models whose logits are transformed after the head (Gemma 2/3, Cohere, Granite), and the value
# that leaves them as they are.
TRANSFORMED_LOGITS = {"final_logit_softcapping": 0.0, "logit_scale": 1.0, "logits_scaling": 1.0}


def chunk_rows(vocab: int, size: int = CHUNK_BYTES) -> int:
    """Label tokens per chunk: as many rows of fp32 logits as ``size`` bytes hold (at least one)."""
    return max(1, size // (4 * vocab))


def transformed(config: Mapping[str, Any]) -> str | None:
    """The config key that transforms the logits after the head (so the loss needs the whole logits), or None."""
    for key, neutral in TRANSFORMED_LOGITS.items():
        value = config.get(key)
        if value is not None and float(value) != neutral:
            return key
    return None
