"""A run's state on every host, read from the node exporters while the controller follows the run.

Each exporter serves its host's job state at ``/job/<job-id>`` (ugro/module_utils/ugro_exporter.py): what the status
playbook's fact module returns, read from the same files by the same code. Over HTTP a poll of the cluster costs the
controller and the hosts milliseconds; through Ansible it costs ~3 CPU-s of the controller and a Python start on
every host (docs/results.md, "Recovery"). The controller takes an exporter's answer only where it runs the
controller's own ``ugro_jobstate.py`` (the answer carries its hash) and names the host asked; every other host is
polled through Ansible (ugro/run/follow.py). A host whose exporter failed while Ansible reached it is asked through
Ansible for a while, then over HTTP again: after ``FIRST_RETRY_S``, then twice as long after every further failure,
at most ``LAST_RETRY_S`` (one slow answer while its ranks start must not cost a playbook a poll for the whole run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from ugro.module_utils import ugro_jobstate
from ugro.monitoring.monitor import Target

TIMEOUT_S = 1.0  # an exporter on the LAN answers in milliseconds; a host that does not is asked through Ansible
FIRST_RETRY_S = 30.0
LAST_RETRY_S = 600.0


class ExporterStates:
    """The job's state on each host of ``targets`` from its exporter."""

    def __init__(
        self, targets: list[Target], job_id: str, timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic, follow_poll_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.targets = {t.host: t for t in targets}
        self.job_id = job_id
        self.follow_poll_s = follow_poll_s  # > 0: the controller that follows the run asks (ugro_jobstate FOLLOWED)
        self.timeout_s = timeout_s
        self.digest = ugro_jobstate.digest()
        self.clock = clock
        self.given_up: dict[str, str] = {}  # host -> why it is asked through Ansible now
        self._retry: dict[str, tuple[float, float]] = {}  # host -> (when to ask its exporter again, the wait before)

    def read(self, hosts: list[str], main: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """The states of those of ``hosts`` whose exporters answered, read at once (``main``: the host that keeps the
        run), and why each other host asked gave none (a host given up on is not asked)."""
        now = self.clock()
        asked = [h for h in hosts if h in self.targets and (h not in self.given_up or now >= self._retry[h][0])]
        if not asked:
            return {}, {}
        with (
            httpx.Client(timeout=self.timeout_s, trust_env=False) as client,  # no proxy between hosts of one LAN
            ThreadPoolExecutor(max_workers=len(asked), thread_name_prefix="ugro-job-state") as pool,
        ):
            answers = dict(zip(asked, pool.map(lambda host: self._one(client, host, host == main), asked), strict=True))
        found = {host: answer for host, answer in answers.items() if not isinstance(answer, str)}
        for host in found:  # answered again: asked over HTTP from now on
            self.given_up.pop(host, None)
            self._retry.pop(host, None)
        return found, {host: answer for host, answer in answers.items() if isinstance(answer, str)}

    def give_up(self, host: str, why: str) -> float:
        """``host`` answered through Ansible where its exporter did not: ask it through Ansible for a while, and its
        exporter again after the seconds returned (twice as long as the last time, from ``FIRST_RETRY_S`` to
        ``LAST_RETRY_S``)."""
        last = self._retry[host][1] if host in self._retry else 0.0
        wait = min(LAST_RETRY_S, max(FIRST_RETRY_S, 2 * last))
        self.given_up[host] = why
        self._retry[host] = (self.clock() + wait, wait)
        return wait

    def _one(self, client: httpx.Client, host: str, main: bool) -> dict[str, Any] | str:
        """The host's job state, or why there is none."""
        target = self.targets[host]
        at = target.endpoint
        try:
            query = {"main": "1"} if main else {}
            if self.follow_poll_s > 0:
                query["follow"] = f"{self.follow_poll_s:g}"
            response = client.get(f"http://{at}/job/{self.job_id}", params=query)
        except httpx.TimeoutException:
            return f"{at}: no answer within {self.timeout_s:g} s (a busy host or a slow link)"
        except httpx.ConnectError as exc:
            if "refused" in str(exc).lower():
                return f"{at}: connection refused (ConnectError): no exporter listens (`make provision` installs it)"
            return f"{at}: cannot connect (ConnectError): {exc}"
        except httpx.HTTPError as exc:
            return f"{at} {type(exc).__name__}: {exc}".strip()
        json_answer = response.headers.get("content-type", "").startswith("application/json")
        if response.status_code == 404 and json_answer:  # the exporter's own "no such run"
            return (f"{at}: {_error(response)}: the exporter does not see the run's directory (its unit hides /home "
                    "with ProtectHome=yes where the code lives there, or it reads another code_dir)")  # fmt: skip
        if response.status_code == 404:
            return f"{at}: HTTP 404 on /job/ (an exporter older than this controller: `make provision`)"
        if response.status_code != 200 or not json_answer:
            return f"{at}: HTTP {response.status_code}: {_error(response)}"
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


def _error(response: httpx.Response) -> str:
    """What an answer that is not a job state says, in one line."""
    try:
        said = response.json()
    except ValueError:  # json.JSONDecodeError included
        return " ".join(response.text.split())[:200] or "no body"
    return str(said.get("error", said)) if isinstance(said, dict) else str(said)[:200]
