"""A host lent to the run by its owner's use (train/recovery/owner.py): when the owner needs it, its launcher takes it
back (``hosts/<host>/release.json``, by "owner"), and lends it again once the owner has left it alone for a while; the
host's setting in the inventory (roles/train_launch ``train_launch_lend_*``) reaches the launcher as ``UGRO_LEND``.

The probes are real: a planted process of this machine for the host's memory, a directory laid out as Linux's
/sys/class/power_supply for the battery. The watch itself runs on a stand-in probe that says what the owner does, and
on a host directory of tmp_path; the ranks that leave and come back on its request are tests/test_lending.py's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from helpers import REPO, Run

from train.recovery import lending, owner
from train.recovery.owner import HostUse, OwnerWatch, Settings, SettingsError

ROLE = REPO / "roles" / "train_launch"


def _at(hhmm: str) -> datetime:
    return datetime.strptime(f"2026-11-21 {hhmm}", "%Y-%m-%d %H:%M")


# --- The hours ---------------------------------------------------------------------------------------------------


def test_hours_are_read_as_ranges_of_minutes() -> None:
    assert owner.parse_hours("01:00-08:00") == [(60, 480)]
    assert owner.parse_hours("01:00-08:00, 22:30-23:59") == [(60, 480), (1350, 1439)]
    assert owner.parse_hours(" 22:00 - 06:00 ,") == [(1320, 360)]  # spaces and a trailing comma are nothing
    assert owner.parse_hours("") == []


@pytest.mark.parametrize("bad", ["01:00-25:00", "8-9", "01:00", "01:00-02:00-03:00", "evenings"])
def test_a_bad_range_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(SettingsError, match=f"'{bad}'.*HH:MM-HH:MM"):
        owner.parse_hours(f"12:00-13:00,{bad}")


def test_outside_the_hours_the_host_is_its_owners() -> None:
    night = owner.parse_hours("01:00-08:00")
    assert not owner.outside_hours(night, _at("01:00"))
    assert not owner.outside_hours(night, _at("07:59"))
    assert owner.outside_hours(night, _at("08:00"))  # the end is the owner's
    assert owner.outside_hours(night, _at("12:00"))
    assert owner.outside_hours(night, _at("00:59"))
    assert not owner.outside_hours([], _at("12:00"))  # no hours: lent all day


def test_a_range_runs_across_midnight_and_several_ranges_add_up() -> None:
    overnight = owner.parse_hours("22:00-06:00")
    for inside in ("22:00", "23:30", "00:00", "05:59"):
        assert not owner.outside_hours(overnight, _at(inside)), inside
    for outside in ("06:00", "12:00", "21:59"):
        assert owner.outside_hours(overnight, _at(outside)), outside
    both = owner.parse_hours("22:00-06:00,12:00-13:00")
    assert not owner.outside_hours(both, _at("12:30")) and not owner.outside_hours(both, _at("03:00"))
    assert owner.outside_hours(both, _at("09:00"))


# --- The battery -------------------------------------------------------------------------------------------------


def _supply(power: Path, name: str, kind: str, online: str | None = None) -> None:
    (power / name).mkdir(parents=True)
    (power / name / "type").write_text(f"{kind}\n")
    if online is not None:
        (power / name / "online").write_text(f"{online}\n")


def test_a_laptop_is_on_battery_only_while_its_mains_adapter_is_off_line(tmp_path: Path) -> None:
    laptop = tmp_path / "power_supply"
    _supply(laptop, "AC", "Mains", "1")
    _supply(laptop, "BAT0", "Battery")
    assert not owner.on_battery(laptop)
    (laptop / "AC" / "online").write_text("0\n")
    assert owner.on_battery(laptop)


def test_a_desktop_without_a_battery_is_never_on_battery(tmp_path: Path) -> None:
    desktop = tmp_path / "power_supply"
    desktop.mkdir()
    assert not owner.on_battery(desktop)  # nothing in the class: a desktop
    _supply(desktop, "hidpp_battery_0", "Battery")  # a wireless mouse's battery, and no mains adapter listed
    assert not owner.on_battery(desktop)
    assert not owner.on_battery(tmp_path / "no-power-supply-class")  # no such class at all (not Linux, a container)


# --- Another process's use of the host ---------------------------------------------------------------------------


def test_a_process_over_the_memory_setting_takes_the_host_back_unless_it_is_the_jobs() -> None:
    planted = subprocess.Popen([sys.executable, "-c", "import time\nb = b'x' * (300 << 20)\ntime.sleep(60)"])
    try:
        proc = psutil.Process(planted.pid)
        deadline = time.monotonic() + 20
        while proc.memory_info().rss < 250 << 20:
            assert time.monotonic() < deadline, "the planted process never reached 250 MiB"
            assert planted.poll() is None, "the planted process ended"
            time.sleep(0.05)
        use, settings = HostUse(), Settings(memory_mib=200, busy_percent=101)  # over 100 %: the CPU never counts

        def others(*also: int) -> set[int]:
            """Every other process of this machine, as if the job's: another test's may be as large."""
            return {pid for pid in psutil.pids() if pid != planted.pid} | set(also)

        why = use.heaviest(settings, own=others())
        said = re.fullmatch(rf"process {planted.pid} \(python[^)]*\) uses (\d+) MiB of the host's memory", why or "")
        assert said is not None and int(said[1]) >= 250, why
        # Nothing excluded: a reason (the planted process's, or that of a larger one of this machine's before it).
        why = use.heaviest(settings, own=set())
        assert why is not None and why.endswith("MiB of the host's memory"), why
        # The same process as the job's own (a rank, the launcher) never takes the host back.
        why = use.heaviest(settings, own=others(planted.pid))
        assert why is None or f"process {planted.pid} (" not in why
    finally:
        planted.kill()
        planted.wait(timeout=10)


# --- The watch ---------------------------------------------------------------------------------------------------


class Owner(HostUse):
    """What the owner does on the host: a reason (their process on the GPU), or None; the real probes are above."""

    def __init__(self) -> None:  # no psutil: nothing is probed
        self.doing: str | None = None

    def heaviest(self, settings: Settings, own: set[int]) -> str | None:
        return self.doing


def _watch(tmp_path: Path, **settings: Any) -> tuple[OwnerWatch, Owner, Path]:
    host_dir, doing = tmp_path / "runs" / "job" / "hosts" / "node4070", Owner()
    settings = {"on_battery": False} | settings  # this machine's own power supply is not the test's
    watch = OwnerWatch(host_dir, Settings(**settings), doing, own=set, clock=lambda: _at("12:00"))
    return watch, doing, host_dir


def test_the_owners_use_takes_the_host_back_and_it_is_lent_again_once_free_for_free_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    watch, doing, host_dir = _watch(tmp_path, free_s=0.4)
    watch.check()
    assert lending.request(host_dir) is None  # nobody uses it: lent
    doing.doing = "process 4242 uses 3000 MiB of GPU 0"
    watch.check()
    asked = lending.request(host_dir)
    assert asked is not None and (asked.by, asked.why) == (lending.BY_OWNER, "process 4242 uses 3000 MiB of GPU 0")
    assert json.loads((host_dir / lending.REQUEST).read_text())["by"] == "owner"
    assert "the owner needs this host (process 4242 uses 3000 MiB of GPU 0)" in capsys.readouterr().out
    watch.check()
    assert lending.request(host_dir) == asked  # still used: the same request, its time and reason kept
    # The owner stops: the host stays theirs for free_s ...
    doing.doing = None
    watch.check()
    assert lending.request(host_dir) == asked
    time.sleep(0.45)
    # ... and a use in between starts the wait again.
    doing.doing = "GPU 0 is 97 % busy with process 4242 on it"
    watch.check()
    doing.doing = None
    watch.check()
    assert lending.request(host_dir) == asked
    time.sleep(0.45)
    watch.check()
    assert lending.request(host_dir) is None
    assert "lending it to the run again" in capsys.readouterr().out


def test_a_request_made_by_hand_is_never_withdrawn_by_the_owner_watch(tmp_path: Path) -> None:
    watch, doing, host_dir = _watch(tmp_path, free_s=0.01)
    by_hand = lending.ask(host_dir, lending.BY_HAND, "make release")
    for _ in range(3):
        watch.check()
        time.sleep(0.02)
    assert lending.request(host_dir) == by_hand
    doing.doing = "process 4242 uses 3000 MiB of GPU 0"
    watch.check()
    assert lending.request(host_dir) == by_hand  # not replaced by the owner's either
    doing.doing = None
    for _ in range(3):
        watch.check()
        time.sleep(0.02)
    assert lending.request(host_dir) == by_hand


def test_outside_the_hours_it_is_lent_the_host_is_taken_back(tmp_path: Path) -> None:
    watch, _, host_dir = _watch(tmp_path, hours="01:00-08:00")  # the clock says 12:00
    watch.check()
    asked = lending.request(host_dir)
    assert asked is not None and asked.by == lending.BY_OWNER
    assert asked.why == "outside the hours it is lent (01:00-08:00)"
    lending.withdraw(host_dir)
    watch.clock = lambda: _at("03:00")
    watch.check()
    assert lending.request(host_dir) is None


# --- The settings the launch script hands over -------------------------------------------------------------------


def test_no_settings_means_taken_back_by_hand_only() -> None:
    assert Settings.from_env({}) is None
    assert Settings.from_env({owner.ENV: "  "}) is None


def test_the_settings_are_read_from_json() -> None:
    text = json.dumps({"memory_mib": 2048, "hours": "22:00-06:00", "on_battery": False, "free_s": 30})
    assert Settings.from_env({owner.ENV: text}) == Settings(memory_mib=2048, hours="22:00-06:00", on_battery=False,
                                                            free_s=30)  # fmt: skip


@pytest.mark.parametrize(
    ("lend", "message"),
    [
        ({"memory_mib": 1024, "colour": "red"}, r"unknown key\(s\) colour"),
        ({"hours": "01:00-08:00,9-5"}, "'9-5'"),
        ({"hours": 1}, "hours is 1, it must be a string"),
        ({"memory_mib": "1024"}, 'memory_mib is "1024", it must be a positive number'),
        ({"check_s": 0}, "check_s is 0, it must be a positive number"),
        ({"busy_percent": True}, "busy_percent is true, it must be a positive number"),
        ({"on_battery": "false"}, 'on_battery is "false", it must be true or false'),
    ],
)
def test_settings_that_cannot_be_used_are_refused_naming_the_key(lend: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env({owner.ENV: json.dumps(lend)})


def test_settings_that_are_not_a_json_object_are_refused() -> None:
    with pytest.raises(SettingsError, match="UGRO_LEND is not JSON"):
        Settings.from_env({owner.ENV: "{memory_mib: 1024}"})
    with pytest.raises(SettingsError, match="UGRO_LEND must be a JSON object"):
        Settings.from_env({owner.ENV: "[1024]"})


def test_the_roles_defaults_and_argument_specs_are_the_settings_defaults() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    options = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    keys = {f"train_launch_lend_{name}": value for name, value in vars(Settings()).items()}
    assert {k for k in defaults if k.startswith("train_launch_lend_")} == {*keys, "train_launch_lend_auto"}
    assert defaults["train_launch_lend_auto"] is False and options["train_launch_lend_auto"]["default"] is False
    for key, value in keys.items():
        assert defaults[key] == options[key]["default"] == value, key


# The role's launch script and its checks, rendered by the real Ansible: three hosts of a cluster, one lent by hand
# only (the default: its lend settings are not even read), one lent by its owner's use, one whose settings are wrong.
INVENTORY = {
    "all": {
        "hosts": {
            "byhand": {"train_launch_lend_hours": "evenings"},
            "lent": {
                "train_launch_lend_auto": True,
                "train_launch_lend_hours": "01:00-08:00, 22:00-06:00",
                "train_launch_lend_on_battery": False,
                "train_launch_lend_free_s": 30,
            },
            "wrong": {
                "train_launch_lend_auto": True,
                "train_launch_lend_hours": "01:00-08:00,25:00-26:00",
                "train_launch_lend_check_s": 0,
            },
        },
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
    }
}
PLAY = """
- name: Check the launch parameters and render the launch script, as roles/train_launch does.
  hosts: all
  gather_facts: false
  vars:
    train_launch_job_id: lend-1
    train_launch_job_file: jobs/default.yaml
    train_launch_cluster_address: 127.0.0.1
    train_launch_rendezvous_address: 127.0.0.1
    train_launch_python: /opt/ugro/.venv/bin/python
    train_launch_facts:  # as ugro_host_facts finds a host ready to launch
      files:
        /opt/ugro/.venv/bin/python: {executable: true, regular: true}
        /opt/ugro/jobs/default.yaml: {regular: true}
      job: {state: none, pids: {}}
      running_job: null
      gpu: {count: 1, smi: found, why: ""}
      cluster: {interface: lo}
  tasks:
    - name: Check the launch parameters.
      ansible.builtin.include_role:
        name: train_launch
        tasks_from: validate
        public: true
    - name: Render the launch script.
      ansible.builtin.copy:
        content: "{{ lookup('ansible.builtin.template', '%s') }}"
        dest: "%s/{{ inventory_hostname }}.sh"
        mode: "0644"
