"""`make bench-exporter`: what the node exporter costs a host, measured on a real exporter process.

Starts ``ugro_exporter.py serve`` (the file role exporter installs) on 127.0.0.1 over a planted run with a
live stand-in worker, so every scrape reads the job's files and two ranks' figures as on a training host,
then scrapes it over HTTP once every ``--interval`` seconds (5: a typical Prometheus scrape interval) for
``--duration`` seconds and reads the exporter's CPU time (user + system, from /proc) before and after:

    python -m bench.exporter [--interval 5] [--duration 120] [--burst 200]

It also times ``--burst`` back-to-back scrapes, which gives the CPU cost of one scrape apart from the
idle cost. The figures go to stdout and runs/bench/exporter.json; nothing is pass/fail.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from testbed.net import free_port
from testbed.planted import plant_run
from ugro.hosts.playbook import runs_dir

REPO = Path(__file__).resolve().parent.parent
EXPORTER = REPO / "ugro" / "module_utils" / "ugro_exporter.py"


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _scrape(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return len(response.read())


def measure(interval_s: float, duration_s: float, burst: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ugro-bench-exporter-") as tmp:
        runs = Path(tmp) / "runs"
        runs.mkdir()
        # A stand-in worker whose command line names the run, as a rank's does.
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(86400)", str(runs / "bench-job")])
        port = free_port()
        # 1,000 metrics rows: what every scrape of a long run's host reads.
        plant_run(runs, "benchhost", worker.pid, job_id="bench-job", step=1000, total_steps=5000, rows=1000, loss=2.5)
        exporter = subprocess.Popen(
            [sys.executable, str(EXPORTER), "serve", "--listen", "127.0.0.1", "--port", str(port),
             "--host", "benchhost", "--runs-dir", str(runs)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    size = _scrape(url)
                    break
                except OSError:
                    if time.monotonic() > deadline or exporter.poll() is not None:
                        raise
                    time.sleep(0.1)
            proc = psutil.Process(exporter.pid)
            time.sleep(1.0)  # start-up (imports, NVML init) is not what a running host pays

            cpu0, wall0 = _cpu_s(proc), time.monotonic()
            latencies = []
            for _ in range(burst):
                t = time.perf_counter()
                _scrape(url)
                latencies.append(time.perf_counter() - t)
            burst_cpu, burst_wall = _cpu_s(proc) - cpu0, time.monotonic() - wall0

            cpu0, wall0 = _cpu_s(proc), time.monotonic()
            scrapes = 0
            next_at = wall0
            while time.monotonic() - wall0 < duration_s:
                _scrape(url)
                scrapes += 1
                next_at += interval_s
                time.sleep(max(0.0, next_at - time.monotonic()))
            paced_cpu, paced_wall = _cpu_s(proc) - cpu0, time.monotonic() - wall0
            rss = proc.memory_info().rss
        finally:
            exporter.terminate()
            worker.terminate()
            exporter.wait(10)
            worker.wait(10)
    latencies.sort()
    per_scrape = burst_cpu / burst
    return {
        "interval_s": interval_s,
        "duration_s": round(paced_wall, 1),
        "scrapes": scrapes,
        "cpu_s": round(paced_cpu, 3),
        "core_percent": round(100 * paced_cpu / paced_wall, 3),
        "cpu_ms_per_scrape": round(1000 * per_scrape, 2),
        "core_percent_from_burst": round(100 * per_scrape / interval_s, 3),
        "scrape_ms_median": round(1000 * latencies[len(latencies) // 2], 2),
        "burst": burst,
        "burst_wall_s": round(burst_wall, 2),
        "response_bytes": size,
        "rss_mib": round(rss / 2**20, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exporter", description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes (default 5)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of paced scraping (default 120)")
    parser.add_argument("--burst", type=int, default=200, help="back-to-back scrapes for the per-scrape cost")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the exporter and the stand-in worker are stopped
    result = measure(args.interval, args.duration, args.burst)
    out = runs_dir() / "bench" / "exporter.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"exporter, one scrape every {result['interval_s']:g} s for {result['duration_s']:g} s ({result['scrapes']} "
        f"scrapes): {result['cpu_s']:.3f} CPU s = {result['core_percent']:.3f} % of a core; "
        f"{result['cpu_ms_per_scrape']:.2f} ms CPU per scrape ({result['burst']} back to back, median "
        f"{result['scrape_ms_median']:.2f} ms each, {result['response_bytes']} bytes), so "
        f"{result['core_percent_from_burst']:.3f} % of a core at that interval; RSS {result['rss_mib']} MiB ({out})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
