"""Role cuda_toolkit on tb1 (a fresh box) and tb2 (the pinned release installed by hand before ugro, nothing held):
the metapackage and every component package of the pinned release at that release's own versions, pinned and held,
so that no upgrade moves one although the repository holds a newer release whose components the metapackage's `>=`
dependencies would take; nvcc on PATH of login shells and LD_LIBRARY_PATH left alone (torch's own CUDA libraries
stay first); NVIDIA's repository configured once although prepare.yml left each host another source for it."""

from __future__ import annotations

import re
from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

PIN_FILE = "/etc/apt/preferences.d/cuda-toolkit"
SOURCES_FILE = "/etc/apt/sources.list.d/cuda.sources"


def _repo(host: Any) -> dict[str, Any]:
    repo: dict[str, Any] = host.ansible.get_variables()["testbed_apt_repo"]
    return repo


def _release(repo: dict[str, Any]) -> str:
    return ".".join(repo["cuda_pinned"].split(".")[:2])


def _pinned(repo: dict[str, Any]) -> dict[str, str]:
    """Every package of the pinned release -> its Debian version (the dummy packages' revision is 1)."""
    components = {name: f"{versions[0]}-1" for name, versions in repo["cuda_components"].items()}
    return {repo["cuda_package"]: f"{repo['cuda_pinned']}-1", **components}


def _installed(host: Any, names: list[str]) -> dict[str, str]:
    out = host.check_output("dpkg-query -W -f '${Package} ${Version} ${Status}\\n' " + " ".join(names))
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}


def test_every_package_of_the_release_is_installed_at_its_version_and_held(host: Any) -> None:
    pinned = _pinned(_repo(host))
    assert _installed(host, list(pinned)) == {name: f"{version} hold ok installed" for name, version in pinned.items()}


def test_the_apt_pin_names_every_package_at_its_version(host: Any) -> None:
    pinned = _pinned(_repo(host))
    stanzas = [s for s in re.split(r"\n\s*\n", host.file(PIN_FILE).content_string) if "Package:" in s]
    fields = [dict(re.findall(r"(?m)^([A-Za-z-]+):\s*(.*?)\s*$", stanza)) for stanza in stanzas]
    assert {f["Package"]: f["Pin"] for f in fields} == {name: f"version {v}" for name, v in pinned.items()}
    assert {f["Pin-Priority"] for f in fields} == {"1001"}


def test_apt_would_install_the_pinned_components_not_the_newer_ones(host: Any) -> None:
    repo = _repo(host)
    moved = {name: versions for name, versions in repo["cuda_components"].items() if versions[0] != versions[1]}
    assert moved, "the test repository's newer release changes no component"
    policy = host.check_output("apt-cache policy " + " ".join([repo["cuda_package"], *moved]))
    for name, (pinned, newer) in moved.items():
        block = policy.split(f"{name}:\n", 1)[1].split("\n", 3)[:2]
        assert block[1].strip() == f"Candidate: {pinned}-1", policy
        assert re.search(rf"(?m)^\s+{re.escape(newer)}-1 ", policy), policy


def test_an_upgrade_moves_no_component(host: Any) -> None:
    pinned = _pinned(_repo(host))
    host.run_expect([0], "DEBIAN_FRONTEND=noninteractive apt-get -y upgrade")
    host.run_expect([0], "DEBIAN_FRONTEND=noninteractive apt-get -y install --only-upgrade " + " ".join(pinned))
    assert _installed(host, list(pinned)) == {name: f"{version} hold ok installed" for name, version in pinned.items()}


def test_login_shells_find_the_pinned_nvcc_once(host: Any) -> None:
    repo = _repo(host)
    home = f"/usr/local/cuda-{_release(repo)}"
    nvcc = repo["cuda_components"]["cuda-nvcc-13-0"][0]
    # Sourced twice (a login shell in a login shell), the directory is on PATH once.
    out = host.check_output("""bash -lc 'command -v nvcc; nvcc --version; bash -lc "echo \\$PATH"'""")
    lines = out.splitlines()
    assert lines[0] == f"{home}/bin/nvcc"
    assert re.search(rf"release {re.escape(_release(repo))}, V{re.escape(nvcc)}\n", out), out
    assert lines[-1].split(":").count(f"{home}/bin") == 1, lines[-1]


def test_login_shells_leave_the_library_path_to_torch(host: Any) -> None:
    # Nothing set: nothing set (the toolkit's own libraries are the loader's, through NVIDIA's ld.so.conf.d).
    unset = host.check_output("""env -u LD_LIBRARY_PATH bash -lc 'echo "${LD_LIBRARY_PATH-unset}"'""")
    assert unset == "unset"
    # A venv's CUDA libraries ahead of everything stay alone there: no system lib64 before or after them.
    venv = "/opt/ugro/venv/lib/python3.11/site-packages/nvidia/cublas/lib"
    assert host.check_output(f"""LD_LIBRARY_PATH={venv} bash -lc 'echo "$LD_LIBRARY_PATH"'""") == venv
    profile = host.file("/etc/profile.d/cuda.sh").content_string
    assert not [line for line in profile.splitlines() if "LD_LIBRARY" in line and not line.startswith("#")], profile


def _active_entries(host: Any, url: str) -> list[str]:
    """'file: line' of every enabled apt source line or deb822 URIs field that names the repository's URL."""
    bare = re.escape(re.sub(r"^[a-z]+://", "", url).rstrip("/"))
    names = host.check_output("ls -1 /etc/apt/sources.list.d").split()
    parts = [f"/etc/apt/sources.list.d/{n}" for n in names if n.endswith((".list", ".sources"))]
    paths = ["/etc/apt/sources.list", *parts]
    found = []
    for path in paths:
        content = host.file(path).content_string if host.file(path).exists else ""
        for stanza in re.split(r"\n\s*\n", content):
            if re.search(r"(?mi)^Enabled:\s*no\s*$", stanza):
                continue
            for line in stanza.splitlines():
                if not line.lstrip().startswith("#") and re.search(rf"https?://{bare}/*(\s|$)", line):
                    found.append(f"{path}: {line.strip()}")
    return found


def test_the_repository_is_configured_once(host: Any) -> None:
    url = host.ansible.get_variables()["testbed_apt_repo_url"]
    assert _active_entries(host, url) == [f"{SOURCES_FILE}: URIs: {url}"]
    update = host.run_expect([0], "apt-get update")
    assert "Conflicting values" not in update.stderr and "configured multiple times" not in update.stderr, update.stderr


def test_another_tools_sources_are_cleared_of_the_repository_only(host: Any) -> None:
    url = host.ansible.get_variables()["testbed_apt_repo_url"]
    names = host.check_output("ls -1 /etc/apt/sources.list.d").split()
    if host.backend.get_hostname() == "tb1":
        # add-apt-repository's file held nothing else: gone. sources.list keeps Debian, the line is commented out.
        assert not [n for n in names if n.startswith("archive_uri-")], names
        main = host.file("/etc/apt/sources.list").content_string
        assert re.search(r"(?m)^deb http://deb\.debian\.org/debian bookworm main", main), main
        assert re.search(rf"(?m)^# deb {re.escape(url.rstrip('/'))} /$", main), main
    else:
        # The hand-written deb822 file keeps its other, disabled stanza; the repository's stanza is gone.
        own = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources").content_string
        assert "machine-learning" in own and re.search(r"(?m)^Enabled: no$", own), own
        assert url not in own, own
