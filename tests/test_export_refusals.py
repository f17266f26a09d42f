"""`make export` refuses bad input with one line naming what to fix, before anything slow starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli

from train.config import ConfigError
from ugro.model import gguf_export


def _export(runs: Path, *args: str) -> tuple[int, str]:
    done = cli("export", *args, env={"UGRO_RUNS_DIR": str(runs), "COLUMNS": "300"}, timeout=120)
    return done.returncode, done.stderr.strip()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--format", "zip"), "FORMAT=zip: choose merged (safetensors, the default) or gguf"),
        (("--format", "gguf", "--quant", "q3,f16"), "QUANT='q3,f16': q3 is not a GGUF type ugro writes; choose from"),
        (("--format", "gguf", "--job-id", "nope"), "nope/adapter: no adapter here"),
    ],
)
def test_bad_export_input_is_one_clear_error(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    code, stderr = _export(tmp_path, *args)
    assert code == 2 and len(stderr.splitlines()) == 1 and says in stderr and "Traceback" not in stderr, stderr


def test_types_are_parsed_once_each_in_order() -> None:
    assert gguf_export.parse_types(" Q8_0, f16,q8_0 ") == ("q8_0", "f16")
    with pytest.raises(ConfigError, match="no type"):
        gguf_export.parse_types(" , ")


def test_a_run_that_did_not_record_its_job_is_told_to_name_it(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"state": "finished"}))
    with pytest.raises(ConfigError, match=r"did not record its job.*pass --job"):
        gguf_export.job_of(tmp_path)
