"""A run's state on every host, read from the node exporters while the controller follows the run.

Each exporter serves its host's job state at ``/job/<job-id>`` (ugro/module_utils/ugro_exporter.py): what the status
playbook's fact module returns, read from the same files by the same code. Over HTTP a poll of the cluster costs the
controller and the hosts milliseconds; through Ansible it costs ~3 CPU-s of the controller and a Python start on
every host (docs/results.md, "Recovery"). The controller takes an exporter's answer only where it runs the
controller's own ``ugro_jobstate.py`` (the answer carries its hash) and names the host asked; every other host is
polled through Ansible (ugro/run/follow.py), and a host whose exporter failed while Ansible reached it is not asked
over HTTP again in this run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from ugro.module_utils import ugro_jobstate
from ugro.monitoring.monitor import Target

TIMEOUT_S = 1.0  # an exporter on the LAN answers in milliseconds; a host that does not is asked through Ansible


class ExporterStates:
    """The job's state on each host of ``targets`` from its exporter."""

    def __init__(self, targets: list[Target], job_id: str, timeout_s: float = TIMEOUT_S) -> None:
        self.targets = {t.host: t for t in targets}
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.digest = ugro_jobstate.digest()
        self.given_up: dict[str, str] = {}  # host -> why it is asked through Ansible for the rest of the run

    def read(self, hosts: list[str], main: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The states of those of ``hosts`` whose exporters answered, read at once (``main``: the host that keeps the
        run), and why each other host asked gave none (a host given up on is not asked)."""
        asked = [h for h in hosts if h in self.targets and h not in self.given_up]
        if not asked:
            return {}, {}
        with (
            httpx.Client(timeout=self.timeout_s, trust_env=False) as client,  # no proxy between hosts of one LAN
            ThreadPoolExecutor(max_workers=len(asked), thread_name_prefix="ugro-job-state") as pool,
        ):
            answers = dict(zip(asked, pool.map(lambda host: self._one(client, host, host == main), asked), strict=True))
        found = {host: answer for host, answer in answers.items() if not isinstance(answer, str)}
        return found, {host: answer for host, answer in answers.items() if isinstance(answer, str)}

    def give_up(self, host: str, why: str) -> None:
        """``host`` answered through Ansible where its exporter did not: ask it through Ansible from now on."""
        self.given_up[host] = why

    def _one(self, client: httpx.Client, host: str, main: bool) -> dict[str, Any] | str:
        """The host's job state, or why there is none."""
        target = self.targets[host]
        at = target.endpoint
        try:
            response = client.get(f"http://{at}/job/{self.job_id}" + ("?main=1" if main else ""))
        except httpx.HTTPError as exc:
            return f"{at} {type(exc).__name__}: {exc}".strip()
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("application/json"):
            return f"{at}: HTTP {response.status_code} (an exporter older than this controller: `make provision`)"
        try:
            state = response.json()
        except ValueError:
            return f"{at}: not JSON"
        if not isinstance(state, dict) or state.get("jobstate") != self.digest:
            return f"{at}: the exporter runs another ugro_jobstate.py than this controller (`make provision`)"
        if state.get("host") != host or not isinstance(state.get("state"), str):
            return f"{at}: the exporter reports host {state.get('host')!r} (exporter_host_name)"
        del state["jobstate"]
        return state
