"""`make doctor`: each known failure, planted as the log lines it really produces, names host, cause and fix."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import cli

from ugro.checks import doctor

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"

# case -> (host, a word the cause must contain, a word the fix must contain)
EXPECTED = {
    "nccl-cuda": ("node4070", "NCCL", "NCCL_DEBUG"),
    "connect": ("node3070", "connect", "29500"),
    "cuda-oom": ("node3070", "memory", "rank_local.micro_batch_size"),
    "nan": ("master", "NaN", "optim.lr"),
    "driver-mismatch": ("node4070", "kernel module", "reboot"),
    "sm120": ("master", "sm_120", "cu130"),
    "name-resolution": ("node4070", "resolve", "/etc/hosts"),
    "ddp-ready-twice": ("node3070", "twice", "non-reentrant"),
    "never-joined": ("node3070", "never joined", "torchrun.log"),
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_each_planted_failure_names_host_cause_and_fix(case: str) -> None:
    host, cause, fix = EXPECTED[case]
    findings = doctor.diagnose(FIXTURES / case)
    assert [(f.host, f.key) for f in findings] == [(host, case)], findings
    assert cause.lower() in findings[0].cause.lower() and fix in findings[0].fix, findings[0]
    assert findings[0].evidence.startswith("logs/"), findings[0]


def test_a_clean_run_has_no_finding() -> None:
    assert doctor.diagnose(FIXTURES / "clean") == []


def _doctor(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("doctor", "--run-dir", str(run_dir), *args, timeout=60)


def test_the_cli_prints_json_and_fails_on_a_finding(tmp_path: Path) -> None:
    result = _doctor(FIXTURES / "cuda-oom", "--json")
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)["findings"]
    assert [(f["host"], f["key"]) for f in found] == [("node3070", "cuda-oom")]
    table = _doctor(FIXTURES / "clean")
    assert table.returncode == 0 and "no known failure" in table.stdout, table.stdout + table.stderr
    missing = _doctor(tmp_path / "nope")
    assert (
        missing.returncode == 2
        and "no such run directory" in " ".join(missing.stderr.split())
        and "Traceback" not in missing.stderr
    )
