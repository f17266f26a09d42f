"""Role memory_profile on each host: the rendered profile holds exactly the expected knobs (tb1 cpu with its
override, tb2 the 8 GB class of its smaller GPU), and the trainer's own loader reads them.

Bad settings failing naming host and key are verify.yml's (molecule/conftest.py runs it last): they apply the role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from train.config import load_profile

testinfra_hosts = ["ansible://ugro_cluster"]

PROFILE = "/etc/ugro/profile.yaml"
EXPECTED = {
    "tb1": {"micro_batch_size": 8, "gradient_checkpointing": False},
    "tb2": {"micro_batch_size": 2, "gradient_checkpointing": True, "memory_gib": 7.2},
}


def test_the_profile_holds_exactly_the_expected_knobs(host: Any) -> None:
    profile = host.file(PROFILE)
    assert profile.is_file
    assert yaml.safe_load(profile.content_string) == EXPECTED[host.backend.get_hostname()]


def test_the_trainer_loads_the_profile(host: Any, tmp_path: Path) -> None:
    name = host.backend.get_hostname()
    copy = tmp_path / "profile.yaml"
    copy.write_bytes(host.file(PROFILE).content)
    assert load_profile(copy, name) == EXPECTED[name]
