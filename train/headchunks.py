"""What the loss from hidden states (train/headloss.py) holds at once, and which heads it serves.

Torch-free: the stage planner (train/stageplan.py) sizes the loss's memory from the same numbers on the
controller (``make plan``) and on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# One chunk's fp32 logits: 441 label tokens at a 151,936-token vocabulary. Every chunk reads the whole head weight
# twice (logits, gradient): at 128 MiB the loss at bench/headloss.py's shape took 1.3x the CPU time it takes at 256.
CHUNK_BYTES = 256 * 2**20

# Config keys of models whose logits are transformed after the head (Gemma 2/3, Cohere, Granite), and the value
# that leaves them as they are.
TRANSFORMED_LOGITS = {"final_logit_softcapping": 0.0, "logit_scale": 1.0, "logits_scaling": 1.0}


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Label tokens per chunk: as many rows of fp32 logits as ``chunk_bytes`` holds (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def transformed(config: Mapping[str, Any]) -> str | None:
    """The config key that transforms the logits after the head (so the loss needs the whole logits), or None."""
    for key, neutral in TRANSFORMED_LOGITS.items():
        value = config.get(key)
        if value is not None and float(value) != neutral:
            return key
    return None
