"""pytest plugin: what each test costs the machine, in CPU-seconds, for docs/results.md "CI time".

Wall time says little on two cores shared by two pytest processes: a test that sleeps and one that computes look
alike. This plugin reads the whole machine's busy time (``/proc/stat``: every core, every process, the test
cluster's hosts and daemons included) before and after each test's setup, call and teardown, and writes one JSON
line per test to the file ``UGRO_TEST_CPU`` names. Run the tests as one process on an otherwise quiet machine, or
the figures count the neighbours' work too:

    UGRO_TEST_CPU=/tmp/cpu.jsonl .venv/bin/python -m pytest -p tools.pytest_cpu -m "" tests
    .venv/bin/python -m tools.pytest_cpu /tmp/cpu.jsonl     # the tests by CPU-seconds, most first

With ``UGRO_TEST_CPU_CGROUP=1`` (root, cgroup v1's cpuacct) each pytest process moves itself into a cpuacct cgroup of
its own at its start and counts what that cgroup used: its own work and everything it started (the test hosts and
daemons included), not its neighbours'. So `make test`'s processes side by side can each be measured (the plugin
must be importable from the checkout: ``PYTEST_ADDOPTS="-p tools.pytest_cpu"``; the cgroups are left empty in
/sys/fs/cgroup/cpuacct/ugro-pytest-<pid>).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")


CGROUP = Path("/sys/fs/cgroup/cpuacct")


def _own_cgroup() -> Path | None:
    """This process's cpuacct cgroup under UGRO_TEST_CPU_CGROUP=1, made and entered on first use."""
    if os.environ.get("UGRO_TEST_CPU_CGROUP") != "1":
        return None
    group = CGROUP / f"ugro-pytest-{os.getpid()}"
    if not group.is_dir():
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def busy_seconds() -> float:
    """CPU-seconds the whole machine has been busy since boot: every core's time but idle and iowait (under
    UGRO_TEST_CPU_CGROUP=1: what this process and everything it started used, its cgroup's)."""
    group = _own_cgroup()
    if group is not None:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / TICKS  # user nice system idle iowait irq softirq steal; guests are in user


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    target = os.environ.get("UGRO_TEST_CPU")
    if not target:
        yield
        return
    began, busy = time.monotonic(), busy_seconds()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - began, 2), "cpu_s": round(busy_seconds() - busy, 2)}
    with open(target, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def main(argv: list[str]) -> int:
    """Print the tests of a UGRO_TEST_CPU file, most CPU-seconds first, and the totals."""
    if len(argv) != 1:
        print("usage: python -m tools.pytest_cpu FILE", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: -r["cpu_s"])
    for r in rows:
        print(f"{r['cpu_s']:8.1f} cpu-s {r['wall_s']:8.1f} s  {r['test']}")
    cpu, wall = sum(r["cpu_s"] for r in rows), sum(r["wall_s"] for r in rows)
    print(f"{cpu:8.1f} cpu-s {wall:8.1f} s  in all, {len(rows)} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