"""


def test_the_launch_script_hands_the_hosts_lend_settings_to_the_launcher(tmp_path: Path, ansible_playbook: Run) -> None:
    inventory, playbook = tmp_path / "cluster.yml", tmp_path / "play.yml"
    inventory.write_text(yaml.safe_dump(INVENTORY))
    playbook.write_text(PLAY % (ROLE / "templates" / "ugro-launch.sh.j2", tmp_path))
    result = ansible_playbook(inventory, playbook)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "failed=1" in out, out[-3000:]
    # The host whose settings are wrong stops before anything starts, told which key and how to write it.
    assert not (tmp_path / "wrong.sh").exists()
    flat = " ".join(out.split())
    assert ('wrong: train_launch_lend_hours (ugro_lend_hours in the inventory) "01:00-08:00,25:00-26:00" has the bad '
            'range(s) "25:00-26:00"; write HH:MM-HH:MM[,HH:MM-HH:MM...]') in flat, out[-3000:]  # fmt: skip
    assert ("wrong: train_launch_lend_check_s (ugro_lend_check_s in the inventory) is 0; set it to a positive number "
            "of seconds") in flat  # fmt: skip
    # By default, no variable: the launcher takes the host back by hand only.
    assert "UGRO_LEND" not in (tmp_path / "byhand.sh").read_text()
    # Lent by its owner's use: the settings, quoted for the shell, are what the launcher reads.
    lines = [line for line in (tmp_path / "lent.sh").read_text().splitlines() if line.startswith("export UGRO_LEND=")]
    assert len(lines) == 1, lines
    shell = subprocess.run(["bash", "-c", f'{lines[0]}\nprintf %s "$UGRO_LEND"'], capture_output=True, text=True,
                           check=True)  # fmt: skip
    assert Settings.from_env({owner.ENV: shell.stdout}) == Settings(hours="01:00-08:00, 22:00-06:00",
                                                                    on_battery=False, free_s=30)  # fmt: skip
