"""Every role's Molecule scenario, a few at a time (`make molecule`): each on test hosts of its own.

A scenario spends most of its time waiting on SSH round trips and package installs, so one at a time leaves a
core idle; two side by side nearly halve the wall time on two cores. Each scenario's output goes to a log of
its own, printed whole when the scenario fails; one line per scenario says how it ended and how long it took.

    python -m tools.molecule_all [--jobs 2] [scenario ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MOLECULE = Path(__file__).resolve().parent.parent / "molecule"


@dataclass(frozen=True)
class Outcome:
    scenario: str
    returncode: int
    seconds: float
    log: Path


def scenarios() -> list[str]:
    """Every scenario directory (one with a molecule.yml), the ones with most test hosts first: they take longest,
    and starting them first leaves the short ones to fill the gaps."""
    found = [p.parent for p in MOLECULE.glob("*/molecule.yml")]
    return [p.name for p in sorted(found, key=lambda p: (-(p / "molecule.yml").read_text().count("- name:"), p.name))]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="scenarios side by side (default 2)")
    parser.add_argument("scenario", nargs="*", help="scenarios to run (default: every one)")
    args = parser.parse_args(argv)
    known = scenarios()
    unknown = sorted(set(args.scenario) - set(known))
    if unknown:
        print(f"no Molecule scenario {', '.join(unknown)} (there are: {', '.join(known)})", file=sys.stderr)
        return 2
    chosen = [s for s in known if s in args.scenario] if args.scenario else known
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ugro-molecule-") as tmp:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            outcomes = list(pool.map(lambda s: run(s, Path(tmp)), chosen))
        failed = [o for o in outcomes if o.returncode != 0]
        for outcome in failed:
            print(f"\n===== molecule {outcome.scenario} (exit {outcome.returncode}) =====", flush=True)
            print(outcome.log.read_text(errors="replace"), flush=True)
    print(f"molecule: {len(outcomes) - len(failed)} of {len(outcomes)} scenarios passed in "
          f"{time.monotonic() - began:.0f} s ({args.jobs} at a time)")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
