"""Settings on the command line: ``make train JOB=... SET="optim.lr=1e-4 train.max_steps=200"``.

Each setting is ``dotted.key=value``, the value read as YAML (``1e-4`` and other numbers as numbers,
``[q_proj, v_proj]`` as a list, ``null`` as nothing). They are laid over the job file into a job file of their own,
``jobs/.set/<name>-<hash>.yaml`` (inside the code the hosts get, ignored by git), which is then checked as any job
file is and launched in its place: the ranks train exactly it, and the run's ``run.json`` ``job`` records it.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from train.config import ConfigError, JobConfig, load_job

DIRECTORY = Path("jobs") / ".set"
# Keys of which a job gives one: setting either replaces the other one the file gives.
ONE_OF = {"train.epochs": "train.max_steps", "train.max_steps": "train.epochs"}
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse(settings: list[str]) -> dict[str, Any]:
    """``["optim.lr=1e-4", ...]`` -> ``{"optim.lr": 0.0001, ...}``; ConfigError naming a setting that is not
    ``key=value``."""
    found: dict[str, Any] = {}
    for setting in settings:
        key, equals, text = setting.partition("=")
        key = key.strip()
        if not equals or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"SET: '{setting}' is not key=value (e.g. SET=\"optim.lr=1e-4 train.max_steps=200\")")
        found[key] = _value(text.strip())
    return found


def _value(text: str) -> Any:
    if _NUMBER.fullmatch(text):  # YAML 1.1 reads 1e-4 as text: a number here
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply(raw: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The job file's mapping with each setting laid over it (sections made where the file has none)."""
    merged = copy.deepcopy(raw)
    for key, value in settings.items():
        other = ONE_OF.get(key)
        if other is not None and other not in settings:  # train.epochs=2 over a file that gives max_steps
            merged.get("train", {}).pop(other.split(".")[1], None)
        node = merged
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"SET {key}: '{where}' is a value in the job file, not a section of keys")
            node = child
        node[parts[-1]] = value
    return dict(merged)


def job_with(job_file: Path, settings: list[str], repo: Path) -> tuple[Path, JobConfig]:
    """The job file to launch with ``settings`` over ``job_file`` (``job_file`` itself when there are none), and the
    job it holds; ConfigError naming the job file, ``SET`` and the key when the result is not a valid job."""
    if not settings:
        return job_file, load_job(job_file)
    parsed = parse(settings)
    load_job(job_file)  # the file itself first: its errors name it
    merged = apply(yaml.safe_load(job_file.read_text(encoding="utf-8")) or {}, parsed)
    text = yaml.safe_dump(merged, sort_keys=False)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    path = repo / DIRECTORY / f"{job_file.stem}-{digest}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / ".gitignore").write_text("*\n")
    shown = " ".join(settings)
    path.write_text(f'# {job_file} with SET="{shown}" (ugro/run/settings.py)\n{text}')
    try:
        return path, load_job(path)
    except ConfigError as exc:
        path.unlink(missing_ok=True)
        raise ConfigError(str(exc).replace(str(path), f'{job_file} with SET="{shown}"')) from None
