"""After a lost host, the survivors' next update is the one a fault-free run of the same group takes from the same
state: nothing of the broken step is left in it.

The broken run: three "hosts" on this machine (the hosts' launcher, one rank each, told apart by UGRO_HOST, over
loopback, no controller); h3 is SIGKILLed, launcher and rank, at an exact point of step 3
(tests/fixtures/faulty_worker.py), and h1 and h2 go on by themselves (train/recovery/consensus.py) to the run's end.
The fault-free reference: the same job on all three hosts without a fault up to the last step the survivors applied
together with h3, then on h1 and h2 alone, resumed from that step's checkpoint. Each of the survivors' updates after
the fault (their checkpoints) must equal the reference's within float rounding. Survivors compared with each other
agree even where all are wrong: a broken step's gradients added to the step taken again, on every survivor alike.
Pipelines are not here: their stages cannot go on in a new group, and a lost stage host relaunches the run from its
last checkpoint, which tests/test_pipeline_run.py compares with an unbroken run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import free_port, host_launcher, write_job

pytestmark = pytest.mark.usefixtures("torchrun")

FAULT_STEP = 3
# Where h3 dies in step 3 (tests/fixtures/faulty_worker.py), and the last step every survivor had applied with it:
# before its first micro-batch (the step's exchange), between two micro-batches under no_sync, or inside the gradient
# all-reduce (no rank applied step 3: it is taken again in the new group); in its optimizer step or in the checkpoint
# after it (the others applied step 3; they find h3 gone in the checkpoint's or step 4's collectives and go on).
POINTS = {"exchange": FAULT_STEP - 1, "microbatch": FAULT_STEP - 1, "allreduce": FAULT_STEP - 1,
          "optimizer": FAULT_STEP, "checkpoint": FAULT_STEP}  # fmt: skip
LAST_STEP = FAULT_STEP + 1


# Ten sequences over three ranks: unequal shares (4, 3, 3), two micro-batches each (micro_batch_size 2), so that a
# host can die between them.
# A preference job (DPO) over unequal shares of pairs: its state is the adapter and optimizer as SFT's, each rank's
# reference log-probabilities its own (train/preference/reference.py).
PAIRS = {"source": "data/preference/train.jsonl", "format": "preference", "packing": False, "seq_len": 96}
METHODS: dict[str, dict[str, Any]] = {"sft": {}, "dpo": {"data": PAIRS, "rank_local": {"micro_batch_size": 2}}}


def _job(path: Path, method: str, timeout_s: int = 60) -> Path:
    train = {"max_steps": LAST_STEP, "global_batch_size": 10, "log_every": 1, "seed": 7, "method": method}
    return write_job(path, train=train, lora={"dropout": 0.0}, schedule={"warmup_steps": 1}, eval=None,
                     distributed={"timeout_s": timeout_s}, checkpoint={"every": 1, "keep_last": LAST_STEP},
                     **METHODS[method])  # fmt: skip


def _pids(run_dir: Path, hosts: tuple[str, ...]) -> list[int]:
    return [int(p.read_text().split()[0]) for h in hosts for p in (run_dir / "hosts" / h).glob("worker-rank*.pid")]


def _train(hosts: tuple[str, ...], job: Path, run_dir: Path, logs: Path, faults: str = "",
           resume: bool = False, nproc: dict[str, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """One launcher per host (the launch script's, h1 the main host), each with one rank of the faulty worker; until
    the main rank records the run finished and every rank has ended. A survivor's launcher waits at torchrun's exit
    barrier for a lost host's, so the test ends them. Returns run.json."""
    port = free_port()
    for host in hosts:
        (run_dir / "hosts" / host).mkdir(parents=True, exist_ok=True)
    extra = ("--resume", "auto" if resume else "none")
    agents = {h: host_launcher(hosts, h, port, job, run_dir, logs / f"{run_dir.name}-{h}.log",
                               {"UGRO_TEST_DIE": faults}, extra, (nproc or {}).get(h, 1)) for h in hosts}  # fmt: skip
    record: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 300
        main_log = logs / f"{run_dir.name}-h1.log"
        while record.get("state") != "finished" or any(psutil.pid_exists(pid) for pid in _pids(run_dir, hosts)):
            assert agents["h1"].poll() in (None, 0), main_log.read_text()[-3000:]
            assert time.monotonic() < deadline, main_log.read_text()[-3000:]
            time.sleep(0.2)
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                record = json.loads((run_dir / "run.json").read_text())
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return record


def _trainable(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"step-{step:06d}" / "state.pt", map_location="cpu",
                       weights_only=True)  # fmt: skip
    return {name: tensor.double() for name, tensor in state["trainable"].items()}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.square().sum() for t in tensors.values()) ** 0.5)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| over every trainable tensor, relative to |b|."""
    assert a.keys() == b.keys()
    return _norm({k: a[k] - b[k] for k in a}) / _norm(b)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The job of a method on h1, h2 and h3 without a fault (a checkpoint after every step), once per method."""
    runs: dict[str, Path] = {}

    def run(method: str) -> Path:
        if method not in runs:
            tmp = tmp_path_factory.mktemp(f"unbroken-{method}")
            record = _train(("h1", "h2", "h3"), _job(tmp / "job.yaml", method), tmp / "run", tmp)
            assert record["state"] == "finished", record
            runs[method] = tmp / "run"
        return runs[method]

    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, unbroken: Callable[[str], Path]) -> Callable[[str, int], Path]:
    """The fault-free group of the survivors: h1 and h2 from the unbroken run's checkpoint of ``step`` to the end,
    once per method and step."""
    runs: dict[tuple[str, int], Path] = {}

    def run(method: str, step: int) -> Path:
        if (method, step) not in runs:
            tmp = tmp_path_factory.mktemp(f"reference-{method}-{step}")
            shutil.copytree(unbroken(method) / "checkpoints" / f"step-{step:06d}",
                            tmp / "run" / "checkpoints" / f"step-{step:06d}")  # fmt: skip
            resumed = _train(("h1", "h2"), _job(tmp / "job.yaml", method), tmp / "run", tmp, resume=True)
            assert resumed["state"] == "finished", resumed
            runs[method, step] = tmp / "run"
        return runs[method, step]

    return run


