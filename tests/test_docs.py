"""The docs name only what exists: every `make` target they show is in the Makefile, every repository
path they put in backticks is in the tree, every relative link lands on a file (and a heading), and the
README stays a page a newcomer reads in one sitting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "tests" / "README.md", *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 220

# A backticked token is taken for a repository path when it starts with one of these top-level directories.
TOP_DIRS = (
    "bench", "data", "docs", "inventory", "jobs", "library", "models", "molecule", "playbooks",
    "requirements", "roles", "testbed", "tests", "tools", "train", "ugro",
)  # fmt: skip
# Tokens with a placeholder name a family of paths, not one.
PLACEHOLDERS = ("<", ">", "*", "…", "...", "{", "}", "|", "py3.X", "$")

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
MAKE = re.compile(r"(?:^|[\s`(])make\s+((?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)([a-z][a-z0-9-]*(?:\|[a-z][a-z0-9-]*)*)")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _code(text: str) -> list[str]:
    """The text of every fenced block and inline code span."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return blocks + INLINE_CODE.findall(prose)


def makefile_targets() -> set[str]:
    """Every target the Makefile defines: rule heads (`status logs stop: venv`) and `.PHONY` names."""
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        if not line or line[0] in "\t#" or "$" in line.split(":", 1)[0]:
            continue
        head, sep, rest = line.partition(":")
        if not sep or rest.startswith("=") or re.search(r"[?+:]?=\s*$", head) or "=" in head:
            continue
        names = head.split()
        if names == [".PHONY"]:
            targets.update(rest.split())
        elif not head.startswith("."):
            targets.update(names)
    return targets


def make_targets_named(text: str) -> set[str]:
    named: set[str] = set()
    for code in _code(text):
        for match in MAKE.finditer(code):
            named.update(match.group(2).split("|"))
    return named


def _is_repo_path(token: str) -> bool:
    return "/" in token and token.split("/", 1)[0] in TOP_DIRS


def repo_paths_named(text: str) -> set[str]:
    """Backticked single tokens that name a file or directory of the repository."""
    paths: set[str] = set()
    prose = FENCE.sub("", text)
    for span in INLINE_CODE.findall(prose):
        for token in span.split():
            token = token.split("::", 1)[0].rstrip(".,;)")
            if not _is_repo_path(token) or any(p in token for p in PLACEHOLDERS):
                continue
            if ":" in token:  # a quoted message (`data/x.jsonl:2: ...`), not a path
                continue
            if token.startswith(("runs/", ".venv")):
                continue
            paths.add(token)
    return paths


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_make_target_named_exists(doc: Path) -> None:
    missing = sorted(make_targets_named(doc.read_text()) - makefile_targets())
    assert missing == [], f"{_rel(doc)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_repository_path_named_exists(doc: Path) -> None:
    missing = sorted(p for p in repo_paths_named(doc.read_text()) if not (REPO / p.rstrip("/")).exists())
    assert missing == [], f"{_rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves(doc: Path) -> None:
    broken: list[str] = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert broken == [], f"{_rel(doc)} has broken links: {broken}"


def test_the_readme_stays_short() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; topics belong in docs/"


def test_the_readme_links_every_docs_page() -> None:
    text = (REPO / "README.md").read_text()
    unlinked = [_rel(p) for p in sorted((REPO / "docs").glob("*.md")) if f"]({_rel(p)})" not in text]
    assert unlinked == [], f"README.md does not link {unlinked}"


# Narration of what earlier versions did, which belongs in CHANGELOG.md: the docs say what is.
HISTORY = re.compile(r"\b(used to|before this change|earlier versions?|previously|formerly)\b", re.I)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "CHANGELOG.md"], ids=_rel)
def test_the_docs_say_what_is_not_what_was(doc: Path) -> None:
    found = [m.group(0) for m in HISTORY.finditer(FENCE.sub("", doc.read_text()))]
    assert found == [], f"{_rel(doc)} narrates history ({found}): move it to CHANGELOG.md"


def test_the_checks_see_what_they_should() -> None:
    """The parsers themselves, on a sample: a multi-target rule, a variable before the target, a
    placeholder path, a path under runs/, and a link with a heading."""
    sample = (
        "Run `make status|logs|stop` or\n```sh\nmake SCENARIO=x molecule\nmake testbed-up N=3\n```\n"
        "`ugro/cli.py`, `roles/<role>/tasks/`, `runs/x/y`, `jobs/x.yaml: unknown key`, `train.max_restarts`\n"
        "Nothing to make sure of here.\n"
    )
    assert make_targets_named(sample) == {"status", "logs", "stop", "molecule", "testbed-up"}
    assert repo_paths_named(sample) == {"ugro/cli.py"}
    assert {"status", "logs", "stop", "train", "venv"} <= makefile_targets()
    assert slug("Provisioning: `make provision`") == "provisioning-make-provision"
