"""`make bench-pipeline`'s arithmetic (bench/pipeline.py): the split it runs as "planned", the 1F1B estimate and the
bounds it prints. No ranks: the benchmark itself is figures, not pass/fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench import Setup
from bench.pipeline import _model, best_split, busy_s, micro_batches, model_rate, planned_split

SPEEDS = (1.0, 0.6, 0.5)
SETUP = Setup(SPEEDS, 0.3, 1e-3, steps=12, skip=3, global_batch=48, micro_batch=4, seq_len=64)


def test_planned_split_gives_the_faster_devices_more_layers(tmp_path: Path) -> None:
    counts, speeds = planned_split(SETUP, _model(12, tmp_path), SPEEDS, tmp_path)
    assert sum(counts) == 12 and sorted(speeds) == sorted(SPEEDS)
    by_speed = dict(zip(speeds, counts, strict=True))
    assert by_speed[1.0] > by_speed[0.5]
    # Its slowest stage (decoder layers only, as the emulation charges them) beats the equal split's.
    assert max(busy_s(SETUP, counts, speeds)) < max(busy_s(SETUP, [4, 4, 4], list(SPEEDS)))


def test_a_balanced_split_reaches_the_1f1b_bound() -> None:
    m = micro_batches(SETUP, 3)
    assert m == 12
    ideal = sum(SPEEDS) / SETUP.seconds_per_token
    # Layers in proportion to speed (21 layers: 10 / 6 / 5): every stage as busy, the bubble (S - 1) of M + S - 1.
    assert model_rate(SETUP, [10, 6, 5], list(SPEEDS)) == pytest.approx(ideal * m / (m + 2))
    assert model_rate(SETUP, [4, 4, 4], list(SPEEDS)) < model_rate(SETUP, [6, 3, 3], list(SPEEDS))


def test_the_best_split_for_the_emulation_puts_the_most_layers_on_the_fastest_device() -> None:
    assert best_split(SETUP, 12, SPEEDS) == ([6, 3, 3], [1.0, 0.6, 0.5])
