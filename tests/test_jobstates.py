"""The controller's reader of the exporters' job states (ugro/monitoring/jobstates.py) against a real HTTP server:
a host whose exporter failed once is asked again later, with back-off, and each failure says what happened."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from testbed.net import free_port
from ugro.module_utils import ugro_jobstate
from ugro.monitoring import jobstates
from ugro.monitoring.jobstates import ExporterStates
from ugro.monitoring.monitor import Target

JOB = "backoff-20261127-000000"
# The reader's timeout, and how long a slow answer takes. A fast answer comes from a thread of this process, which
# shares its interpreter with the test: at 0.2 s it missed the timeout once at load 4.5 (a CI run).
TIMEOUT_S, SLOW_S = 1.0, 2.5


class _Exporter(BaseHTTPRequestHandler):
    """Answers as the node exporter does; ``script`` says how, one entry per request (then the last again)."""

    script: ClassVar[list[str]] = []
    asked: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        how = self.script[min(len(self.asked), len(self.script) - 1)]
        self.asked.append(self.path)
        if how == "slow":
            time.sleep(SLOW_S)
        if how == "no-run":
            body, code = {"error": f"node1 has no run {JOB}"}, 404
        else:
            body, code = {"host": "node1", "state": "running", "jobstate": ugro_jobstate.digest()}, 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def exporter() -> Iterator[Target]:
    _Exporter.asked = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Target("node1", "127.0.0.1", server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_slow_exporter_is_asked_again_later_and_less_often_each_time(exporter: Target) -> None:
    _Exporter.script = ["slow", "slow", "fast"]
    now = [1000.0]
    states = ExporterStates([exporter], JOB, timeout_s=TIMEOUT_S, clock=lambda: now[0])
    found, missed = states.read(["node1"], main="node1")
    assert not found and missed["node1"].endswith("no answer within 1 s (a busy host or a slow link)")
    assert states.give_up("node1", missed["node1"]) == jobstates.FIRST_RETRY_S  # Ansible answered meanwhile
    now[0] += jobstates.FIRST_RETRY_S - 1
    assert states.read(["node1"], main="node1") == ({}, {}) and len(_Exporter.asked) == 1  # not asked meanwhile
    now[0] += 1
    found, missed = states.read(["node1"], main="node1")  # asked again: slow again
    assert len(_Exporter.asked) == 2 and not found
    assert states.give_up("node1", missed["node1"]) == 2 * jobstates.FIRST_RETRY_S
    now[0] += 2 * jobstates.FIRST_RETRY_S
    found, missed = states.read(["node1"], main="node1")
    assert found["node1"]["state"] == "running" and not missed and not states.given_up
    assert states.give_up("node1", "again") == jobstates.FIRST_RETRY_S  # an answer resets the back-off


def test_each_failure_says_what_happened(exporter: Target) -> None:
    _Exporter.script = ["no-run"]
    refused = Target("node2", "127.0.0.1", free_port())
    states = ExporterStates([exporter, refused], JOB, timeout_s=2.0)
    _, missed = states.read(["node1", "node2"], main="node1")
    assert f"node1 has no run {JOB}: the exporter does not see the run's directory" in missed["node1"]
    assert "ProtectHome=yes" in missed["node1"]
    assert "connection refused (ConnectError): no exporter listens" in missed["node2"]
