"""The dummy CUDA apt repository (testbed/aptrepo.py) the driver and CUDA roles are tested against.

apt itself reads it, in a throwaway configuration that touches nothing of this machine's apt:
the signed index must verify with the key the dummy `cuda-keyring` package ships, and both the
pinned and the newer version of every package must be listed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import unavailable

from testbed import aptrepo

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _needs_apt_tools() -> None:
    """Skipped without dpkg-deb, gpg and apt-get (the nvidia_driver scenario needs them too); failed in CI."""
    missing = [tool for tool in ("dpkg-deb", "gpg", "apt-get") if shutil.which(tool) is None]
    if missing:
        unavailable(f"needs {', '.join(missing)}")


def _apt(tmp: Path, repo: Path, keyring: Path, *args: str) -> str:
    """apt-get / apt-cache with every state and config path under `tmp`: this machine's apt is never read."""
    tmp.mkdir(parents=True, exist_ok=True)
    sources = tmp / "sources.list"
    sources.write_text(f"deb [signed-by={keyring}] file:{repo} ./\n")
    for sub in ("lists/partial", "cache/archives/partial", "etc/preferences.d", "etc/apt.conf.d", "etc/trusted.gpg.d"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    (tmp / "status").touch()
    options = {
        "Dir::Etc::sourcelist": str(sources),
        "Dir::Etc::sourceparts": "-",
        "Dir::Etc::preferences": str(tmp / "etc" / "preferences"),
        "Dir::Etc::preferencesparts": str(tmp / "etc" / "preferences.d"),
        "Dir::Etc::trusted": str(tmp / "etc" / "trusted.gpg"),
        "Dir::Etc::trustedparts": str(tmp / "etc" / "trusted.gpg.d"),
        "Dir::State::Lists": str(tmp / "lists"),
        "Dir::State::status": str(tmp / "status"),
        "Dir::Cache": str(tmp / "cache"),
        "APT::Sandbox::User": "root",
        "APT::Architecture": "amd64",
        "APT::Architectures": "amd64",
        "Acquire::Languages": "none",
    }
    # APT_CONFIG is read before apt.conf.d, so this file also keeps the machine's apt.conf.d out.
    config = tmp / "apt.conf"
    config.write_text(
        f'Dir::Etc::parts "{tmp / "etc" / "apt.conf.d"}";\nDir::Etc::main "{tmp / "etc" / "apt.conf"}";\n'
        + "".join(f'{key} "{value}";\n' for key, value in options.items())
    )
    done = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", "APT_CONFIG": str(config)},
    )
    assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _keyring_from_deb(deb: Path, keyring_path: str, out: Path) -> Path:
    """The key exactly as the dummy cuda-keyring package installs it."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(out)], check=True)
    return out / keyring_path.lstrip("/")


def test_repository_verifies_and_lists_pinned_and_newer(tmp_path: Path) -> None:
    info = aptrepo.build(tmp_path / "repo")
    repo = Path(info.dest)
    assert (repo / info.keyring_deb).is_file()
    for name in ("Packages", "Packages.gz", "Release", "InRelease", "Release.gpg"):
        assert (repo / name).is_file(), name
    assert json.loads((repo / "repo.json").read_text())["driver_pinned"] == info.driver_pinned

    keyring = _keyring_from_deb(repo / info.keyring_deb, info.keyring_path, tmp_path / "keyring-root")
    out = _apt(tmp_path / "apt", repo, keyring, "apt-get", "update")
    assert "NO_PUBKEY" not in out and "not signed" not in out and "W:" not in out, out

    driver = (aptrepo.deb_version(info.driver_pinned), aptrepo.deb_version(info.driver_newer))
    wanted = {name: driver for name in info.driver_packages}
    wanted[info.cuda_package] = (aptrepo.deb_version(info.cuda_pinned), aptrepo.deb_version(info.cuda_newer))
    madison = _apt(tmp_path / "apt", repo, keyring, "apt-cache", "madison", *wanted)
    listed = {tuple(part.strip() for part in line.split("|")[:2]) for line in madison.splitlines() if "|" in line}
    for name, versions in wanted.items():
        for version in versions:
            assert (name, version) in listed, f"{name} {version} not in:\n{madison}"
    # Without a pin the newer version is the candidate: the roles' pins are what keeps it out.
    policy = _apt(tmp_path / "apt", repo, keyring, "apt-cache", "policy", "nvidia-smi")
    assert f"Candidate: {aptrepo.deb_version(info.driver_newer)}" in policy, policy


def test_wrong_key_fails_verification(tmp_path: Path) -> None:
    info = aptrepo.build(tmp_path / "repo")
    other = aptrepo.build(tmp_path / "other")  # same packages, another throwaway key
    with pytest.raises(AssertionError, match=r"NO_PUBKEY|not signed|signatures"):
        _apt(tmp_path / "apt", Path(info.dest), Path(other.dest) / "cuda-archive-keyring.gpg", "apt-get", "update")


def test_build_is_cached(tmp_path: Path) -> None:
    first = aptrepo.build(tmp_path / "repo")
    inrelease = (Path(first.dest) / "InRelease").read_bytes()
    again = aptrepo.build(tmp_path / "repo")
    assert again == first
    assert (Path(first.dest) / "InRelease").read_bytes() == inrelease  # not re-signed: nothing rebuilt
