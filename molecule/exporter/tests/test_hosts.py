"""Role exporter (process mode: no systemd on the test hosts) on each host: its files, a live process behind
the pid file, listening on the host's cluster address only.

What it answers to the controller, the other host and an address outside the subnet, a planted job's series
and a stopped exporter started again are verify.yml's (molecule/conftest.py runs it last).
"""

from __future__ import annotations

from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

DIR = "/opt/ugro-exporter"
PORT = 9840


def test_the_exporters_files(host: Any) -> None:
    for name, mode in (("ugro_exporter.py", 0o644), ("ugro_jobstate.py", 0o644), ("run-exporter.sh", 0o755)):
        f = host.file(f"{DIR}/{name}")
        assert (f.is_file, f.user, f.group, f.mode) == (True, "root", "root", mode), name


def test_the_pid_file_names_a_live_exporter(host: Any) -> None:
    pid = int(host.file("/run/ugro-exporter.pid").content_string.split()[0])
    assert f"{DIR}/ugro_exporter.py" in host.process.get(pid=pid).args


def test_its_own_directory_and_the_controllers_address(host: Any) -> None:
    """The follow marks go to a directory of root's that the ranks can read; only the controller (the client
    address of Ansible's SSH connection: this machine's bridge address) records them."""
    own = host.file("/run/ugro-exporter")
    assert (own.is_directory, own.user, own.mode) == (True, "root", 0o755)
    pid = int(host.file("/run/ugro-exporter.pid").content_string.split()[0])
    args = host.process.get(pid=pid).args.split()
    controller = host.run("printenv SSH_CLIENT").stdout.split()[0]
    assert args[args.index("--controller") + 1] == controller


def test_it_listens_on_the_cluster_address_only(host: Any) -> None:
    address = host.ansible.get_variables()["ugro_cluster_address"]
    assert host.socket(f"tcp://{address}:{PORT}").is_listening
    assert not host.socket(f"tcp://0.0.0.0:{PORT}").is_listening
