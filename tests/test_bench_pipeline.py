"""`make bench-pipeline`'s arithmetic (bench/pipeline.py): the split it runs as "planned", the 1F1B estimate and the
bounds it prints. No ranks: the benchmark itself is figures, not pass/fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench import Setup
from bench.pipeline import _model, best_split, busy_s, micro_batches, model_rate, planned_split
from train.layout.stageplan import ModelShape

SPEEDS = (1.0, 0.6, 0.5)
SETUP = Setup(SPEEDS, 0.3, 1e-3, steps=12, skip=3, global_batch=48, micro_batch=4, seq_len=64)


def test_the_planned_split_is_the_best_one_for_the_emulated_devices(tmp_path: Path) -> None:
    """The planner's counts and device order equal the brute-force best by the 1F1B estimate, with the head charged
    to the last stage as both the planner and the emulation charge it; and beat the equal split."""
    model = _model(12, tmp_path)
    head = ModelShape.from_dir(model).head_work
    counts, speeds = planned_split(SETUP, model, SPEEDS, tmp_path)
    assert sum(counts) == 12 and sorted(speeds) == sorted(SPEEDS)
    assert (counts, speeds) == best_split(SETUP, 12, SPEEDS, head)
    assert max(busy_s(SETUP, counts, speeds, head)) < max(busy_s(SETUP, [4, 4, 4], list(SPEEDS), head))


def test_a_balanced_split_reaches_the_1f1b_bound() -> None:
    m = micro_batches(SETUP, 3)
    assert m == 12
    ideal = sum(SPEEDS) / SETUP.seconds_per_token
    # Layers in proportion to speed (21 layers: 10 / 6 / 5): every stage as busy, the bubble (S - 1) of M + S - 1.
    assert model_rate(SETUP, [10, 6, 5], list(SPEEDS), 0.0) == pytest.approx(ideal * m / (m + 2))
    assert model_rate(SETUP, [4, 4, 4], list(SPEEDS), 0.0) < model_rate(SETUP, [6, 3, 3], list(SPEEDS), 0.0)
    assert best_split(SETUP, 12, SPEEDS, 0.0) == ([6, 3, 3], [1.0, 0.6, 0.5])  # without a head: fastest first
