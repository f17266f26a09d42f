"""The node exporter against the clients the firewall lets reach its port: members, the controller, Prometheus.

Each test runs the real exporter (``ugro_exporter.py serve``, as role exporter starts it) on a loopback port and
attacks it over real HTTP: a symlink planted in the run's directory where a follow poll used to write, a poll with
``?follow=`` from an address that is not the controller's, slow clients that send half a request and wait, a
request too large. The controller is 127.0.0.1; "someone else" connects from another loopback address.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import prometheus_client
import psutil
import pytest
from helpers import REPO, free_port, unavailable

from train.recovery import consensus
from ugro.module_utils import ugro_exporter, ugro_jobstate

EXPORTER = REPO / "ugro" / "module_utils" / "ugro_exporter.py"
UNIT = REPO / "roles" / "exporter" / "templates" / "ugro-exporter.service.j2"
HOST = "node4070"
JOB = "plant-20260101-000000"
CONTROLLER = "127.0.0.1"
SOMEONE = "127.0.0.2"  # a member, Prometheus, a guest: anyone but the controller


@dataclass
class Exporter:
    process: subprocess.Popen[bytes]
    port: int
    runs: Path
    state: Path
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, source: str = CONTROLLER, timeout_s: float = 5.0) -> httpx.Response:
        """A GET from ``source`` (a loopback address: the client's address the exporter sees)."""
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=timeout_s, trust_env=False) as client:
            return client.get(self.url(path))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))


@dataclass(frozen=True)
class Installed:
    """The exporter as provisioning leaves it for its service's user: a Python that user can run, the two files."""

    python: str
    exporter: Path
    env: dict[str, str]


def _as_user(user: tuple[int, int], argv: list[str]) -> list[str]:
    """``argv`` as systemd's DynamicUser runs it: an unprivileged user and group of its own, no other groups."""
    return ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *argv]


def _python_for(user: tuple[int, int]) -> str:
    """A Python of this one's version that ``user`` can run. This venv's interpreter may lie where only root may
    enter (a pyenv under /root, a checkout under a 0700 directory); the system's of the same version then serves."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
                  f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]  # fmt: skip
    probe = f"import sys; assert sys.version_info[:2] == {sys.version_info[:2]!r}"
    for python in dict.fromkeys(candidates):
        ran = subprocess.run(_as_user(user, [python, "-I", "-c", probe]), capture_output=True, check=False)
        if ran.returncode == 0:
            return python
    unavailable(f"no Python {version} that uid {user[0]} may run (tried {', '.join(dict.fromkeys(candidates))}): "
                f"install python{version} from the distribution")  # fmt: skip


def _install(top: Path, user: tuple[int, int]) -> Installed:
    """Copy what the service's user runs to ``top`` (which the others may enter), as role exporter installs it:
    the exporter and ugro_jobstate.py (0644 in a 0755 directory), and the two packages it imports from the node's
    venv (prometheus_client, psutil). The checkout and its .venv may lie where only root may enter."""
    install = top / "opt-ugro-exporter"
    site = install / "site-packages"
    site.mkdir(parents=True)
    for name in ("ugro_exporter.py", "ugro_jobstate.py"):
        shutil.copyfile(EXPORTER.parent / name, install / name)
    for module in (prometheus_client, psutil):
        package = Path(str(module.__file__)).parent
        shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    for path in [install, *install.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644 | (path.stat().st_mode & 0o111))
    return Installed(_python_for(user), install / "ugro_exporter.py", {"PATH": os.defpath, "PYTHONPATH": str(site)})


def _start(runs: Path, state: Path, log: Path, installed: Installed | None = None,
           user: tuple[int, int] | None = None) -> Exporter:  # fmt: skip
    port = free_port()
    python, exporter, env = (installed.python, installed.exporter, installed.env) if installed else (
        sys.executable, EXPORTER, None)  # fmt: skip
    argv = [python, str(exporter), "serve", "--listen", "127.0.0.1", "--port", str(port), "--host", HOST,
            "--runs-dir", str(runs), "--state-dir", str(state), "--controller", CONTROLLER]  # fmt: skip
    if user is not None:
        argv = _as_user(user, argv)
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return Exporter(process, port, runs, state, log)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the exporter did not start: {log.read_text()}")
        time.sleep(0.05)


def _stop(exporter: Exporter) -> None:
    exporter.process.terminate()
    try:
        exporter.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        exporter.process.kill()
        exporter.process.wait()


@pytest.fixture()
def exporter(tmp_path: Path) -> Iterator[Exporter]:
    """The exporter of HOST over a run of JOB with HOST's directory in it (no process of it alive)."""
    runs = tmp_path / "runs"
    (runs / JOB / "hosts" / HOST).mkdir(parents=True)
    running = _start(runs, tmp_path / "state", tmp_path / "exporter.log")
    try:
        yield running
    finally:
        _stop(running)


