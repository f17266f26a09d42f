"""`make molecule`'s scheduler (tools/molecule_all.py): scenarios side by side, fewer while other work ends."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tools import molecule_all


def _recording_run(started: list[tuple[str, int]], then: dict[str, Path] | None = None) -> object:
    """A stand-in for one scenario's run: records how many ran side by side when it started; after the scenario
    named in ``then`` it makes that file."""
    lock = threading.Lock()
    running = [0]

    def run(scenario: str, logs: Path) -> molecule_all.Outcome:
        with lock:
            running[0] += 1
            started.append((scenario, running[0]))
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        if then and scenario in then:
            then[scenario].touch()
        return molecule_all.Outcome(scenario, 0, 0.2, logs / f"{scenario}.log")

    return run


def test_one_scenario_at_a_time_until_the_file_appears_then_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[str, int]] = []
    marker = tmp_path / "pytest.done"
    monkeypatch.setattr(molecule_all, "run", _recording_run(started, {"s2": marker}))  # other work ends after s2
    chosen = [f"s{i}" for i in range(7)]
    outcomes = molecule_all.run_all(chosen, tmp_path, jobs=3, fewer_until=marker)
    assert [o.scenario for o in outcomes] == chosen  # every scenario, reported in the order chosen
    assert started[:3] == [("s0", 1), ("s1", 1), ("s2", 1)], started  # alone while the file is missing
    assert max(side_by_side for _, side_by_side in started) == 3, started  # then three at a time


def test_without_the_option_the_jobs_run_from_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, int]] = []
    monkeypatch.setattr(molecule_all, "run", _recording_run(started))
    outcomes = molecule_all.run_all(["a", "b", "c", "d"], tmp_path, jobs=2, fewer_until=None)
    assert [o.scenario for o in outcomes] == ["a", "b", "c", "d"]
    assert [side_by_side for _, side_by_side in started[:2]] == [1, 2], started


def test_the_longest_scenarios_start_first_by_the_last_runs_times(tmp_path: Path) -> None:
    every = molecule_all.scenarios()
    times = {name: float(i) for i, name in enumerate(every)}  # the last one alphabetically... took longest
    del times[every[0]]  # a scenario the last run did not time (a new one) goes first
    order = molecule_all.scenarios(times)
    assert order[0] == every[0] and order[1:] == sorted(times, key=lambda n: -times[n]), order
    path = tmp_path / "cache" / "molecule-seconds.json"
    ran = [molecule_all.Outcome("firewall", 0, 155.4, path), molecule_all.Outcome("exporter", 2, 9.0, path)]
    molecule_all.write_times(path, ran)
    molecule_all.write_times(path, [molecule_all.Outcome("nccl_env", 0, 73.0, path)])
    assert molecule_all.read_times(path) == {"firewall": 155.4, "nccl_env": 73.0}  # a failed run's time is left out
    path.write_text("not json")
    assert molecule_all.read_times(path) == {}  # a damaged file only loses the order
