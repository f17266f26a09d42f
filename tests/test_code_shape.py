"""The shape the code keeps so that a newcomer can read it: state lives in objects their owner holds (no module-level
state that code changes in ``train/``), functions fit on a screen or two and take few arguments, and the command line
only parses and prints."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 80
MAX_PARAMETERS = 8
MUTATORS = frozenset({"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add",
                      "discard", "setdefault", "sort", "reverse", "appendleft", "difference_update"})  # fmt: skip


def _modules(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (REPO / room).rglob("*.py") if "__pycache__" not in p.parts)


def _module_names(tree: ast.Module) -> set[str]:
    """The names a module binds itself (assignments, classes, functions; not its imports)."""
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _changes_of_module_state(path: Path) -> list[str]:
    """Where code in a function changes what its module holds: ``global``, a module-level name mutated in place
    (``NAME.append``, ``NAME[k] = v``, ``NAME.attr = v``, ``NAME += ...``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    owned = _module_names(tree)
    found: list[str] = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        local = {a.arg for a in (*function.args.args, *function.args.kwonlyargs, *function.args.posonlyargs)}
        for node in ast.walk(function):
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            where = f"{shown}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Global):
                found.append(f"{where} global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = node.func.value
                if isinstance(receiver, ast.Name) and receiver.id in owned - local and node.func.attr in MUTATORS:
                    found.append(f"{where} {receiver.id}.{node.func.attr}(...)")
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    base = target.value if isinstance(target, ast.Subscript | ast.Attribute) else None
                    if isinstance(base, ast.Name) and base.id in owned - local:
                        found.append(f"{where} {ast.unparse(target)} = ...")
    return found


def test_no_module_level_state_in_the_ranks_code() -> None:
    """What lives as long as a rank (its group, stores, watcher, heartbeat, door, preemption) is held by an object the
    rank owns (train/recovery/membership.py), not in module globals that any code may change."""
    found = [change for path in _modules("train") for change in _changes_of_module_state(path)]
    assert found == [], "\n".join(found)


def test_the_check_finds_module_state_changed_in_place(tmp_path: Path) -> None:
    """Seen failing on the shapes the recovery code had (a list used as a global slot, a flag set through global)."""
    sample = tmp_path / "sample.py"
    sample.write_text("_SLOT: list[int] = []\n_flag = False\nclass _Box:\n    value = None\n\n"
                      "def put(x):\n    _SLOT.append(x)\n    _Box.value = x\n\n"
                      "def flag():\n    global _flag\n    _flag = True\n", encoding="utf-8")  # fmt: skip
    found = sorted(f.split(" ", 1)[1] for f in _changes_of_module_state(sample))
    assert found == ["_Box.value = ...", "_SLOT.append(...)", "global _flag"]


def _too_big(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        args = node.args
        named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        count = len(named) + (args.vararg is not None) + (args.kwarg is not None)
        count -= 1 if named and named[0].arg in ("self", "cls") else 0
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > MAX_LINES or count > MAX_PARAMETERS:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines, {count} parameters")
    return found


@pytest.mark.parametrize("room", ["train", "ugro"])
def test_no_function_is_longer_than_a_screenful_or_takes_more_than_eight_arguments(room: str) -> None:
    """Arguments that travel together are one value; a function longer than 80 lines is several."""
    found = [problem for path in _modules(room) for problem in _too_big(path)]
    assert found == [], "\n".join(found)


def test_the_command_line_only_parses_and_prints() -> None:
    """Every command's decisions live in the package of their concern (ugro/run/, ugro/checks/, ...); ugro/cli.py
    builds the command line from one module per command."""
    lines = len((REPO / "ugro" / "cli.py").read_text(encoding="utf-8").splitlines())
    assert lines < 300, f"ugro/cli.py has {lines} lines"


@pytest.mark.parametrize("room", ["train/balance", "train/dist"])
def test_balancing_and_the_process_groups_know_nothing_of_recovery(room: str) -> None:
    """The step's exchange carries "a newer group is proposed" as plain data and waits through the group's health
    (train/dist/health.py): what changes the group (train/recovery/) builds on them, never the other way round."""
    found = []
    for path in _modules(room):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.startswith("train.recovery")]
    assert found == [], "\n".join(found)
