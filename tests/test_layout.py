"""The three rooms stay apart: rank code imports nothing of the controller's, nodes receive only rank
code, and every host module documents itself the way ansible-doc reads it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from ugro.module_utils import ugro_codetree

REPO = Path(__file__).resolve().parent.parent
ANSIBLE_DOC = Path(sys.executable).parent / "ansible-doc"


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_rank_code_imports_nothing_of_the_controller_or_benchmarks() -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(_imported_roots(path) & {"ugro", "bench", "molecule", "ansible"})
        for path in sorted((REPO / "train").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_every_function_of_the_rank_code_reads_in_one_screen() -> None:
    """No function or method in train/ is over 80 lines (the loop is a sequence of named steps: train/loop.py)."""
    longer = {}
    for path in sorted((REPO / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    longer[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert longer == {}, "split these into named steps: " + ", ".join(f"{k} ({v} lines)" for k, v in longer.items())


# train/ by concern (docs/architecture.md "train/"): the root holds the entry points, the loop and what the loop
# records; everything else lives in the room of its concern.
TRAIN_ROOT = {"__init__", "config", "worker", "launcher", "loop", "metrics", "schedule", "digest"}
TRAIN_ROOMS = {"data", "model", "layout", "balance", "recovery", "dist", "tools", "preference"}


def _train_module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path) -> set[str]:
    """The train modules ``path`` imports when it is imported (module level; an import inside a function is
    made when it runs, and may point up)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "train":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _module_path(candidate) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "train")
    return {name for name in found if _module_path(name)}


def _module_path(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_rank_code_lives_in_the_room_of_its_concern() -> None:
    root = {p.stem for p in (REPO / "train").glob("*.py")}
    rooms = {p.name for p in (REPO / "train").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert root == TRAIN_ROOT, f"train/ holds the entry points and the loop; put {sorted(root - TRAIN_ROOT)} in a room"
    assert rooms == TRAIN_ROOMS, f"new rooms {sorted(rooms - TRAIN_ROOMS)}: name them here and in docs/architecture.md"
    documented = (REPO / "docs" / "architecture.md").read_text()
    for path in sorted((REPO / "train").rglob("*.py")):
        if path.stem != "__init__":
            assert f"`{path.relative_to(REPO / 'train').with_suffix('')}`" in documented or (
                f"`{path.stem}`" in documented
            ), f"{path.relative_to(REPO)} is not in docs/architecture.md"


def test_rank_modules_import_each_other_in_one_order() -> None:
    """No cycle among train/'s module-level imports: each module can be read after the ones it imports."""
    graph = {_train_module(p): _module_imports(p) for p in sorted((REPO / "train").rglob("*.py"))}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import cycle: " + " -> ".join([*path[path.index(name) :], name])
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            if dep != name:
                visit(dep, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_nodes_receive_rank_code_and_no_controller_code() -> None:
    files = ugro_codetree.code_files(REPO)
    python = [f for f in files if f.endswith(".py")]
    assert "train/worker.py" in python and "train/loop.py" in python
    outside = [f for f in python if not f.startswith(("train/", "data/", "models/"))]
    assert outside == [], f"Python outside the rank package would be synced to every node: {outside}"


def test_every_host_module_documents_its_options() -> None:
    modules = sorted(p.stem for p in (REPO / "library").glob("*.py"))
    assert modules, "no host modules in library/"
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
    out = subprocess.run(
        [str(ANSIBLE_DOC), "--json", *modules], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    docs = json.loads(out.stdout)
    for name in modules:
        doc = docs[name]["doc"]
        assert doc["short_description"], name
        assert docs[name]["return"], f"{name}: no RETURN documentation"


def _named_in_architecture(path: Path, room: Path, documented: str) -> bool:
    """``path`` named in backticks: by its path in the repository or in its room, with or without its suffix, or by
    its file name or stem."""
    rel, inside = path.relative_to(REPO), path.relative_to(room)
    names = {str(rel), str(rel.with_suffix("")), str(inside), str(inside.with_suffix("")), path.name, path.stem}
    return any(f"`{name}`" in documented for name in names)


def test_every_controller_testbed_module_and_playbook_is_in_the_architecture_page() -> None:
    """docs/architecture.md names every module of ugro/ and testbed/ and every playbook, as it does train/'s."""
    documented = (REPO / "docs" / "architecture.md").read_text()
    rooms = {"ugro": "*.py", "testbed": "*.py", "playbooks": "*.yml"}
    missing = [
        str(path.relative_to(REPO))
        for room, pattern in rooms.items()
        for path in sorted((REPO / room).rglob(pattern))
        if path.stem != "__init__" and not _named_in_architecture(path, REPO / room, documented)
    ]
    assert missing == [], f"not in docs/architecture.md: {missing}"
