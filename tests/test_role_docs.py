"""Every role's README is what tools/role_docs.py writes from the role (make role-docs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import role_docs


@pytest.mark.parametrize("role", role_docs.roles(), ids=lambda role: role.name)
def test_the_readme_is_generated_from_the_role(role: Path) -> None:
    readme = role / "README.md"
    assert readme.exists(), f"{readme} is missing: run make role-docs"
    assert readme.read_text() == role_docs.render(role), f"{readme} is stale: run make role-docs"


def test_the_hand_written_part_is_kept(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\ngenerated\n{role_docs.HAND_BEGIN}\nmine\n{role_docs.HAND_END}\n")
    assert role_docs.hand_written(readme) == "mine"


def test_ansible_markup_becomes_markdown() -> None:
    assert role_docs.markup("O(a) is C(b), I(c), L(d,https://e)") == "`a` is `b`, *c*, [d](https://e)"