CASES = [("exchange", "sft"), ("microbatch", "sft"), ("allreduce", "sft"), ("optimizer", "sft"), ("checkpoint", "sft"),
         ("allreduce", "dpo")]  # fmt: skip


@pytest.mark.parametrize(("point", "method"), CASES)
def test_the_survivors_next_update_is_the_fault_free_groups(
    tmp_path: Path, unbroken: Callable[[str], Path], reference: Callable[[str, int], Path], point: str, method: str
) -> None:
    job = _job(tmp_path / "job.yaml", method)
    broken = tmp_path / "broken"
    record = _train(("h1", "h2", "h3"), job, broken, tmp_path, faults=f"h3:{point}:{FAULT_STEP}:host")
    history = [(r["hosts"], r["decided_by"], r["from_step"]) for r in record["regroups"]]
    together = POINTS[point]  # the last step all three applied
    assert history == [(["h1", "h2"], "survivors", together)], record

    fault_free, survivors = unbroken(method), reference(method, together)
    start = _trainable(fault_free, together)
    if (broken / "checkpoints" / f"step-{together:06d}").is_dir():  # not where the fault broke its checkpoint off
        assert _distance(_trainable(broken, together), start) == 0, "the broken run differs before its fault"
    for step in range(together + 1, LAST_STEP + 1):
        expected, got = _trainable(survivors, step), _trainable(broken, step)
        update = _norm({k: expected[k] - start[k] for k in start})
        # fp32 rounding of sums in another order: far below a millionth of the weights, a thousandth of the update.
        assert _distance(got, expected) <= 1e-6, (step, _distance(got, expected))
        assert _norm({k: got[k] - expected[k] for k in start}) <= 1e-3 * update, (step, update)


def test_a_hosts_second_rank_learns_of_a_lost_host_from_its_heartbeat_not_at_the_timeout(tmp_path: Path) -> None:
    """h1 runs two ranks, h2 one; h2 goes whole inside step 3's gradient all-reduce. h1's first rank hears it from
    its heartbeat within seconds. Its second rank runs no heartbeat, and its all-reduce waits on a dead peer until the
    watchdog's timeout (20 s here, as on NCCL); it learns from the heartbeat's word (``hosts/h1/lost.json``,
    train/recovery/watch.py) instead, so the two regroup and finish without waiting out the timeout."""
    record = _train(("h1", "h2"), _job(tmp_path / "job.yaml", "sft", timeout_s=20), tmp_path / "run", tmp_path,
                    faults=f"h2:allreduce:{FAULT_STEP}:host", nproc={"h1": 2})  # fmt: skip
    assert record["state"] == "finished", record
    (regroup,) = record["regroups"]
    assert (regroup["hosts"], regroup["decided_by"]) == (["h1"], "survivors"), regroup
    assert regroup["seconds"] < 10, regroup  # the watchdog's timeout is 20 s
