"""What ugro_host_facts' kernel subset reads (ugro/module_utils/ugro_kernel.py), on a host tree laid out as a real
one: the kernels and their modules, the loaded module, Secure Boot and the MOK list, and where an installed driver
package's version comes from."""

from __future__ import annotations

import lzma
import os
from pathlib import Path

from testbed import standins
from ugro.module_utils import ugro_kernel

RUNNING = os.uname().release
NEWER = standins.newer_kernel(RUNNING)


def _host(root: Path, modules: dict[str, tuple[str, str]], loaded: str | None = None) -> None:
    """``modules``: kernel release -> (file name, version) of its NVIDIA module under updates/dkms."""
    (root / "boot").mkdir()
    (root / "boot" / f"vmlinuz-{NEWER}").write_text("")
    for release, (name, version) in modules.items():
        folder = root / "lib/modules" / release / "updates/dkms"
        folder.mkdir(parents=True)
        elf = standins.module_elf({"version": version, "license": "Dual MIT/GPL"})
        (folder / name).write_bytes(lzma.compress(elf) if name.endswith(".xz") else elf)
    if loaded:
        (root / "sys/module/nvidia").mkdir(parents=True)
        (root / "sys/module/nvidia/version").write_text(loaded + "\n")


def test_each_kernels_module_version_is_read_as_modinfo_reads_it_also_compressed(tmp_path: Path) -> None:
    _host(tmp_path, {RUNNING: ("nvidia.ko", "580.159.03"), NEWER: ("nvidia.ko.xz", "580.173.02")}, loaded="570.1")
    running, installed = ugro_kernel.kernels(tmp_path)
    assert (running, installed) == (RUNNING, [RUNNING, NEWER])  # the newer release sorts last
    assert ugro_kernel.module(RUNNING, tmp_path) == {
        "path": str(tmp_path / "lib/modules" / RUNNING / "updates/dkms/nvidia.ko"),
        "version": "580.159.03",
        "error": None,
    }
    newer = ugro_kernel.module(NEWER, tmp_path)
    assert newer is not None and newer["version"] == "580.173.02"
    assert ugro_kernel.loaded(tmp_path) == "570.1"
    assert not ugro_kernel.has_headers(RUNNING, tmp_path)


def test_a_kernel_without_a_module_and_a_file_that_is_no_module(tmp_path: Path) -> None:
    _host(tmp_path, {})
    assert ugro_kernel.module(NEWER, tmp_path) is None and ugro_kernel.loaded(tmp_path) is None
    folder = tmp_path / "lib/modules" / RUNNING / "updates/dkms"
    folder.mkdir(parents=True)
    (folder / "nvidia.ko").write_text("not an ELF file")
    broken = ugro_kernel.module(RUNNING, tmp_path)
    assert broken is not None and broken["version"] is None and "ELF" in broken["error"]


def test_secure_boot_and_whether_dkms_key_is_enrolled(tmp_path: Path) -> None:
    assert ugro_kernel.secure_boot(tmp_path) == {"state": "no_efi", "mok_key": None, "mok_enrolled": None}
    efivars = tmp_path / "sys/firmware/efi/efivars"
    efivars.mkdir(parents=True)
    (efivars / f"SecureBoot-{ugro_kernel.EFI_GLOBAL}").write_bytes(b"\x06\0\0\0\x01")
    key = tmp_path / "var/lib/dkms/mok.pub"
    key.parent.mkdir(parents=True)
    key.write_bytes(b"\x30\x82 a DER certificate")
    assert ugro_kernel.secure_boot(tmp_path)["mok_enrolled"] is False
    (efivars / f"MokListRT-{ugro_kernel.SHIM_GUID}").write_bytes(b"\x06\0\0\0ESL" + key.read_bytes() + b"tail")
    assert ugro_kernel.secure_boot(tmp_path) == {"state": "enabled", "mok_key": "/var/lib/dkms/mok.pub",
                                                 "mok_enrolled": True}  # fmt: skip
    (efivars / f"SecureBoot-{ugro_kernel.EFI_GLOBAL}").write_bytes(b"\x06\0\0\0\x00")
    assert ugro_kernel.secure_boot(tmp_path)["state"] == "disabled"


def test_where_an_installed_version_comes_from_per_apt_cache_policy() -> None:
    policy = (
        "nvidia-smi:\n  Installed: 580.159.03-1\n  Candidate: 580.159.03-1\n  Version table:\n"
        "     580.173.02-1 500\n        500 http://10.0.0.1:8642 ./ Packages\n"
        " *** 580.159.03-1 1001\n        500 http://10.0.0.1:8642 ./ Packages\n        100 /var/lib/dpkg/status\n"
        "nvidia-driver-cuda:\n  Installed: 580.159.03-0ubuntu0.24.04.1\n  Version table:\n"
        "     580.173.02-1 500\n        500 http://10.0.0.1:8642 ./ Packages\n"
        " *** 580.159.03-0ubuntu0.24.04.1 100\n        100 /var/lib/dpkg/status\n"
    )
    assert ugro_kernel._policy_origins(policy) == {
        "nvidia-smi": ["http://10.0.0.1:8642 ./ Packages", "/var/lib/dpkg/status"],
        "nvidia-driver-cuda": ["/var/lib/dpkg/status"],
    }
