"""Settings on the command line (`make train SET="optim.lr=1e-4 train.max_steps=200"`, ugro/run/settings.py): read
as YAML values, laid over the job file into a job file of their own, checked as any job file. A real run with
SET= through make: tests/test_make_train.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, cli

from train.config import ConfigError
from ugro.run import settings


def test_values_are_read_as_yaml_with_numbers_as_numbers() -> None:
    parsed = settings.parse(["optim.lr=1e-4", "train.max_steps=200", "lora.target_modules=[q_proj, v_proj]",
                             "eval=null", "name=my-run", "data.packing=false"])  # fmt: skip
    assert parsed == {"optim.lr": 1e-4, "train.max_steps": 200, "lora.target_modules": ["q_proj", "v_proj"],
                      "eval": None, "name": "my-run", "data.packing": False}  # fmt: skip
    for bad in ("optim.lr", "=3", "optim..lr=1", ".lr=1"):
        with pytest.raises(ConfigError, match="is not key=value"):
            settings.parse([bad])


def test_settings_land_in_a_job_file_of_their_own_and_the_original_is_untouched(tmp_path: Path) -> None:
    original = REPO / "jobs" / "default.yaml"
    before = original.read_text()
    path, job = settings.job_with(original, ["optim.lr=1e-4", "train.max_steps=50"], tmp_path)
    assert (job.optim.lr, job.train.max_steps) == (1e-4, 50) and original.read_text() == before
    written = yaml.safe_load(path.read_text())
    assert written["optim"]["lr"] == 1e-4 and written["model"] == yaml.safe_load(before)["model"]
    assert path.parent == tmp_path / "jobs" / ".set" and (path.parent / ".gitignore").read_text() == "*\n"
    assert 'with SET="optim.lr=1e-4 train.max_steps=50"' in path.read_text().splitlines()[0]
    assert settings.job_with(original, [], tmp_path) == (original, settings.load_job(original))


def test_a_bad_setting_is_one_error_naming_the_key_and_leaves_no_file(tmp_path: Path) -> None:
    original = REPO / "jobs" / "default.yaml"
    with pytest.raises(ConfigError, match=r"default.yaml with SET=\"optim.lrr=1\": unknown key 'optim.lrr'"):
        settings.job_with(original, ["optim.lrr=1"], tmp_path)
    with pytest.raises(ConfigError, match=r"key 'train.max_steps'"):
        settings.job_with(original, ["train.max_steps=many"], tmp_path)
    with pytest.raises(ConfigError, match=r"'optim\.lr' is a value in the job file, not a section"):
        settings.job_with(original, ["optim.lr.x=1"], tmp_path)
    assert not list((tmp_path / "jobs" / ".set").glob("*.yaml"))
    # Through the CLI: exit 2, one line, no traceback.
    refused = cli("validate", "--job", "jobs/default.yaml", "--set", "optim.lrr=1", timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "unknown key 'optim.lrr'" in " ".join(refused.stderr.split())


def test_a_list_setting_is_shown_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    """`make train SET="report_to=[mlflow]"` echoes the settings it laid over the job file: a list's brackets are
    text, not console markup (they were swallowed: 'with report_to= ...')."""
    from ugro.commands.common import with_settings

    path = with_settings(REPO / "jobs" / "default.yaml", ["report_to=[mlflow]", "eval.tasks=[heldout]"])
    try:
        shown = " ".join(capsys.readouterr().out.split())
        assert "with report_to=[mlflow] eval.tasks=[heldout]:" in shown, shown
    finally:
        (REPO / path if not path.is_absolute() else path).unlink()
