"""The preflight's report: one row per check, one cell per host, PASS / WARN / FAIL / SKIP, with the cause and the
fix of every cell that is not PASS; the thresholds the rows judge by; a row where every host must report the same."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
ORDER: dict[str, int] = {"PASS": 0, "SKIP": 1, "WARN": 2, "FAIL": 3}
GIB = 1 << 30


@dataclass
class Cell:
    status: Status
    detail: str = ""
    cause: str = ""
    fix: str = ""


@dataclass
class Check:
    name: str
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class Thresholds:
    min_free_gb: float = 2.0  # free disk for checkpoints on the main host
    busbw_floor_gbps: float = 0.05  # GB/s (nccl-tests' unit); 1 GbE tops out near 0.117
    clock_skew_warn_s: float = 1.0
    memory_headroom: float = 0.90  # WARN when the peak is above this share of the device


@dataclass
class Report:
    hosts: list[str]
    main_host: str
    checks: list[Check] = field(default_factory=list)
    measurements: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> figures

    def row(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def failed(self, rows: tuple[str, ...] | None = None) -> bool:
        return any(
            cell.status == "FAIL" for c in self.checks if rows is None or c.name in rows for cell in c.cells.values()
        )

    def problems(self) -> list[tuple[str, str, Cell]]:
        return [
            (c.name, h, cell) for c in self.checks for h, cell in c.cells.items() if cell.status in ("WARN", "FAIL")
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": not self.failed(),
                "hosts": self.hosts,
                "main_host": self.main_host,
                "checks": [{"name": c.name, "cells": {h: asdict(x) for h, x in c.cells.items()}} for c in self.checks],
                "measurements": self.measurements,
            },
            indent=2,
        )


def same_everywhere(
    name: str, values: dict[str, str | None], main_host: str, fix: str, missing_ok: bool = True
) -> Check:
    """A row where every host must report the same value; the majority (ties: the main host) is right."""
    check = Check(name)
    counts = Counter(values.values())
    top = max(counts.values(), default=0)
    majority = [v for v, n in counts.items() if n == top]
    reference = values.get(main_host) if values.get(main_host) in majority else majority[0] if majority else None
    for host, value in values.items():
        if value == reference:
            shown = value if value is not None else "not installed"
            if value is None and not missing_ok:
                check.cells[host] = Cell("FAIL", shown, f"{name} missing on every host", fix.format(ref="?", host=host))
            else:
                check.cells[host] = Cell("PASS", shown)
            continue
        where = ", ".join(h for h, v in values.items() if v == reference)
        check.cells[host] = Cell(
            "FAIL",
            value or "not installed",
            f"{name} {value or 'not installed'} on {host}, {reference or 'not installed'} on {where}",
            fix.format(ref=reference, host=host),
        )
    return check
