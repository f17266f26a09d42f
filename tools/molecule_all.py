"""Every role's Molecule scenario, a few at a time (`make molecule`): each on test hosts of its own.

A scenario spends most of its time waiting on SSH round trips and package installs, so one at a time leaves a
core idle; two side by side nearly halve the wall time on two cores. The longest start first (each scenario's time
in this machine's last run, ~/.cache/ugro/molecule-seconds.json), so that the short ones fill the gaps at the end.
Each scenario's output goes to a log of its own, printed whole when the scenario fails; one line per scenario says
how it ended and how long it took.

Beside other work that is about to end (`make test` starts Molecule beside the half of the test suite that is
left, tools/pytest-pair), `--fewer-until FILE` runs one scenario at a time until FILE exists, then `--jobs`.

    python -m tools.molecule_all [--jobs 2] [--fewer-until FILE] [scenario ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ugro.model.basemodel import cache_root

MOLECULE = Path(__file__).resolve().parent.parent / "molecule"


@dataclass(frozen=True)
class Outcome:
    scenario: str
    returncode: int
    seconds: float
    log: Path


def times_file() -> Path:
    """How long each scenario took in this machine's last run (kept between runs and clones, like the other caches)."""
    return cache_root() / "molecule-seconds.json"


def read_times(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)} if isinstance(data, dict) else {}


def write_times(path: Path, outcomes: list[Outcome]) -> None:
    """Add the passed scenarios' seconds to ``path`` (a failed one's time says little about the next run)."""
    times = read_times(path) | {o.scenario: round(o.seconds, 1) for o in outcomes if o.returncode == 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def scenarios(times: dict[str, float] | None = None) -> list[str]:
    """Every scenario directory (one with a molecule.yml), the longest first, so that the short ones fill the gaps
    at the end: by ``times`` (a scenario not in them first), then by the number of test hosts."""
    known = times or {}
    found = [p.parent for p in MOLECULE.glob("*/molecule.yml")]

    def longest_first(p: Path) -> tuple[float, int, str]:
        hosts = (p / "molecule.yml").read_text().count("- name:")
        return (-known.get(p.name, math.inf), -hosts, p.name)

    return [p.name for p in sorted(found, key=longest_first)]


def run(scenario: str, logs: Path) -> Outcome:
    log = logs / f"{scenario}.log"
    began = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(
            ["molecule", "test", "-s", scenario], cwd=MOLECULE.parent, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    outcome = Outcome(scenario, code, time.monotonic() - began, log)
    verdict = "ok" if code == 0 else f"FAILED (exit {code})"
    print(f"molecule {scenario}: {verdict} in {outcome.seconds:.0f} s", flush=True)
    return outcome


def run_all(chosen: list[str], logs: Path, jobs: int, fewer_until: Path | None) -> list[Outcome]:
    """Every chosen scenario, in order, ``jobs`` at a time (one at a time until ``fewer_until`` exists)."""

    def limit() -> int:
        return jobs if fewer_until is None or fewer_until.exists() else 1

    pending = list(chosen)
    running: set[Future[Outcome]] = set()
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            while pending and len(running) < limit():
                running.add(pool.submit(run, pending.pop(0), logs))
            done, running = wait(running, timeout=2, return_when=FIRST_COMPLETED)
            outcomes += [future.result() for future in done]
    return sorted(outcomes, key=lambda o: chosen.index(o.scenario))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="scenarios side by side (default 2)")
    parser.add_argument(
        "--fewer-until", type=Path, default=None, help="one scenario at a time until this file exists, then --jobs"
    )
    parser.add_argument("scenario", nargs="*", help="scenarios to run (default: every one)")
    args = parser.parse_args(argv)
    times = times_file()
    known = scenarios(read_times(times))
    unknown = sorted(set(args.scenario) - set(known))
    if unknown:
        print(f"no Molecule scenario {', '.join(unknown)} (there are: {', '.join(known)})", file=sys.stderr)
        return 2
    chosen = [s for s in known if s in args.scenario] if args.scenario else known
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ugro-molecule-") as tmp:
        outcomes = run_all(chosen, Path(tmp), max(1, args.jobs), args.fewer_until)
        with contextlib.suppress(OSError):  # only the next run's order
            write_times(times, outcomes)
        failed = [o for o in outcomes if o.returncode != 0]
        for outcome in failed:
            print(f"\n===== molecule {outcome.scenario} (exit {outcome.returncode}) =====", flush=True)
            print(outcome.log.read_text(errors="replace"), flush=True)
    print(f"molecule: {len(outcomes) - len(failed)} of {len(outcomes)} scenarios passed in "
          f"{time.monotonic() - began:.0f} s ({args.jobs} at a time)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
