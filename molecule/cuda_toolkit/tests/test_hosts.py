"""Role cuda_toolkit on tb1: the pinned toolkit installed and held, pinned for apt, on PATH and
LD_LIBRARY_PATH of login shells, and not upgraded by apt although the repository holds a newer one."""

from __future__ import annotations

import re
from typing import Any

testinfra_hosts = ["ansible://tb1"]


def _repo(host: Any) -> dict[str, Any]:
    repo: dict[str, Any] = host.ansible.get_variables()["testbed_apt_repo"]
    return repo


def _release(repo: dict[str, Any]) -> str:
    return ".".join(repo["cuda_pinned"].split(".")[:2])


def test_the_pinned_toolkit_is_installed_and_held(host: Any) -> None:
    repo = _repo(host)
    got = host.check_output(f"dpkg-query -W -f '${{Version}} ${{Status}}' {repo['cuda_package']}")
    assert got == f"{repo['cuda_pinned']}-1 hold ok installed"


def test_the_apt_pin_holds_the_version(host: Any) -> None:
    repo = _repo(host)
    pin = host.file("/etc/apt/preferences.d/cuda-toolkit").content_string
    assert re.search(rf"(?m)^Package:\s{re.escape(repo['cuda_package'])}$", pin)
    assert re.search(rf"(?m)^Pin:\sversion {re.escape(repo['cuda_pinned'])}-\*$", pin)
    assert re.search(r"(?m)^Pin-Priority:\s1001$", pin)


def test_apt_would_install_the_pinned_not_the_newer_one(host: Any) -> None:
    repo = _repo(host)
    policy = host.check_output(f"apt-cache policy {repo['cuda_package']}")
    assert re.search(rf"Candidate:\s{re.escape(repo['cuda_pinned'])}-1\n", policy + "\n"), policy
    assert re.search(rf"(?m)^\s+{re.escape(repo['cuda_newer'])}-1 ", policy), policy


def test_login_shells_find_nvcc_and_the_libraries_once(host: Any) -> None:
    repo = _repo(host)
    home = f"/usr/local/cuda-{_release(repo)}"
    profile = host.file("/etc/profile.d/cuda.sh").content_string
    assert f"{home}/bin" in profile and f"{home}/lib64" in profile
    # Sourced twice (a login shell in a login shell), the directory is on LD_LIBRARY_PATH once.
    out = host.check_output("""bash -lc 'command -v nvcc; nvcc --version; bash -lc "echo \\$LD_LIBRARY_PATH"'""")
    lines = out.splitlines()
    assert lines[0] == f"{home}/bin/nvcc"
    assert re.search(rf"release {re.escape(_release(repo))}, V{re.escape(repo['cuda_pinned'])}\n", out), out
    assert lines[-1] == f"{home}/lib64"


def test_an_upgrade_leaves_the_pinned_toolkit(host: Any) -> None:
    repo = _repo(host)
    host.run_expect([0], f"DEBIAN_FRONTEND=noninteractive apt-get -y install --only-upgrade {repo['cuda_package']}")
    assert host.check_output(f"dpkg-query -W -f '${{Version}}' {repo['cuda_package']}") == f"{repo['cuda_pinned']}-1"
