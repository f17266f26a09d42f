"""Taking a host back from a running job and lending it again, as the controller decides it (`make release`,
`make lend`: ugro/commands/lend.py): whether the request can be made, from every host's state, before anything is
written. The ranks' side is train/recovery/lending.py; the hosts write and read the request themselves, so no
controller needs to follow the run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Statuses = Mapping[str, Mapping[str, Any]]


def _training(status: Mapping[str, Any]) -> bool:
    """The host's job runs with ranks of its own (not only a launcher waiting to be lent again)."""
    pids = status.get("pids") or {}
    return status.get("state") == "running" and any(str(name).startswith("worker") for name in pids)


def release_refusal(statuses: Statuses, host: str, job_id: str) -> str | None:
    """Why ``host`` cannot be taken back from job ``job_id`` now, with what to do instead; None when it can."""
    status = statuses.get(host)
    if status is None:
        return f"{host} is not a host of the inventory (its hosts: {', '.join(statuses) or 'none'})"
    state = status.get("state") or "unreachable"
    if state == "lent":
        return f"{host} is already taken back from job {job_id} (`make lend HOST={host}` lends it again)"
    if not _training(status):
        return f"{host} does not train in job {job_id} (its state there: {state}); nothing to take back"
    if status.get("wanted_back"):
        return f"{host} is taken back already: its ranks leave after the step under way"
    staged = sorted({part for part in (status.get("parts") or {}).values() if part != "the whole model"})
    if staged:
        return (f"{host} holds pipeline stages ({'; '.join(staged)}), cut for the hosts that hold them: the others "
                f"cannot go on without it. `make stop`, then `make train RESUME=auto` without {host} re-cuts the "
                "stages for the hosts left from the newest checkpoint")  # fmt: skip
    others = [h for h, s in statuses.items() if h != host and _training(s) and not s.get("wanted_back")]
    if not others:
        return (f"{host} is the last host that trains job {job_id}: without it nobody would. `make stop` ends the "
                "run (its checkpoints stay; `make train RESUME=auto` continues from the newest)")  # fmt: skip
    return None


def lend_refusal(statuses: Statuses, host: str, job_id: str) -> str | None:
    """Why ``host`` cannot be lent to job ``job_id`` again; None when it can (it was taken back, or is being)."""
    status = statuses.get(host)
    if status is None:
        return f"{host} is not a host of the inventory (its hosts: {', '.join(statuses) or 'none'})"
    if status.get("state") == "lent" or status.get("wanted_back"):
        return None
    state = status.get("state") or "unreachable"
    return f"{host} is not taken back from job {job_id} (its state there: {state}): nothing to lend"
