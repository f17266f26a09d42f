"""`make bench-recovery`: how long a job takes to start, and to get going again after it loses a host.

Brings up the 3-host test cluster (network namespaces, real SSH, gloo over veth; needs root) and runs one
job through the real controller (`ugro train`): launch -> first optimizer step; then every job process on
tb2 is SIGKILLed between two checkpoints (a host that died: the survivors regroup in their own processes)
-> next step on the survivors; then tb1's link is cut inside its namespace (the main host, with
the run's records, gone silent) -> next step on the hosts left (tb3 takes the records up and goes on). The hosts
run their node exporters, installed by the provisioning playbook as `make provision` does, and the controller reads
the job's state from them (``--no-exporters``: without them, every poll goes through Ansible). With
``--controller gone`` the controller is detached (Ctrl-C: SIGINT to its process group) long enough before tb2's kill
that the hosts no longer count it as following, and with ``--controller died`` its process group is SIGKILLed just
before (a laptop that lost power): the survivors then decide themselves (train/recovery/consensus.py), and ``ugro
follow``, started after tb2's regroup, takes the run up and handles the cut. With ``--fault rank`` only tb2's rank is
SIGKILLed (a crashed rank on a host that stays up: the OOM killer, a driver error): tb1 and tb3 go on without it, tb2's
launcher starts its rank again and the group takes it back in (train/recovery/rejoin.py), and one more figure says when
the first step with tb2 back in ended. With ``--fault lend`` tb2 is taken back by hand instead (``ugro release tb2``, as
`make release` runs it: its ranks leave after a step and the others go on) and, once tb1 and tb3 stepped without it,
lent again (``ugro lend tb2``): the figures are the seconds from the command to tb2's ranks gone (their memory free)
and to the others' next step, and from ``ugro lend`` to the first step with tb2 back in. Step
times come from the ranks' own metrics.jsonl (wall clock of this machine, which all test hosts share); where
the time went comes from the run's restart record. The last line is one JSON object with the figures, the CPU
seconds the whole machine spent from the launch to the first step (``launch_cpu_s``: controller, Ansible, the three
hosts' ranks; divided by the cores it is the launch's floor here) and the machine's mean 1-minute load average.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from bench.cluster_job import tiny_job
from testbed import cluster as testbed_cluster
from testbed import exporters as testbed_exporters
from train.recovery.consensus import FOLLOW_GRACE_S
from ugro.hosts.playbook import runs_dir
from ugro.run import phases
from ugro.run.records import Restart, RunRecord

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.213.9.0/24"  # its own: `make test` and `make testbed-up` use others
NAME = "bench-recovery"
console = Console(width=170, soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0] if __doc__ else None)


def _rows(bed: Any, job_id: str) -> list[dict[str, Any]]:
    """Every metrics row any host wrote for the run (each host that was main holds its part)."""
    rows: list[dict[str, Any]] = []
    for host in bed.hosts:
        path = bed.dir / host.name / "opt" / "ugro" / "runs" / job_id / "metrics.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def _wait_step(bed: Any, step: int, proc: subprocess.Popen[str]) -> str:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the job ended before step {step}:\n{proc.communicate()[0][-3000:]}")
        runs = sorted(runs_dir().glob(f"{NAME}-*"))
        if runs and any(r["step"] >= step for r in _rows(bed, runs[-1].name)):
            return runs[-1].name
        time.sleep(0.1)


def _end_controller(proc: subprocess.Popen[str], how: str, poll_s: float) -> None:
    """Detach the controller (``gone``: Ctrl-C, then the hosts' grace for a controller that stopped asking runs
    out) or SIGKILL its whole process group (``died``)."""
    os.killpg(proc.pid, signal.SIGINT if how == "gone" else signal.SIGKILL)
    proc.communicate(timeout=120)
    if (
        how == "gone"
    ):  # train/recovery/consensus.py controller_follows: three polls and FOLLOW_GRACE_S since the last ask
        time.sleep(3 * poll_s + FOLLOW_GRACE_S + 1)


def _back_in(bed: Any, job_id: str, host: str, moment: float) -> float | None:
    """Seconds from ``moment`` to the end of the first step after it that ``host``'s ranks took part in."""
    rows = [r for r in _rows(bed, job_id) if r["time"] > moment]
    times = [r["time"] for r in rows if host in (r.get("ranks") or {}).get("host", [])]
    return min(times) - moment if times else None


