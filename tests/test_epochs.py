"""How long a run trains (train.max_steps or train.epochs) and what `make validate` says of the data: rows after
packing, padding, steps an epoch, and rows with the trained tokens marked (SHOW=). A real run trained for
train.epochs: tests/test_make_train.py (Ctrl-C and make follow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, cli, small_job

from train.config import ConfigError, load_job
from ugro.checks import datafacts
from ugro.run import settings


def _job(tmp_path: Path, **train: object) -> Path:
    job = small_job(name="epochs")
    del job["train"]["max_steps"]
    job["train"] |= train
    path = tmp_path / "epochs.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_epochs_become_steps_from_the_rows_and_one_length_is_given(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, epochs=1.5))
    assert job.for_rows(204).train.max_steps == 39  # ceil(1.5 x 204 / 8)
    assert job.for_rows(40).train.max_steps == 8
    with pytest.raises(ConfigError, match=r"warmup_steps \(4\) must be smaller than the run's 3 steps"):
        job.for_rows(16)
    with pytest.raises(ConfigError, match=r"train\.max_steps and train\.epochs both say how long to train"):
        load_job(_job(tmp_path, epochs=1.5, max_steps=20))
    steps = load_job(_job(tmp_path, max_steps=20))
    assert steps.for_rows(204) is steps
    # A SET= of one replaces the other in the file: train.epochs=2 over a job that gives max_steps.
    _, over = settings.job_with(REPO / "jobs" / "default.yaml", ["train.epochs=2"], tmp_path)
    assert over.train.epochs == 2 and "max_steps" not in over.train.model_fields_set


def test_make_validate_counts_the_rows_and_shows_them_with_the_trained_tokens_marked(tmp_path: Path) -> None:
    found = datafacts.tokenized(load_job(_job(tmp_path, epochs=2)), REPO)
    assert found is not None
    facts = found.facts
    # Whole examples packed into 266 rows of 128: 33.25 steps an epoch at 8 a step, so 2 epochs are 67 steps.
    assert (facts.records, facts.rows, facts.seq_len, facts.steps) == (349, 266, 128, 67)
    assert facts.tokens == 266 * 128 - facts.padding + facts.dropped and 0 < facts.padding < 266 * 128 / 4

    shown = cli("validate", "--job", str(_job(tmp_path, epochs=2)), "--show", "2", timeout=120, env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "data: 349 records, 26,115 tokens -> 266 rows of 128" in out and "33.25 steps an epoch: 67 steps" in out
    assert "row 0 (128 tokens" in out and "row 1 (128 tokens" in out and "row 2" not in out
    marked = [part.split(datafacts.CLOSE)[0] for part in out.split(datafacts.OPEN)[1:]]
    assert marked, out
    # What is marked is answers: never the prompt's instruction header.
    assert not any("### Instruction" in m for m in marked), marked
