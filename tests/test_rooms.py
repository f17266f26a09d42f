"""The code's rooms and which way their imports go (docs/architecture.md).

The rank code (train/) runs on every node and never imports the controller; the Ansible modules (library/)
run on the hosts and share only ugro/module_utils; inside the controller each room imports only the rooms
below it, so a room can be read, tested and moved with what it stands on and nothing else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The rooms the commands call into.
COMMANDS_CALL = {
    "ugro.hosts", "ugro.stack", "ugro.model", "ugro.run", "ugro.checks", "ugro.monitoring", "ugro.schedulers",
    "ugro.evaluation", "ugro.tracking",
}  # fmt: skip

# What each room of the controller may import besides itself (train/ and ugro.module_utils are open to all).
ALLOWED: dict[str, set[str]] = {
    "ugro.module_utils": set(),
    "ugro.stack": set(),
    "ugro.hosts": set(),
    "ugro.model": set(),
    "ugro.run": {"ugro.hosts", "ugro.monitoring"},
    "ugro.checks": {"ugro.hosts", "ugro.stack", "ugro.model", "ugro.run", "ugro.evaluation"},
    "ugro.monitoring": {"ugro.hosts"},
    # lm-evaluation-harness on a run's models (make eval), and the trackers fed from a run's records.
    "ugro.evaluation": {"ugro.model"},
    "ugro.tracking": {"ugro.model"},
    "ugro.schedulers": {"ugro.hosts", "ugro.checks", "ugro.model"},
    # One module per command: parsing and printing, the decisions in the rooms they call.
    "ugro.commands": COMMANDS_CALL,
    "ugro.cli": COMMANDS_CALL | {"ugro.commands"},
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _room(module: str) -> str | None:
    """``ugro.run.supervisor`` -> ``ugro.run``; ``ugro.cli`` -> ``ugro.cli``; None outside the controller."""
    parts = module.split(".")
    if parts[0] != "ugro" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def _files(top: str) -> list[Path]:
    return sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_controller_module_lives_in_a_room() -> None:
    loose = [p.name for p in (REPO / "ugro").glob("*.py") if p.name not in ("__init__.py", "cli.py")]
    assert not loose, f"ugro/{loose}: put it in the room of its concern (ugro/<concern>/)"
    rooms = {f"ugro.{p.name}" for p in (REPO / "ugro").iterdir() if (p / "__init__.py").is_file()}
    assert rooms | {"ugro.cli"} == set(ALLOWED), "a new room needs its place in ALLOWED (and docs/architecture.md)"


@pytest.mark.parametrize("path", _files("ugro"), ids=lambda p: str(p.relative_to(REPO)))
def test_a_room_imports_only_the_rooms_below_it(path: Path) -> None:
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    room = _room(module)
    assert room is not None
    wrong = sorted(
        name
        for name in _imports(path)
        if (target := _room(name)) is not None
        and target not in (room, "ugro.module_utils")
        and target not in ALLOWED[room]
    )
    assert not wrong, f"{module} ({room}) imports {wrong}; {room} may import {sorted(ALLOWED[room])}"


@pytest.mark.parametrize("top", ["train", "library"])
def test_code_that_runs_on_the_nodes_never_imports_the_controller(top: str) -> None:
    for path in _files(top):
        wrong = sorted(n for n in _imports(path) if _room(n) not in (None, "ugro.module_utils"))
        assert not wrong, f"{path.relative_to(REPO)} imports {wrong}: the nodes run {top}/ without the controller"


def test_the_product_does_not_import_the_development_tools() -> None:
    for top in ("ugro", "train", "library"):
        for path in _files(top):
            wrong = sorted(n for n in _imports(path) if n.split(".")[0] in ("tools", "tests", "testbed", "bench"))
            assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_the_controller_command_starts_without_torch() -> None:
    """`make status|logs|stop|doctor` and every poll of a followed run start `python -m ugro.cli`: torch (~2-4 s
    to import, the CUDA build the longest) is imported only by the commands that build a model."""
    code = "import sys, ugro.cli; print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
