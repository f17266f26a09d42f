"""Drive an Ansible playbook through ansible-runner, in the background, collecting what failed."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# The controller's runs directory (run records, collected logs and results, runs/latest, the playbooks' private
# directories): <repo>/runs unless UGRO_RUNS_DIR names another, e.g. a bigger disk, or a test's temporary directory.
RUNS_ENV = "UGRO_RUNS_DIR"


def runs_dir() -> Path:
    """The controller's runs directory: ``$UGRO_RUNS_DIR``, or ``<repo>/runs``."""
    value = os.environ.get(RUNS_ENV)
    return Path(value).resolve() if value else REPO / "runs"


# ansible-runner's event callback reads these from the environment as AWX's job numbers and event switches. A
# caller's own variable of the same name (`make status JOB_ID=<job-id>` puts JOB_ID in the environment) would
# break every event ("invalid literal for int()") or silence the events the controller reads its facts from,
# so the controller's playbooks always run with them neutral.
RUNNER_ENV = {
    "JOB_ID": "",
    "AD_HOC_COMMAND_ID": "",
    "PROJECT_UPDATE_ID": "",
    "RUNNER_OMIT_EVENTS": "False",
    "RUNNER_ONLY_FAILED_EVENTS": "False",
}


# What ansible-runner's record of a run (artifacts/<id>/command) keeps of the environment once the playbook has
# ended: the variables the controller and ansible-runner set for Ansible. It writes the controller's whole
# environment there first, tokens and keys a user's shell holds included (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...).
RECORDED_ENV = {
    *RUNNER_ENV,
    "ANSIBLE_CONFIG",
    "PATH",
    "ANSIBLE_STDOUT_CALLBACK",
    "ANSIBLE_CALLBACK_PLUGINS",
    "ANSIBLE_RETRY_FILES_ENABLED",
    "ANSIBLE_HOST_KEY_CHECKING",
    "ANSIBLE_CACHE_PLUGIN",
    "ANSIBLE_CACHE_PLUGIN_CONNECTION",
    "AWX_ISOLATED_DATA_DIR",
}


def forget_environment(runner: Any) -> None:
    """Reduce the environment ansible-runner recorded for a finished playbook to RECORDED_ENV, so that no secret
    of the controller's environment stays in the run's directory."""
    _forget(Path(runner.config.artifact_dir) / "command")


def forget_left_environments(runs: Path) -> None:
    """The same for the records of playbooks whose controller ended before them (killed, its machine off): each
    playbook the controller starts first cuts down what such a controller left in the runs directory's private
    directories."""
    for pattern in (".control/**/artifacts/*/command", "*/.control/**/artifacts/*/command"):
        for record in runs.glob(pattern):
            _forget(record)


def _forget(record: Path) -> None:
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    env = dict(data.get("env") or {})
    if set(env) <= RECORDED_ENV:
        return
    data["env"] = {k: v for k, v in env.items() if k in RECORDED_ENV}
    record.write_text(json.dumps(data), encoding="utf-8")


@dataclass
class PlaybookRun:
    """A playbook run: which hosts took part, what failed where (host -> message), the facts the play set."""

    thread: threading.Thread | None = None
    runner: Any = None
    failures: dict[str, str] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> facts the play set
    hosts: list[str] = field(default_factory=list)
    role_ends: dict[str, float] = field(default_factory=dict)  # role ("" outside roles) -> its last task result

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    @property
    def ok(self) -> bool:
        return self.runner is not None and self.runner.status == "successful" and not self.failures


def _failure_message(result: dict[str, Any]) -> str:
    msg = result.get("msg") or ""
    if not msg and result.get("stderr"):
        msg = result["stderr"]
    if isinstance(msg, list):
        msg = "\n".join(str(m) for m in msg)
    return str(msg).strip() or "failed (no message)"


def start_playbook(
    playbook: str,
    inventory: Path,
    extravars: dict[str, Any],
    private_dir: Path,
    on_task: Any = None,
    limit: list[str] | None = None,
    enough: Callable[[PlaybookRun], bool] | None = None,
) -> PlaybookRun:
    """Start ``playbooks/<playbook>`` against ``inventory`` (only the hosts in ``limit``, if given); returns at once.
    With ``enough``, the run is cut short (ansible-runner cancels it; its status is then "canceled") as soon as
    ``enough`` says that what it has heard so far is all that is needed."""
    import ansible_runner

    private_dir.mkdir(parents=True, exist_ok=True)
    forget_left_environments(runs_dir())
    run = PlaybookRun()

    def on_event(event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        if host and host not in run.hosts and kind.startswith("runner_on_"):
            run.hosts.append(host)
        if kind == "runner_on_ok" and host:
            run.facts.setdefault(host, {}).update(data.get("res", {}).get("ansible_facts", {}))
        if kind.startswith("runner_on_"):
            run.role_ends[str(data.get("role") or "")] = time.time()
        if kind in ("runner_on_ok", "runner_on_failed"):  # tasks that ran (skipped ones stay quiet)
            name = data.get("task", "")
            if name not in run.tasks:
                run.tasks.append(name)
                if on_task is not None:
                    on_task(name)
        if kind in ("runner_on_failed", "runner_on_unreachable"):
            if kind == "runner_on_failed" and data.get("ignore_errors"):
                return True
            host = data.get("host", "?")
            run.failures[host] = _failure_message(data.get("res", {}))
        return True

    run.thread, run.runner = ansible_runner.run_async(
        private_data_dir=str(private_dir),
        project_dir=str(REPO),
        playbook=str(REPO / "playbooks" / playbook),
        inventory=str(inventory.resolve()),
        extravars=extravars,
        limit=",".join(limit) if limit else None,
        envvars=RUNNER_ENV
        | {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            # ansible-playbook lives next to this interpreter, whether or not the venv is on PATH.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        quiet=True,
        rotate_artifacts=3,
        event_handler=on_event,
        finished_callback=forget_environment,
        # Always a cancel callback: without one, ansible-runner installs its own SIGINT and SIGTERM handlers in
        # this process, and Ctrl-C (or a SIGTERM) then only cancels the playbook in flight instead of reaching the
        # controller (`make train` would not detach). It asks the callback each time it stops waiting for output:
        # with ``enough``, every 0.2 s, not 5.
        cancel_callback=(lambda: enough(run)) if enough else (lambda: False),
        **({"settings": {"pexpect_timeout": 0.2}} if enough else {}),
    )
    return run


def run_playbook(
    playbook: str,
    inventory: Path,
    extravars: dict[str, Any],
    private_dir: Path,
    on_task: Any = None,
    limit: list[str] | None = None,
    enough: Callable[[PlaybookRun], bool] | None = None,
) -> PlaybookRun:
    """Run a playbook to its end (or until ``enough`` says so: ``start_playbook``)."""
    run = start_playbook(playbook, inventory, extravars, private_dir, on_task, limit, enough)
    run.wait()
    return run
