"""A JSON object from a model's or a run's directory (config.json, run.json, ...), read leniently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_object(path: Path) -> dict[str, Any]:
    """The file's JSON object; an empty one when the file is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
