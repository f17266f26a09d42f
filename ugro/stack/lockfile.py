"""The locks as the product reads them: what each kind of host installs, per Python (requirements/locks/).

    requirements/locks/py3.X/node.txt        every node (the trainer)
    requirements/locks/py3.X/gpu.txt         a host with an NVIDIA GPU adds these (unsloth)
    requirements/locks/py3.X/controller.txt  the controller's .venv adds these (Ansible, the CLI, the test tools)
    requirements/locks/py3.X/mlflow-server.txt  an MLflow tracking server's own venv (make mlflow-server)

`make lock` (tools/lock.py) writes them; preflight, the stack check and the tests read them through here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements"
LOCKS = REQUIREMENTS / "locks"
PYTHONS = ("3.11", "3.12", "3.13")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """One package of a lock: its name as written, version, and the lines that pin it (hashes included)."""

    name: str
    version: str
    text: str


def parse(text: str) -> dict[str, Pin]:
    """The pins of uv's requirements output (`name==version \\` and its indented `--hash` lines)."""
    pins: dict[str, Pin] = {}
    block: list[str] = []

    def close() -> None:
        if block:
            name, _, rest = block[0].partition("==")
            version = rest.split()[0].rstrip("\\").strip()
            pins[canonical(name)] = Pin(name.strip(), version, "\n".join(block))

    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            close()
            block = [line.rstrip()]
        else:
            block.append(line.rstrip())
    close()
    return pins


def read(path: Path) -> dict[str, Pin]:
    return parse(path.read_text())


def omitted(path: Path) -> list[str]:
    """The packages a lock file says it leaves out on purpose (`# ugro-omits: name (why)` lines)."""
    return [canonical(m) for m in re.findall(r"^# ugro-omits: (\S+)", path.read_text(), re.M)]


def excluded(path: Path) -> list[str]:
    """The packages a lock file resolves without on purpose (`# ugro-excludes: name (why)` lines): sources only."""
    return [canonical(m) for m in re.findall(r"^# ugro-excludes: (\S+)", path.read_text(), re.M)]
