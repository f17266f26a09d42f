"""Role nvidia_driver: on tb1 (a GPU, no kernel headers, a kernel update installed) the pinned driver installed,
held, pinned, kept out of unattended upgrades and not upgraded by apt although the repository holds a newer one, with
its module built for both kernels and the reboot left pending; tb2 (no GPU) has nothing of it. verify.yml boots tb1
and runs the role again."""

from __future__ import annotations

import re
from typing import Any

import pytest

testinfra_hosts = ["ansible://ugro_cluster"]


@pytest.fixture
def gpu_host(host: Any) -> Any:
    if host.backend.get_hostname() != "tb1":
        pytest.skip("tb1 is the host with a GPU")
    return host


def _repo(host: Any) -> dict[str, Any]:
    repo: dict[str, Any] = host.ansible.get_variables()["testbed_apt_repo"]
    return repo


def _versions(host: Any, packages: list[str]) -> list[str]:
    return host.check_output("dpkg-query -W -f '${Version} ${Status}\\n' " + " ".join(packages)).splitlines()


def test_every_driver_package_is_pinned_and_held(gpu_host: Any) -> None:
    repo = _repo(gpu_host)
    packages = repo["driver_packages"]
    assert _versions(gpu_host, packages) == [f"{repo['driver_pinned']}-1 hold ok installed"] * len(packages)


def test_both_kernels_have_headers_and_the_pinned_module_and_a_reboot_is_pending(gpu_host: Any) -> None:
    """The running kernel and the update waiting for the next boot: headers installed, so DKMS built the module for
    each; nothing loaded yet (no reboot allowed), so nvidia-smi cannot answer, and the role did not fail for it."""
    repo = _repo(gpu_host)
    for kernel in (repo["kernel_running"], repo["kernel_newer"]):
        assert _versions(gpu_host, [f"linux-headers-{kernel}"]) == ["1 install ok installed"]
        module = gpu_host.file(f"/lib/modules/{kernel}/updates/dkms/nvidia.ko")
        assert module.exists and f"version={repo['driver_pinned']}".encode() in module.content
    assert not gpu_host.file("/sys/module/nvidia/version").exists
    assert "couldn't communicate with the NVIDIA driver" in gpu_host.run("nvidia-smi").stderr


def test_the_pin_and_blacklist_files(gpu_host: Any) -> None:
    repo = _repo(gpu_host)
    pin = gpu_host.file("/etc/apt/preferences.d/nvidia-driver").content_string
    assert re.search(rf"(?m)^Pin:\sversion {re.escape(repo['driver_pinned'])}-\*$", pin)
    assert re.search(r"(?m)^Pin-Priority:\s1001$", pin)
    pinned_packages = re.search(r"(?m)^Package:\s(.*)$", pin)
    assert pinned_packages and set(repo["driver_packages"]) <= set(pinned_packages[1].split())
    unattended = gpu_host.file("/etc/apt/apt.conf.d/51nvidia-driver-no-unattended-upgrades").content_string
    assert "Unattended-Upgrade::Package-Blacklist" in unattended and '"^nvidia-";' in unattended
    assert re.search(r"(?m)^blacklist nouveau$", gpu_host.file("/etc/modprobe.d/blacklist-nouveau.conf").content_string)


def test_the_repository_is_configured_once(gpu_host: Any) -> None:
    variables = gpu_host.ansible.get_variables()
    url = variables["testbed_apt_repo_url"]
    source = gpu_host.file("/etc/apt/sources.list.d/cuda.sources").content_string
    assert re.search(rf"(?m)^URIs:\s{re.escape(url)}$", source)
    assert re.search(r"(?m)^Suites:\s/$", source)
    assert re.search(rf"(?m)^Signed-By:\s{re.escape(variables['testbed_apt_repo']['keyring_path'])}$", source)
    found = gpu_host.run_expect([0, 1], f"grep -rlF {url.rstrip('/')} /etc/apt/sources.list.d /etc/apt/sources.list")
    assert found.stdout.splitlines() == ["/etc/apt/sources.list.d/cuda.sources"]


def test_apt_would_install_the_pinned_not_the_newer_driver(gpu_host: Any) -> None:
    repo = _repo(gpu_host)
    pinned, newer = f"{repo['driver_pinned']}-1", f"{repo['driver_newer']}-1"
    out = gpu_host.check_output("apt-cache policy " + " ".join(repo["driver_packages"]))
    # `apt-cache policy a b` prints "a:" then indented lines, then "b:" ...
    policy = dict(re.findall(r"(?ms)^(\S+):\n(.*?)(?=^\S|\Z)", out))
    assert sorted(policy) == sorted(repo["driver_packages"])
    for text in policy.values():
        assert re.search(rf"Candidate:\s{re.escape(pinned)}\n", text), out
        assert re.search(rf"(?m)^\s+{re.escape(newer)} 500$", text), out
        assert re.search(rf"(?m)^ \*\*\* {re.escape(pinned)} 1001$", text), out


def test_no_upgrade_installs_the_newer_driver(gpu_host: Any) -> None:
    # apt-get itself, as an administrator types it: a full upgrade, then one of just the driver packages.
    repo = _repo(gpu_host)
    packages, newer = repo["driver_packages"], f"{repo['driver_newer']}-1"
    for command in ("apt-get -y upgrade", "apt-get -y install --only-upgrade " + " ".join(packages)):
        run = gpu_host.run_expect([0], f"DEBIAN_FRONTEND=noninteractive {command}")
        assert newer not in run.stdout, run.stdout
    assert _versions(gpu_host, packages) == [f"{repo['driver_pinned']}-1 hold ok installed"] * len(packages)


def test_the_host_without_a_gpu_has_nothing_of_the_driver(host: Any) -> None:
    if host.backend.get_hostname() != "tb2":
        pytest.skip("tb2 is the host without a GPU")
    installed = host.run("dpkg-query -W -f '${Package} ${Status}\\n' 'nvidia-*' 'cuda-*'").stdout
    assert [line for line in installed.splitlines() if line.endswith(" installed")] == []
    assert not host.file("/etc/apt/preferences.d/nvidia-driver").exists
    assert not host.file("/etc/apt/sources.list.d/cuda.sources").exists
    assert not host.exists("nvidia-smi")
