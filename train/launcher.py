"""What the launch script runs on every host (roles/train_launch): torchrun, with torchrun's own arguments, agent and
static rendezvous. On a host without a GPU it forks the ranks from a process that has already imported what a rank
imports, instead of starting each rank as a new interpreter that imports it all again.

torchrun starts a ``--module`` entrypoint as a new interpreter: the rank imports torch again after the agent did,
then transformers and peft. On the test cluster (three hosts on two cores) those imports are most of the launch
(docs/results.md, "Recovery"). torch's elastic launcher can also fork a function entrypoint; forked from here, a rank
starts with torch, transformers, peft and the training loop in memory. The module's own ``preload(argv)`` says what to
import, and its ``main(argv)`` runs the rank. On a GPU host, where CUDA does not support a process forked after its
libraries started, and where each host has cores of its own, this is torchrun exactly.

    python -m train.launcher <torchrun's arguments> --module train.worker <the worker's arguments>
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def has_gpu() -> bool:
    """NVIDIA's driver lists a GPU on this host (read from /proc: nothing here may start CUDA before a fork)."""
    try:
        return any(Path("/proc/driver/nvidia/gpus").iterdir())
    except OSError:
        return False


def _forkable(args: argparse.Namespace) -> ModuleType | None:
    """The entrypoint module, where the ranks can be forked from this process; None where torchrun starts them."""
    if has_gpu() or args.standalone or args.no_python or args.run_path or not args.module:
        return None
    module = importlib.import_module(args.training_script)
    return module if callable(getattr(module, "main", None)) else None


def _rank(module_name: str, *argv: str) -> None:
    """A forked rank: the module's ``main(argv)``, its return value the process's exit status (torchrun's agent
    reads it as it reads a module entrypoint's).

    OpenMP read OMP_NUM_THREADS when this process imported torch, before torchrun's configuration set it (to 1
    where a host runs several ranks and the launch script sets none): a new interpreter would read it at its
    start, so the forked rank applies it now."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.exit(importlib.import_module(module_name).main(list(argv)))


def _launch_once(args: argparse.Namespace, first: bool) -> None:
    """One run of torchrun's agent; ``first``: this process's first, which imports what the ranks need first."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    module = _forkable(args)
    if module is None:
        gc.enable()
        torchrun.run(args)
        return
    if args.master_port is None:  # as torchrun's own run() sets it
        args.master_port = 29500
    worker_args = list(args.training_script_args)
    preload = getattr(module, "preload", None)
    if callable(preload) and first:
        preload(worker_args)
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    # What the launcher imported stays out of every later collection, here and in the forked ranks: their
    # collections do not walk it, and so do not write into the pages they share with this process.
    gc.freeze()
    gc.enable()
    elastic_launch(config, _rank)(args.training_script, *worker_args)


def _launch(argv: list[str]) -> None:
    """torchrun; where a rank crashed on this host while the others of a multi-host run go on, this host's ranks
    start again, up to ``distributed.rejoins`` times, and rejoin the running group (train/recovery/comeback.py); where
    the host was taken back (train/recovery/lending.py), this launcher waits until it is lent again, with nothing on
    its GPU, and then its ranks rejoin the same way, as often as the host comes and goes."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from train.recovery import comeback

    args = torchrun.parse_args(argv)
    place = comeback.Place.of(args)
    if place.host_dir is not None and place.lends:
        _watch_owner(place.host_dir)
    crashes = launches = 0
    lent_again = False  # this run of torchrun's ranks came back after the host was lent again
    while True:
        seen, began = place.records(), time.time()
        if place.host_dir is not None:
            comeback.EndWatch(place.host_dir, began)
        try:
            _launch_once(args, first=launches == 0)
            return
        except ChildFailedError as exc:
            launches += 1
            if lent_again and place.kinds_since(seen) == {"rejoin"}:
                print("ugro: the run ended while this host was coming back to it", flush=True)
                return
            lent = place.lent_since(began)
            if lent is not None:
                why = place.while_lent(lent, lambda: _group_runs(place))
                if why is None:
                    print("ugro: the run ended while this host was lent", flush=True)
                    return
                place.come_back(args, why, crashes, launches, lent=True)
                lent_again = True
                continue
            why = place.crashed(exc, seen)
            if crashes == place.rejoins or why is None:
                raise
            crashes += 1
            place.come_back(args, why, crashes, launches)
            lent_again = False


def _watch_owner(host_dir: Path) -> None:
    """The host lends itself by its owner's use (train/recovery/owner.py), where its launch settings say so."""
    from train.recovery import owner

    try:
        settings = owner.Settings.from_env()
    except (owner.SettingsError, TypeError) as exc:
        print(f"ugro: {exc}: this host is taken back by hand only", flush=True)
        return
    if settings is not None:
        owner.OwnerWatch(host_dir, settings, owner.probe()).start()
        print(f"ugro: lent to the run by its owner's use: {settings}", flush=True)


def _group_runs(place: Any) -> bool:
    """Whether any other host of this host's last group still runs it (its store names a group)."""
    from train.recovery import failure, rejoin

    assert place.host_dir is not None
    try:
        rejoin.find(place.host_dir.parent.parent, place.host_dir.name, int(os.environ.get("UGRO_ATTEMPT", "0")))
    except failure.RejoinError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    # No cyclic collection while torch, transformers and peft import: they allocate ~670,000 objects that live as
    # long as the process, and the collections that allocation triggers cost ~0.5 s of CPU (docs/results.md,
    # "Recovery"). Python's documented way for a process that forks without exec.
    gc.disable()
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_launch)(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
