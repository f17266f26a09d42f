"""What torchrun runs on every rank: ``python -m train.worker --job JOB --run-dir DIR``.

Exit codes: 0 finished, 2 bad configuration (message names the file/host and key), 3 the loss or
gradient went non-finite (the last good checkpoint is kept), 4 any other failure, 5 started again to rejoin the running
group and found none to rejoin (train/recovery/rejoin.py), 6 this host was taken back by its owner and its ranks left
the running group (train/recovery/lending.py: no failure), 143 stopped. Every
ending but success appends the cause to ``hosts/<host>/failures.jsonl`` (train/recovery/failure.py); the main
rank also writes it into run.json.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

import psutil

from train import loop
from train.config import ConfigError, DistributedConfig, JobConfig, apply_profile, load_job, load_profile
from train.dist import distributed
from train.dist.health import GroupHealth
from train.metrics import write_status
from train.model import load as model
from train.recovery import failure, rejoin
from train.recovery.membership import Membership

log = logging.getLogger("train")


def _setup_logging(run_dir: Path, host: str, rank: int) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s {host} rank{rank} %(levelname)s %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(logs / f"{host}-rank{rank}.log")
    file_handler.setFormatter(fmt)
    handlers: list[logging.Handler] = [file_handler]
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
        handlers.append(console)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    # peft still calls a transformers method renamed in v5; the message says nothing about this run.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _record_pid(run_dir: Path, host: str, rank: int) -> None:
    """So that `make stop` can end exactly this process (torchrun gives each new interpreter a session of its own)."""
    host_dir = run_dir / "hosts" / host
    host_dir.mkdir(parents=True, exist_ok=True)
    path = host_dir / f"worker-rank{rank}.pid"
    tmp = path.with_name(f".{path.name}.tmp")  # renamed into place: a reader never sees it half written
    tmp.write_text(f"{os.getpid()} {psutil.Process().create_time():.3f}\n")  # `pid start` (ugro_jobstate.belongs)
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, type=Path, help="job file (YAML)")
    parser.add_argument("--run-dir", required=True, type=Path, help="directory this run writes to")
    parser.add_argument(
        "--resume",
        choices=["none", "auto"],
        default="none",
        help="auto: continue from the newest intact checkpoint in the run directory",
    )
    parser.add_argument("--profile", type=Path, default=None, help="this host's memory profile (rank-local keys)")
    parser.add_argument("--code-dir", type=Path, default=Path.cwd(), help="base for relative paths in the job")
    parser.add_argument("--benchmark", action="store_true", help=argparse.SUPPRESS)  # only `make bench` sets it
    return parser.parse_args(argv)


def _load(args: argparse.Namespace, host: str) -> tuple[JobConfig | None, str | None]:
    """The job as this host runs it (profile merged), or why it cannot be used."""
    try:
        job = load_job(args.job, benchmark=args.benchmark)
        if args.profile is not None:
            job = apply_profile(job, load_profile(args.profile, host), f"{args.profile} on host {host}")
    except ConfigError as exc:
        return None, str(exc)
    return job, None


def preload(argv: list[str]) -> None:
    """Import now what ``main(argv)`` imports before its first step, on a host without a GPU: train/launcher.py
    calls this before it forks the ranks. A job it cannot read is left to the ranks to report."""
    try:
        job = load_job(parse_args(argv).job)
        model.preload_cpu(job.model)
    except (ConfigError, OSError, SystemExit):
        return


def _name_process(rank: int) -> None:
    """``ugro-rank<N>`` in ps and top (the command line is torchrun's, or the launcher's where it forked the rank)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"ugro-rank{rank}"[:15])


EXIT_CODES = {"config": 2, "non_finite": 3, "rejoin": 5, "stopped": 143}
LENT = 6  # not 0: torchrun's agent would wait at its exit barrier for the others', which end with the run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signals = failure.stop_on_signals()
    rank = int(os.environ.get("RANK", "0"))
    run_dir = args.run_dir.resolve()
    host = os.environ.get("UGRO_HOST") or os.uname().nodename
    _name_process(rank)
    _setup_logging(run_dir, host, rank)
    _record_pid(run_dir, host, rank)
    # A relaunch after a failure (the controller's, or torchrun's own restart) always continues.
    resume = args.resume == "auto" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    info: distributed.RankInfo | None = None
    progress = loop.Progress()
    try:
        job, problem = _load(args, host)
        info, server = distributed.init(job.distributed.timeout_s if job else DistributedConfig().timeout_s)
        distributed.agree(problem, info)  # a bad file on one host stops every rank, none waits
        assert job is not None
        distributed.check_same_job(job, info)
        if info.is_main and not rejoin.requested():  # ranks that rejoin find the run's record kept elsewhere
            write_status(run_dir, job_file=str(args.job))  # for the model card's command that reproduces the run
        membership = Membership(info, server, run_dir, job, GroupHealth(signals.stopped))
        left = loop.run(job, run_dir, args.code_dir.resolve(), resume, progress, membership)
        return LENT if left else 0
    except (Exception, failure.Stopped) as exc:
        ended = failure.record(run_dir, exc, host, info.rank if info else rank, progress.step, signals)
        log.error("%s: %s", ended.kind, ended.message)
        if (info.is_main if info else rank == 0) and not rejoin.requested():
            state = "stopped" if ended.kind == "stopped" else "failed"
            write_status(run_dir, state=state, error=ended.message, cause=ended.to_dict())
        return EXIT_CODES.get(ended.kind, 4)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