def _first_step_after(bed: Any, job_id: str, moment: float, without: str) -> float:
    """Seconds from ``moment`` to the end of the first step after it that ``without`` (the host the fault took) had no
    part in: a step it finished as the fault came is not the others going on."""
    rows = [r for r in _rows(bed, job_id) if r["time"] > moment]
    after = [r["time"] for r in rows if without not in (r.get("ranks") or {}).get("host", [])]
    if not after:
        last = max((r["step"] for r in _rows(bed, job_id)), default=0)
        raise SystemExit(f"no step without {without} after its fault: the run ended first (its last step {last}); "
                         "the machine was too slow for the benchmark to place the fault inside the run")  # fmt: skip
    return min(after) - moment


def _restart_for(record: RunRecord, host: str, moment: float) -> tuple[Restart | None, str]:
    """The restart the run recorded for a fault of ``host`` made at ``moment`` (the first detected after it whose cause
    names that host, a host taken back in aside), and how the record reads: that restart's line, or what it holds after
    the moment instead."""
    for restart in record.restarts:
        if restart.decided_by != "rejoin" and host in restart.cause.host.split(", ") and restart.time >= moment:
            return restart, restart.line()
    later = [r.line() for r in record.restarts if r.time >= moment]
    return None, "no restart names it; " + ("; ".join(later) if later else "none recorded after it")


