"""Role nvidia_driver on the desktops people have: Secure Boot without and with DKMS's key enrolled, and a driver of
another origin already there, refused or replaced. Every refusal comes before anything of the driver is installed,
names the host and both ways out."""

from __future__ import annotations

from typing import Any

import pytest

testinfra_hosts = ["ansible://ugro_cluster"]


def _only(host: Any, name: str) -> None:
    """Each test is about one desktop of the scenario (molecule.yml): skipped on the others."""
    if host.backend.get_hostname() != name:
        pytest.skip(f"{name}'s case")


def _refusal(host: Any) -> str | None:
    found = host.file("/root/nvidia_driver_refused.txt")
    return found.content_string if found.exists else None


def _installed(host: Any) -> list[str]:
    out = host.run("dpkg-query -W -f '${Package} ${Version} ${Status}\\n' 'nvidia-*'").stdout
    return sorted(" ".join(line.split()[:2]) for line in out.splitlines() if line.endswith(" installed"))


def _repo(host: Any) -> dict[str, Any]:
    repo: dict[str, Any] = host.ansible.get_variables()["testbed_apt_repo"]
    return repo


def test_secure_boot_without_an_enrolled_key_is_refused_before_anything_is_installed(host: Any) -> None:
    _only(host, "tb1")
    refusal = _refusal(host)
    assert refusal is not None and refusal.startswith("tb1: Secure Boot is on"), refusal
    assert "sudo mokutil --import /var/lib/dkms/mok.pub" in refusal and "dkms generate_mok" in refusal, refusal
    assert "turn Secure Boot off" in refusal and "Nothing was installed" in refusal, refusal
    assert _installed(host) == []
    assert not host.file("/etc/apt/sources.list.d/cuda.sources").exists
    assert not host.file("/etc/apt/preferences.d/nvidia-driver").exists


def test_secure_boot_with_the_key_enrolled_installs_and_builds_the_module(host: Any) -> None:
    _only(host, "tb2")
    repo = _repo(host)
    assert _refusal(host) is None
    assert f"nvidia-kernel-open-dkms {repo['driver_pinned']}-1" in _installed(host)
    module = host.file(f"/lib/modules/{repo['kernel_running']}/updates/dkms/nvidia.ko")
    assert module.exists and f"version={repo['driver_pinned']}".encode() in module.content


def test_a_driver_of_another_origin_is_refused_naming_its_packages(host: Any) -> None:
    _only(host, "tb3")
    repo = _repo(host)
    refusal = _refusal(host)
    assert refusal is not None and refusal.startswith("tb3 has NVIDIA driver packages that are not NVIDIA's build")
    assert f"nvidia-kernel-open-dkms {repo['foreign_version']}" in refusal, refusal
    assert "nvidia_driver_replace_foreign: true" in refusal and "Nothing was installed" in refusal, refusal
    # Left as it was: the other build, not held, not mixed with ugro's.
    assert _installed(host) == [f"{name} {repo['foreign_version']}" for name in sorted(repo["driver_packages"])]
    assert not host.file("/etc/apt/preferences.d/nvidia-driver").exists


def test_a_driver_of_another_origin_is_replaced_when_asked(host: Any) -> None:
    _only(host, "tb4")
    repo = _repo(host)
    assert _refusal(host) is None
    names = sorted(repo["driver_packages"])
    assert _installed(host) == [f"{name} {repo['driver_pinned']}-1" for name in names]
    held = host.check_output("dpkg-query -W -f '${Package} ${Status}\\n' " + " ".join(names)).splitlines()
    assert held == [f"{name} hold ok installed" for name in names]
