"""The step clock reads the device's time on CUDA without making the step wait for it (train/balance/step.py StepClock).

There is no GPU here: the clock takes its events from a factory (``StepClock.events``, ``torch.cuda.Event`` on
CUDA), and these tests give it events on a fake device timeline whose work the test queues and completes. The
host clock is checked for the numbers it gave before device events existed.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from helpers import write_job

from train.balance.batchplan import Balancer
from train.balance.step import StepClock, cuda_event, exchange
from train.config import load_job
from train.dist.distributed import RankInfo


class Device:
    """A fake GPU: queued work runs in order after what came before; ``sync()`` is the host waiting for it all."""

    def __init__(self) -> None:
        self.queued_s = 0.0  # when the device will have run everything queued so far
        self.done_s = 0.0  # how far the device has run
        self.synchronized: list[FakeEvent] = []  # events the host waited for (Event.synchronize)

    def queue(self, seconds: float) -> None:
        self.queued_s += seconds

    def sync(self) -> None:  # a host sync such as loss.item()
        self.done_s = self.queued_s

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """torch.cuda.Event's interface on the fake device's timeline."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.device.queued_s  # reached once the work queued before it has run

    def query(self) -> bool:
        return self.at is not None and self.at <= self.device.done_s

    def synchronize(self) -> None:
        assert self.at is not None
        self.device.synchronized.append(self)
        self.device.done_s = max(self.device.done_s, self.at)

    def elapsed_time(self, end_event: FakeEvent, /) -> float:
        assert self.query() and end_event.query(), "cudaEventElapsedTime: an event is not complete"
        assert self.at is not None and end_event.at is not None
        return (end_event.at - self.at) * 1000


def _step(clock: StepClock, device: Device, pipeline: bool = False) -> None:
    """One step as train/balance/step.py backward drives the clock (the last lap from DDP's hook); ``pipeline`` waits
    for an input in the middle, as a pipeline stage does. The host queues work instantly; the device takes its time."""
    clock.begin()
    device.queue(0.5)  # a no_sync micro-batch
    clock.lap()
    if pipeline:
        device.queue(0.25)  # the stream waits for a peer's activations
        clock.waited()
    device.queue(0.125)  # the synchronizing micro-batch: its last gradient bucket is ready here
    clock.lap()
    device.queue(2.0)  # the all-reduce (waiting for slower ranks) and the optimizer: not this rank's compute
    clock.end()


def test_the_reported_compute_time_is_the_devices_not_the_hosts() -> None:
    device = Device()
    clock = StepClock(events=device.event)
    _step(clock, device)
    device.sync()  # the step's loss.item()
    assert clock.last_host_s < 0.1  # the host only queued the work
    assert clock.last_compute_s == pytest.approx(0.625)
    assert exchange(0, clock) == 0  # the value the next step's all-reduce shares
    assert clock.gathered == [pytest.approx(0.625)]
    assert device.synchronized == []


def test_a_wait_inside_the_step_counts_as_on_the_host_the_wait_after_the_last_lap_does_not() -> None:
    """The step runs from begin() to its last lap on either clock, so a pipeline stage's time is its replica's step
    time (docs/pipeline.md: a replica's time is its slowest stage's); the all-reduce after the last lap is left out."""
    device = Device()
    clock = StepClock(events=device.event)
    _step(clock, device, pipeline=True)
    device.sync()
    assert clock.last_compute_s == pytest.approx(0.875)


def test_nothing_waits_for_the_device_during_the_step_and_the_read_waits_only_for_an_incomplete_event() -> None:
    device = Device()
    clock = StepClock(events=device.event)
    _step(clock, device)
    assert device.synchronized == [] and device.done_s == 0.0  # the step queued work and returned
    assert clock.last_compute_s == pytest.approx(0.625)  # no host sync yet: the read waits for the events alone
    assert [e.at for e in device.synchronized] == [0.625]  # the step's last event (its first was done), not the device
    assert device.done_s == 0.625  # not the all-reduce queued after them

    device.synchronized.clear()
    _step(clock, device)
    device.sync()  # the step's loss.item(), as in training
    assert clock.last_compute_s == clock.last_compute_s == pytest.approx(0.625)
    assert device.synchronized == []  # complete events are read without waiting


def test_the_host_clock_gives_the_old_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = itertools.count(start=10.0, step=0.25)
    monkeypatch.setattr("train.balance.step.time.perf_counter", lambda: next(ticks))
    clock = StepClock.for_device(torch.device("cpu"))
    assert clock.events is None
    clock.begin()  # 10.0
    clock.lap()  # 10.25
    clock.waited()  # 10.5
    clock.lap()  # 10.75
    clock.end()
    assert clock.last_compute_s == clock.last_host_s == 0.75  # from begin() to the last mark, as before


def test_the_device_a_rank_trains_on_chooses_the_clock(tmp_path: Path) -> None:
    assert StepClock.for_device(torch.device("cuda", 1)).events is cuda_event
    emulated = StepClock.for_device(torch.device("cpu"), device_s_per_token=0.002)  # make bench: on CPU, as before
    assert emulated.events is None and emulated.device_s_per_token == 0.002

    job = load_job(write_job(tmp_path / "job.yaml"))
    for device, events in ((torch.device("cuda", 0), cuda_event), (torch.device("cpu"), None)):
        info = RankInfo(rank=0, local_rank=0, world_size=1, host="h", device=device, hosts=("h",))
        assert Balancer(job, info, None).clock.events is events
