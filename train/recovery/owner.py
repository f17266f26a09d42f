"""The owner's use of a host, watched by its launcher: the host leaves the run when its owner needs it and comes back
when it is free again (train/recovery/lending.py says how a host leaves and comes back).

A host setting (roles/train_launch ``train_launch_lend_*``, off by default) turns it on; the launch script hands the
settings to the launcher as JSON in ``UGRO_LEND``. Every ``check_s`` seconds the launcher asks, in this order:

- the hours: outside ``hours`` (e.g. ``"01:00-08:00"``, several ranges with commas, across midnight too) the host is
  its owner's;
- the battery: a laptop whose mains adapter is off line (``/sys/class/power_supply``) leaves, where ``on_battery``;
- another process's use of what the ranks compute on: on a host with an NVIDIA GPU, NVML's list of the processes on
  each GPU (compute and graphics) with their memory, and the GPU's utilisation where a process not of this job runs
  on it; on a host without one, where the ranks compute on the CPU, the host's processes with their resident memory
  and CPU time. A process of this job (the launcher and every process under it) never counts.

The first reason found takes the host back (``lending.ask``, by "owner"); when none has been found for ``free_s``
seconds, a request the owner's use made is withdrawn and the host comes back. A request made by hand is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from train.recovery import lending

log = logging.getLogger(__name__)

ENV = "UGRO_LEND"
POWER = Path("/sys/class/power_supply")
MIB = 1 << 20


class SettingsError(ValueError):
    """A lend setting that cannot be used (the message names it)."""


@dataclass(frozen=True)
class Settings:
    """When the host leaves for its owner, and when it comes back (the module says how each is read)."""

    memory_mib: int = 1024  # another process's GPU memory (CPU host: resident memory) over which the host leaves
    busy_percent: int = 50  # the GPU's utilisation with another process on it (CPU host: its CPU share)
    hours: str = ""  # when the host is lent to the run; empty: all day
    on_battery: bool = True  # a laptop on battery leaves
    free_s: float = 60.0  # no owner's use for this long before the host comes back
    check_s: float = 2.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings | None:
        """The settings the launch script gave (``UGRO_LEND``), or None where the host lends itself by hand only."""
        text = (environ if environ is not None else os.environ).get(ENV, "").strip()
        if not text:
            return None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SettingsError(f"{ENV} is not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"{ENV} must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"{ENV}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        for field in fields(cls):  # the kind of each value is that of its default
            if field.name not in data:
                continue
            value, default = data[field.name], field.default
            if isinstance(default, bool):
                good, want = isinstance(value, bool), "true or false"
            elif isinstance(default, int | float):
                number = isinstance(value, int | float) and not isinstance(value, bool)
                good, want = number and value > 0, "a positive number"
            else:
                good, want = isinstance(value, str), "a string"
            if not good:
                raise SettingsError(f"{ENV}: {field.name} is {json.dumps(value)}, it must be {want}")
        made = cls(**data)
        made.windows()  # the hours parse
        return made

    def windows(self) -> list[tuple[int, int]]:
        """``hours`` as (start, end) minutes of the day; end <= start runs across midnight."""
        return parse_hours(self.hours)


def parse_hours(text: str) -> list[tuple[int, int]]:
    """``"01:00-08:00, 22:30-23:59"`` -> [(60, 480), (1350, 1439)]; raises SettingsError naming the bad range."""
    found = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            start, end = (datetime.strptime(t.strip(), "%H:%M") for t in part.split("-"))
        except ValueError as exc:
            raise SettingsError(f"lend hours {part!r}: write HH:MM-HH:MM, e.g. 01:00-08:00 ({exc})") from exc
        found.append((start.hour * 60 + start.minute, end.hour * 60 + end.minute))
    return found


def outside_hours(windows: list[tuple[int, int]], now: datetime) -> bool:
    """Whether ``now`` lies outside every window (no windows: never)."""
    if not windows:
        return False
    minute = now.hour * 60 + now.minute
    return not any(start <= minute < end if start < end else minute >= start or minute < end for start, end in windows)


def on_battery(power: Path = POWER) -> bool:
    """A machine with a battery whose mains adapter says it is off line (Linux's power_supply class)."""
    try:
        supplies = list(power.iterdir())
    except OSError:
        return False

    def read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    types = {s: read(s / "type") for s in supplies}
    mains = [s for s, kind in types.items() if kind == "Mains"]
    has_battery = any(kind == "Battery" for kind in types.values())
    return has_battery and bool(mains) and all(read(s / "online") == "0" for s in mains)


def own_pids() -> set[int]:
    """This launcher, every process under it (the ranks) and above it (the launch script): the job's own."""
    import psutil

    me = psutil.Process()
    pids = {me.pid}
    for relatives in (me.children(recursive=True), me.parents()):
        pids |= {p.pid for p in relatives}
    return pids


class HostUse:
    """Processes not of this job on a host without a GPU: their resident memory and share of the CPU."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.seen: dict[int, Any] = {}  # pid -> psutil.Process, kept so that cpu_percent measures since the last look
        self.cores = psutil.cpu_count() or 1

    def heaviest(self, settings: Settings, own: set[int]) -> str | None:
        found = None
        for proc in self.psutil.process_iter(["pid", "name"]):
            if proc.pid in own:
                continue
            kept = self.seen.setdefault(proc.pid, proc)
            try:
                rss = kept.memory_info().rss
                cpu = kept.cpu_percent(None) / self.cores
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
            name = proc.info.get("name") or "?"
            if rss >= settings.memory_mib * MIB:
                found = found or f"process {proc.pid} ({name}) uses {rss / MIB:.0f} MiB of the host's memory"
            elif cpu >= settings.busy_percent:
                found = found or f"process {proc.pid} ({name}) uses {cpu:.0f} % of the host's CPU"
        alive = {p.pid for p in self.psutil.process_iter()}
        self.seen = {pid: p for pid, p in self.seen.items() if pid in alive}
        return found


class GpuUse:
    """Processes not of this job on the host's NVIDIA GPUs, from NVML (``nvml``: the pynvml module)."""

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        nvml.nvmlInit()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    def heaviest(self, settings: Settings, own: set[int]) -> str | None:
        nv = self.nv
        for index, handle in enumerate(self.handles):
            processes = []
            for listing in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    processes += list(getattr(nv, listing)(handle))
                except Exception:  # NVMLError_NotSupported on some boards
                    continue
            others = [p for p in processes if int(p.pid) not in own]
            for proc in others:
                used = int(getattr(proc, "usedGpuMemory", 0) or 0)
                if used >= settings.memory_mib * MIB:
                    return f"process {proc.pid} uses {used / MIB:.0f} MiB of GPU {index}"
            if others:
                try:
                    busy = int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
                except Exception:
                    continue
                if busy >= settings.busy_percent:
                    return f"GPU {index} is {busy} % busy with process {others[0].pid} on it"
        return None


def probe() -> HostUse | GpuUse:
    """What the ranks of this host compute on: the GPUs where NVML sees some, else the host itself."""
    try:
        import pynvml

        gpus = GpuUse(pynvml)
        if gpus.handles:
            return gpus
    except Exception:  # no pynvml, no driver, no GPU
        pass
    return HostUse()


@dataclass
class OwnerWatch:
    """The launcher's thread that takes the host back for its owner and lends it again (the module says when)."""

    host_dir: Path
    settings: Settings
    use: HostUse | GpuUse
    own: Callable[[], set[int]] = own_pids
    clock: Callable[[], datetime] = datetime.now
    free_since: float | None = None

    def start(self) -> threading.Event:
        stop = threading.Event()
        threading.Thread(target=self._run, args=(stop,), name="ugro-owner", daemon=True).start()
        return stop

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.check()
            except Exception as exc:  # a probe that fails once must not end the watch
                log.warning("owner watch: %s", exc)
            stop.wait(self.settings.check_s)

    def reason(self) -> str | None:
        """Why the owner needs the host now, or None."""
        settings = self.settings
        if outside_hours(settings.windows(), self.clock()):
            return f"outside the hours it is lent ({settings.hours})"
        if settings.on_battery and on_battery():
            return "on battery"
        return self.use.heaviest(settings, self.own())

    def check(self) -> None:
        why = self.reason()
        now = time.monotonic()
        if why is not None:
            self.free_since = None
            if lending.request(self.host_dir) is None:
                lending.ask(self.host_dir, lending.BY_OWNER, why)
                print(f"ugro: the owner needs this host ({why}): its ranks leave the run after this step", flush=True)
            return
        asked = lending.request(self.host_dir)
        if asked is None or asked.by != lending.BY_OWNER:
            self.free_since = None
            return
        if self.free_since is None:
            self.free_since = now
        elif now - self.free_since >= self.settings.free_s:
            lending.withdraw(self.host_dir, by=lending.BY_OWNER)
            self.free_since = None
            print(f"ugro: the owner has not used this host for {self.settings.free_s:g} s: lending it to the run "
                  "again", flush=True)  # fmt: skip
