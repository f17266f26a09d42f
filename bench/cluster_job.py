"""The short job the test-cluster benchmarks launch: jobs/tiny.yaml with equal shares and no evaluation, written
beside the other jobs (the controller syncs jobs/ to the hosts) and removed afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def tiny_job(name: str, **sections: dict[str, Any]) -> Iterator[Path]:
    """``jobs/<name>.yaml``: the tiny job named ``name``, each of ``sections`` merged over the tiny job's own."""
    job = yaml.safe_load((REPO / "jobs" / "tiny.yaml").read_text())
    job |= {"name": name, "balance": "equal"}
    job.pop("eval", None)
    for key, values in sections.items():
        job[key] = {**job.get(key, {}), **values}
    path = REPO / "jobs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