def _tree(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``directory``: its mode, size and, for a symlink, where it points (never followed)."""
    found = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        found[str(path.relative_to(directory))] = (
            info.st_mode,
            info.st_size,
            os.readlink(path) if path.is_symlink() else "",
        )
    return found


def test_a_follow_poll_writes_nothing_into_the_run_and_follows_no_symlink_planted_there(
    exporter: Exporter, tmp_path: Path
) -> None:
    """The job user owns its run's directory: what it plants there (a symlink named as the exporter's file would be,
    to a file of root's) must not make the exporter, root in process mode, write through it."""
    victim = tmp_path / "shadow"
    victim.write_text("root:x:0:0\n")
    host_dir = exporter.runs / JOB / "hosts" / HOST
    for name in (ugro_jobstate.FOLLOWED, f"{ugro_jobstate.FOLLOWED}.tmp{exporter.pid}"):
        (host_dir / name).symlink_to(victim)
    before = _tree(exporter.runs)
    for source in (CONTROLLER, SOMEONE):
        answer = exporter.get(f"/job/{JOB}?main=1&follow=2", source)
        assert answer.status_code == 200 and answer.json()["state"] == "lost", answer.text
    assert victim.read_text() == "root:x:0:0\n"
    assert _tree(exporter.runs) == before  # nothing written, renamed or removed in the run


def test_only_the_controllers_poll_sets_the_follow_mark_and_the_ranks_read_it(exporter: Exporter) -> None:
    """Anyone the firewall lets reach the port (a member, Prometheus) may read the job's state; only a poll from the
    controller's address says that a controller follows the run, in the exporter's own directory."""
    run_dir = exporter.runs / JOB
    marks = exporter.state / "followed"
    someone = exporter.get(f"/job/{JOB}?main=1&follow=2", SOMEONE)
    assert someone.status_code == 200 and someone.json()["host"] == HOST
    assert not consensus.controller_follows(run_dir, HOST)
    assert not (run_dir / "hosts" / HOST / ugro_jobstate.FOLLOWED).exists()
    assert not consensus.controller_follows(run_dir, HOST, marks=marks)
    assert someone.json()["follow"].startswith(f"not recorded: {SOMEONE} is not the controller")
    # The controller's own poll (every 2 s): the ranks read the mark the exporter keeps for it.
    assert exporter.get(f"/job/{JOB}?main=1&follow=2").json()["follow"] == "recorded"
    assert consensus.controller_follows(run_dir, HOST, marks=marks)
    assert not consensus.controller_follows(run_dir, HOST, now=time.time() + 3 * 2 + consensus.FOLLOW_GRACE_S + 1,
                                            marks=marks)  # fmt: skip
    assert not (run_dir / "hosts" / HOST / ugro_jobstate.FOLLOWED).exists()  # still nothing in the run
    mark = marks / JOB / f"{HOST}.json"
    assert stat.S_IMODE(mark.stat().st_mode) == 0o644 and stat.S_IMODE(mark.parent.stat().st_mode) == 0o755
    # A poll without ?follow= (make status, the dashboards) and one for a run this host does not have mark nothing.
    mark.unlink()
    assert "follow" not in exporter.get(f"/job/{JOB}?main=1").json()
    assert exporter.get("/job/other-20260101-000000?follow=2").status_code == 404
    assert not mark.exists() and not (marks / "other-20260101-000000").exists()
    assert f"{SOMEONE} is not the controller" in exporter.log.read_text()  # said once, in the exporter's log


def test_slow_clients_hold_no_worker_and_a_scrape_is_still_answered(exporter: Exporter) -> None:
    """Slow-loris: clients that send half a request and wait. The exporter reads requests in one thread and hands
    only whole ones to its few workers, drops a client that has not sent its request within the deadline (one byte
    at a time does not extend it), and refuses connections beyond its per-address limit at once."""
    limits = ugro_exporter.Limits()
    sources = [f"127.0.0.{n}" for n in range(2, 6)]
    slow = [socket.create_connection(("127.0.0.1", exporter.port), source_address=(sources[i % 4], 0))
            for i in range(40)]  # fmt: skip
    began = time.monotonic()
    for client in slow:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: tb1\r\n")
    trickle = slow[0]
    scrape_s = time.monotonic()
    answer = exporter.get("/metrics", timeout_s=3)
    assert answer.status_code == 200 and "ugro_host_cpus" in answer.text
    assert time.monotonic() - scrape_s < 2.0
    # The main thread, the one that accepts and reads, the workers, NVML's XID watcher (where there is a GPU).
    assert exporter.threads() <= limits.workers + 3, os.listdir(f"/proc/{exporter.pid}/task")
    # One address's connections beyond the limit are closed at once, the others' left open.
    crowd = [socket.create_connection(("127.0.0.1", exporter.port), source_address=("127.0.0.9", 0), timeout=2)
             for _ in range(limits.per_address + 2)]  # fmt: skip
    assert [_closed_within(c, 2.0) for c in crowd[-2:]] == [True, True]
    assert not _closed_within(crowd[0], 0.2)
    for client in crowd:
        client.close()
    # The slow ones are dropped at the deadline, the one that trickles a byte every 0.5 s too.
    while time.monotonic() - began < limits.request_s - 0.5:
        trickle.send(b"X")
        time.sleep(0.5)
    assert all(_closed_within(c, limits.request_s + 2) for c in slow)
    assert time.monotonic() - began < limits.request_s + 2
    assert exporter.get("/metrics").status_code == 200
    for client in slow:
        client.close()


def _closed_within(client: socket.socket, seconds: float) -> bool:
    """The server closed the connection (EOF or reset) within ``seconds``."""
    client.settimeout(seconds)
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_request_larger_than_the_limit_is_refused(exporter: Exporter) -> None:
    # ~60 KB in 60 headers: within http.server's own limits (100 headers, 64 KiB a line), over the exporter's.
    headers = "".join(f"X-Filler-{n}: {'a' * 1000}\r\n" for n in range(60))
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as client:
        client.sendall(f"GET /metrics HTTP/1.1\r\nHost: tb1\r\n{headers}\r\n".encode())
        answer = client.recv(4096)
    assert re.match(rb"HTTP/1\.[01] 431 ", answer), answer
    assert exporter.get("/metrics").status_code == 200


def test_as_systemd_runs_it_the_mark_is_set_and_read(tmp_path: Path) -> None:
    """Under systemd the exporter runs as a dynamic user that cannot write the run's directory (the job user's):
    the mark lives in its RuntimeDirectory (/run/ugro-exporter, the unit's), where the ranks read it."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        unavailable("running the exporter as another user needs root and setpriv (util-linux)")
    unit = UNIT.read_text()
    assert re.search(rf"^RuntimeDirectory={ugro_exporter.STATE_DIR.name}$", unit, re.M)
    assert re.search(r"^RuntimeDirectoryMode=0755$", unit, re.M)
    assert ugro_exporter.STATE_DIR.parent == Path("/run")  # RuntimeDirectory= is under /run
    assert consensus.EXPORTER_MARKS == ugro_exporter.STATE_DIR / ugro_exporter.FOLLOWED_DIR  # where the ranks look
    dynamic, job_user = (61234, 61234), 61235
    top = Path(tempfile.mkdtemp(prefix="ugro-exporter-systemd-"))  # under /tmp: the others may enter it
    try:
        top.chmod(0o755)
        runs = top / "runs"
        host_dir = runs / JOB / "hosts" / HOST
        host_dir.mkdir(parents=True)
        for path in (runs, runs / JOB, runs / JOB / "hosts", host_dir):
            os.chown(path, job_user, job_user)
        state = top / "ugro-exporter"  # as systemd creates RuntimeDirectory=: the dynamic user's, 0755
        state.mkdir(mode=0o755)
        os.chown(state, *dynamic)
        running = _start(runs, state, top / "exporter.log", _install(top, dynamic), user=dynamic)
        try:
            assert running.get(f"/job/{JOB}?main=1&follow=2").json()["follow"] == "recorded"
        finally:
            _stop(running)
        mark = state / "followed" / JOB / f"{HOST}.json"
        assert mark.stat().st_uid == dynamic[0] and stat.S_IMODE(mark.stat().st_mode) == 0o644
        assert consensus.controller_follows(runs / JOB, HOST, marks=state / "followed")
        assert sorted(p.name for p in host_dir.iterdir()) == []
    finally:
        shutil.rmtree(top)