class CpuClock:
    """The machine's busy CPU seconds (every process, all cores), sampled every 0.1 s in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            times = psutil.cpu_times()
            self.samples.append((time.time(), sum(times) - times.idle - getattr(times, "iowait", 0.0)))
            time.sleep(0.1)

    def busy(self, start: float, end: float) -> float:
        """Busy CPU seconds between two moments (the samples nearest them)."""
        at = [min(self.samples, key=lambda s: abs(s[0] - moment))[1] for moment in (start, end)]
        return at[1] - at[0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Figure:
    """One row of the table: the seconds from a moment (the launch, a fault) to the next step, and where a fault's
    seconds went, from the restart the run recorded for it (ugro/run/records.py)."""

    what: str
    seconds: float
    goal: str
    restart: Restart | None = None
    fault_at: float = 0.0  # epoch seconds: when the fault was made
    recorded: str = ""  # how the run's record reads for the fault: its restart's line, or what it holds instead

    def spent(self) -> list[float]:
        """Detect, stop / tell, checkpoint, launch: the rest of ``seconds`` went to the next step."""
        restart = self.restart
        if restart is None:
            return []
        told = restart.membership_s if restart.how == "regroup" else restart.stop_s
        return [restart.time - self.fault_at, told or 0.0, restart.place_checkpoint_s or 0.0, restart.launch_s or 0.0]

    def row(self) -> list[str]:
        spent = self.spent()
        if self.restart is None:
            return [self.what, f"{self.seconds:.1f}", self.goal, *[""] * 7]
        return [self.what, f"{self.seconds:.1f}", self.goal, self.restart.how, *(f"{x:.1f}" for x in spent),
                f"{self.seconds - sum(spent):.1f}", str(self.restart.steps_redone)]  # fmt: skip


@dataclass(frozen=True)
class Result:
    """The last line printed (one JSON object): the figures docs/results.md quotes."""

    launch_to_first_step_s: float
    launch_cpu_s: float
    kill_to_next_step_s: float
    kill_steps_redone: int | None
    rendezvous_cut_to_next_step_s: float  # the main host's link cut (the key keeps its first name: results quote it)
    cut_steps_redone: int | None
    load: float
    polls: str
    controller: str
    kill_decided_by: str | None
    kill_recorded_as: str  # the restart's line in the run's record (make doctor's), or what the record holds instead
    cut_recorded_as: str
    fault: str
    kill_to_back_in_s: float | None
    rejoins: int
    collectives: str | None  # the ranks' backend, as the run recorded it (run.json)
    release_to_freed_s: float | None = None  # --fault lend: `ugro release tb2` -> tb2's ranks gone
    lend_to_first_step_s: float | None = None  # `ugro lend tb2` -> the first step with tb2 back in


@dataclass
class Timeline:
    """What happened when (epoch seconds), as the benchmark drove the run."""

    job_id: str = ""
    started: float = 0.0
    killed: float = 0.0  # tb2's fault: its kill, or `ugro release tb2`
    freed: float = 0.0  # --fault lend: tb2's ranks gone
    lent: float = 0.0  # `ugro lend tb2`
    cut: float = 0.0
    loads: list[float] = field(default_factory=list)
    output: str = ""  # what the (last) controller printed


def _controller(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ugro.cli", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def _drive(bed: Any, cluster: Path, job_file: Path, controller: str, fault: str) -> Timeline:
    """Run the job through its two faults to its end; when each happened."""
    tb = testbed_cluster
    at = Timeline(loads=[os.getloadavg()[0]], started=time.time())
    proc = _controller(
        ["train", "--job", str(job_file), "--inventory", str(cluster), "--poll", "2", "--skip-preflight"]
    )
    at.job_id = job_id = _wait_step(bed, 12, proc)  # between the checkpoints of steps 10 and 15
    at.loads.append(os.getloadavg()[0])
    if controller != "follows":
        _end_controller(proc, controller, 2.0)
    at.killed = killed = time.time()
    if fault == "lend":
        _take_back(bed, cluster, at)
    elif fault == "rank":
        tb.kill_ranks(bed.dir, "tb2")
    else:
        tb.kill_processes(bed.dir, "tb2", f"/opt/ugro/runs/{job_id}")
    if controller != "follows":  # the survivors decide; then a controller takes the run up for the cut
        while not any(r["time"] > killed for r in _rows(bed, job_id)):
            if time.time() > killed + 120:  # the survivors never went on (or the run had ended before the kill)
                raise SystemExit("no step on tb1 and tb3 within 120 s of tb2's kill, with no controller")
            time.sleep(0.1)
        proc = _controller(["follow", "--job-id", job_id])
    _wait_step(bed, 17, proc)
    while not any(r["time"] > killed and r["step"] >= 19 for r in _rows(bed, job_id)):
        time.sleep(0.1)
    # One fault at a time: tb2's rank back in the group and two steps done with it before tb1's cut.
    back_from = at.lent if fault == "lend" else killed  # lent: tb2 trained on until it left after the release
    while fault in ("rank", "lend") and len([r for r in _rows(bed, job_id) if r["time"] > back_from
                                   and "tb2" in (r.get("ranks") or {}).get("host", [])]) < 2:  # fmt: skip
        if time.time() > killed + 300:
            raise SystemExit("tb2's rank did not come back within 300 s of its kill")
        time.sleep(0.1)
    at.loads.append(os.getloadavg()[0])
    at.cut = time.time()
    tb.set_link(bed.dir, "tb1", up=False)
    at.output, _ = proc.communicate(timeout=900)
    (runs_dir() / job_id / "controller.log").write_text(at.output)
    at.loads.append(os.getloadavg()[0])
    if proc.returncode != 0:
        raise SystemExit(f"the job failed:\n{at.output[-4000:]}")
    return at


def _take_back(bed: Any, cluster: Path, at: Timeline) -> None:
    """tb2 taken back by hand, then lent again once tb1 and tb3 stepped without it: when its ranks were gone, and when
    ``ugro lend`` began."""
    where = ["--inventory", str(cluster), "--job-id", at.job_id, "--wait", "0"]
    release = _controller(["release", "tb2", *where])
    while testbed_cluster.host_ranks(bed.dir, "tb2"):
        if time.time() > at.killed + 120:
            raise SystemExit("tb2's ranks did not leave within 120 s of `ugro release tb2`")
        time.sleep(0.05)
    at.freed = time.time()
    if release.wait(timeout=120) != 0:
        raise SystemExit(f"ugro release failed:\n{release.communicate()[0][-3000:]}")
    while not any(r["time"] > at.freed and "tb2" not in r["ranks"]["host"] for r in _rows(bed, at.job_id)):
        if time.time() > at.freed + 120:
            raise SystemExit("tb1 and tb3 took no step without tb2 within 120 s of its ranks' end")
        time.sleep(0.1)
    at.lent = time.time()
    lend = _controller(["lend", "tb2", *where])
    if lend.wait(timeout=120) != 0:
        raise SystemExit(f"ugro lend failed:\n{lend.communicate()[0][-3000:]}")


def _figures(bed: Any, at: Timeline, record: RunRecord, fault: str) -> list[Figure]:
    """The launch's figure, then each fault's, with the restart the run recorded for it (found by the host its cause
    names; a host taken back in is a record of its own)."""
    first = min(r["time"] for r in _rows(bed, at.job_id)) - at.started
    figures = [Figure("launch -> first optimizer step (normal start)", first, "goal <= 15 s")]
    killed_what = {"rank": "SIGKILL of tb2's rank", "host": "SIGKILL of tb2's job", "lend": "`ugro release tb2`"}
    for what, moment, goal, host in [
        (f"{killed_what[fault]} -> next step on tb1 + tb3", at.killed, "goal <= 10 s, 0 redone", "tb2"),
        ("tb1 (the main host) link cut -> next step on the hosts left", at.cut, "goal <= 20 s", "tb1"),
    ]:
        seconds = _first_step_after(bed, at.job_id, moment, without=host)
        restart, recorded = _restart_for(record, host, moment)
        figures.append(Figure(what, seconds, goal, restart, moment, recorded))
    return figures


def _print(figures: list[Figure], record: RunRecord, run_dir: Path, back: float | None, launch_cpu: float,
           lent: tuple[float, float] | None = None) -> None:  # fmt: skip
    table = Table(title="recovery on the 3-host test cluster (this machine's load shows in every figure)")
    for column in ("what", "seconds", "goal", "how", "detect", "stop / tell", "checkpoint", "launch",
                   "to next step", "redone"):  # fmt: skip
        table.add_column(column)
    for figure in figures:
        table.add_row(*figure.row())
    console.print(table)
    for figure in figures[1:]:
        console.print(f"the run's record of {figure.what.split(' -> ')[0]}: {figure.recorded}", highlight=False)
    if back is not None:
        console.print(f"tb2's rank SIGKILLed -> first step with tb2 back in: {back:.1f} s", highlight=False)
    if lent is not None:
        console.print(f"`ugro release tb2` -> tb2's ranks gone: {lent[0]:.1f} s; `ugro lend tb2` -> first step with "
                      f"tb2 back in: {lent[1]:.1f} s", highlight=False)  # fmt: skip
    console.print(f"final hosts {record.hosts}, main host {record.main_host}; run {run_dir}", highlight=False)
    console.print(f"the first launch's phases (s): {json.dumps(phases.recorded(run_dir))}", highlight=False)
    console.print(f"CPU the machine spent from the launch to the first step (every process): {launch_cpu:.1f} s "
                  f"on {psutil.cpu_count()} cores", highlight=False)  # fmt: skip


@app.command()
def main(
    exporters: bool = typer.Option(True, help="run the node exporters, which the controller's polls read"),
    controller: str = typer.Option(
        "follows", help="follows: throughout; gone: detached before tb2's kill; died: SIGKILLed just before it"
    ),
    fault: str = typer.Option(
        "host", help="host: every job process on tb2 is SIGKILLed; rank: only its rank; lend: tb2 taken back and lent"
    ),
    rejoins: int = typer.Option(
        2, help="the job's distributed.rejoins (0: a crashed rank is a relaunch of every host)"
    ),
) -> None:
    """Bring up the test cluster, run the job with its two faults, print the figures."""
    if controller not in ("follows", "gone", "died"):
        raise typer.BadParameter(f"--controller {controller}: follows, gone or died")
    if fault not in ("host", "rank", "lend"):
        raise typer.BadParameter(f"--fault {fault}: host, rank or lend")
    if fault == "lend" and controller != "follows":
        raise typer.BadParameter("--fault lend: with --controller follows (`ugro release` needs no controller)")
    tb = testbed_cluster
    directory = Path(tempfile.mkdtemp(prefix="ugro-bench-recovery-"))
    jobs = contextlib.ExitStack()
    # Every rank on the test backend that completes, orders and fails as NCCL does (train/dist/nccl_like.py): a lost
    # peer hangs a collective until the watchdog's timeout, as it would between GPUs, where plain gloo fails it at once.
    bed = tb.up(directory, hosts=3, subnet=SUBNET, session_env={"UGRO_NCCL_LIKE": "1"})
    jobs.callback(tb.down, directory)  # the last to go, whatever else fails on the way out
    with jobs:
        cluster = tb.one_rank_per_host(bed, directory / "cluster.yml")
        if exporters:
            jobs.callback(testbed_exporters.set_state, cluster, "stopped")
            testbed_exporters.set_state(cluster, "started")
        # Detached, the controller is waited out for three polls and 10 s before tb2's kill; `ugro release` and
        # `ugro lend` run playbooks: the run must outlast them.
        long = controller == "gone" or fault == "lend"
        # The cut comes after step 19: 31 steps more leave room for this process to be late on a loaded machine.
        train = {"max_steps": 400 if long else 50, "global_batch_size": 6, "log_every": 10}
        job = tiny_job(NAME, train=train, checkpoint={"every": 5, "keep_last": 3},
                       distributed={"timeout_s": 20, "rejoins": rejoins})  # fmt: skip
        job_file = jobs.enter_context(job)
        jobs.callback(tb.set_link, bed.dir, "tb1", up=True)  # the first: the exporters' stop needs tb1's link
        clock = CpuClock()
        at = _drive(bed, cluster, job_file, controller, fault)
        clock.stop()
        run_dir = runs_dir() / at.job_id
        record = RunRecord.read(run_dir)
        if record is None:
            raise SystemExit(f"{run_dir}: the run left no record (run.json)")
        figures = _figures(bed, at, record, fault)
        launch_cpu = clock.busy(at.started, at.started + figures[0].seconds)
        back = _back_in(bed, at.job_id, "tb2", at.killed) if fault == "rank" else None
        lent_back = _back_in(bed, at.job_id, "tb2", at.lent) if fault == "lend" else None
        lent = (at.freed - at.killed, lent_back) if lent_back is not None else None
        _print(figures, record, run_dir, back, launch_cpu, lent)
        kill, cut = figures[1], figures[2]
        result = Result(
            launch_to_first_step_s=round(figures[0].seconds, 1), launch_cpu_s=round(launch_cpu, 1),
            kill_to_next_step_s=round(kill.seconds, 1),
            kill_steps_redone=kill.restart.steps_redone if kill.restart else None,
            rendezvous_cut_to_next_step_s=round(cut.seconds, 1),
            cut_steps_redone=cut.restart.steps_redone if cut.restart else None,
            load=round(sum(at.loads) / len(at.loads), 2), polls="exporters" if exporters else "ansible",
            controller=controller, kill_decided_by=kill.restart.decided_by if kill.restart else None, fault=fault,
            kill_recorded_as=kill.recorded, cut_recorded_as=cut.recorded,
            kill_to_back_in_s=round(back, 1) if back is not None else None, rejoins=rejoins,
            collectives=json.loads((run_dir / "run.json").read_text()).get("collectives"),
            release_to_freed_s=round(lent[0], 1) if lent else None,
            lend_to_first_step_s=round(lent[1], 1) if lent else None,
        )  # fmt: skip
        print(json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    app()
