"""The checks before a launch answer in the order a person needs them (ugro/checks/prelaunch.py): a host that
never got as far as the checks is refused by name, with its fix, before anything is planned around it.
tests/test_cluster.py runs the same on the test cluster, with a host nobody answers for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train.config import load_job
from ugro.checks import preflight as preflight_run
from ugro.checks import prelaunch
from ugro.checks.preflight_checks import PreflightContext, judge_fast
from ugro.checks.preflight_report import Report, Thresholds
from ugro.run.launch import Refused

REPO = Path(__file__).resolve().parent.parent
NO_ROUTE = "Failed to connect to the host via ssh: ssh: connect to host 10.0.0.250 port 22: No route to host"


def _report(unreachable: dict[str, str]) -> Report:
    """Four CPU hosts a..d; those in ``unreachable`` never reported."""
    hosts = ["a", "b", "c", "d"]
    facts = {"versions": {"python": "3.12.3", "torch": "2.13.0"}, "gpu": {"gpus": []}, "code": {"hash": "h" * 64}}
    reports = {h: {"host": facts, "network": {"listen": {}, "connect": []}} for h in hosts if h not in unreachable}
    addresses = {h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)}
    context = PreflightContext(hosts, "a", addresses, 29500, "h" * 64)
    return judge_fast(reports, unreachable, context, Thresholds(), cuda=(None, "no lock"))


def test_an_unreachable_host_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(Refused) as refused:
        prelaunch.absent(_report({"d": NO_ROUTE}), Path("inventory/lan.yml"))
    assert refused.value.code == 1 and not refused.value.lines
    message = refused.value.message
    assert message.startswith(f"not launching: d is unreachable ({NO_ROUTE})"), message
    assert "check ansible_host/ansible_user of d and that `ssh d` works" in message
    assert message.endswith("or take d out of ugro_cluster in inventory/lan.yml"), message
    prelaunch.absent(_report({}), Path("inventory/lan.yml"))  # every host answered: nothing to refuse


def test_several_lost_hosts_are_each_named_with_their_fix() -> None:
    with pytest.raises(Refused) as refused:
        prelaunch.absent(_report({"b": NO_ROUTE, "d": "timed out"}), Path("lan.yml"))
    assert [line.split()[:3] for line in refused.value.lines] == [
        ["b", "is", "unreachable"],
        ["d", "is", "unreachable"],
    ]
    assert "b, d did not answer the checks" in refused.value.message and "lan.yml" in refused.value.message


def test_the_lost_host_is_refused_before_the_memory_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fast checks' answers in order: the plan (which would count the lost host as a card of 0 GiB) is never
    asked when a host did not answer."""
    report = _report({"d": NO_ROUTE})
    facts = {h: {"gpu": {"gpus": []}, "memory": {"available_bytes": 22 << 30}} for h in "abc"}
    outcome = preflight_run.Outcome(report, {"fast": 8.0}, facts, dict.fromkeys("abc", 1))
    monkeypatch.setattr(preflight_run, "preflight", lambda *args, **kwargs: outcome)

    def planned(*args: Any) -> None:
        raise AssertionError("the plan was asked with a host missing")

    monkeypatch.setattr(prelaunch, "plan_before_launch", planned)
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all: {}\n")
    job_file = REPO / "jobs" / "default.yaml"
    with pytest.raises(Refused) as refused:
        prelaunch.fast(inventory, load_job(job_file), job_file)
    assert refused.value.message.startswith("not launching: d is unreachable"), refused.value.message
    assert f"take d out of ugro_cluster in {inventory}" in refused.value.message
