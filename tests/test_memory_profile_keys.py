"""The memory_profile role and the trainer agree on what a memory profile may hold.

The trainer's RankLocalConfig (train/config.py) is the one definition: the role keeps no list of its
own and checks what it renders with the trainer's check_profile. Every default profile the role
renders must load with the trainer's load_profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from train.config import RankLocalConfig, load_profile

ROLE = Path(__file__).resolve().parent.parent / "roles" / "memory_profile"


def _to_nice_yaml(data: Any, indent: int = 4) -> str:
    """Ansible's to_nice_yaml for plain data. Not imported from ansible: importing ansible in the
    test process patches sys.intern, which breaks torch._dynamo for every later test."""
    return yaml.safe_dump(data, indent=indent, default_flow_style=False, allow_unicode=True)


def _yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def test_the_role_keeps_no_list_of_knobs_of_its_own() -> None:
    tasks = (ROLE / "tasks" / "validate.yml").read_text()
    assert "train.config import ConfigError, check_profile" in tasks
    assert not (ROLE / "vars").exists()
    for key in RankLocalConfig.model_fields:  # the knobs appear nowhere in the role's tasks
        assert key not in tasks, key


def test_argument_specs_mirror_default_profiles() -> None:
    defaults = _yaml(ROLE / "defaults" / "main.yml")
    options = _yaml(ROLE / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    for name in ("memory_profile_profiles", "memory_profile_vram_classes", "memory_profile_name"):
        assert options[name]["default"] == defaults[name], name


@pytest.mark.parametrize("profile", sorted(_yaml(ROLE / "defaults" / "main.yml")["memory_profile_profiles"]))
def test_default_profile_renders_and_loads(profile: str, tmp_path: Path) -> None:
    knobs = _yaml(ROLE / "defaults" / "main.yml")["memory_profile_profiles"][profile]
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["to_nice_yaml"] = _to_nice_yaml
    text = env.from_string((ROLE / "templates" / "profile.yaml.j2").read_text()).render(
        inventory_hostname="node1",
        __memory_profile_selected=profile,
        __memory_profile_reason="chosen in a test",
        __memory_profile_knobs=knobs,
    )
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    assert load_profile(path, "node1") == knobs
    RankLocalConfig.model_validate(knobs)
