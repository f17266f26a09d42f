"""The held-out perplexity task's per-document figures, for lm-evaluation-harness (standard library only).

ugro/evaluation/tasks.py copies this file beside the generated task as ``utils.py``, where the task's YAML names
``process_results: !function utils.process_results``: the task directory then runs under ``lm_eval --include_path``
alone, without ugro. Each document carries the answer's token count (the run's tokenizer) and UTF-8 byte count, so
that lm-eval's aggregations give figures per token and per byte, comparable across answers of any length.
"""

from __future__ import annotations

from typing import Any


def process_results(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, Any]:
    """lm-eval's loglikelihood result of the answer given the prompt -> the items each metric aggregates:
    token_perplexity (exp of the mean loss per answer token, as the training's held-out loss is), bits_per_byte and
    byte_perplexity."""
    loglikelihood = float(results[0][0])
    return {
        "token_perplexity": (loglikelihood, int(doc["answer_tokens"])),
        "bits_per_byte": (loglikelihood, int(doc["answer_bytes"])),
        "byte_perplexity": (loglikelihood, int(doc["answer_bytes"])),
    }
