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
