"""What a host's kernels, firmware and packages say about its NVIDIA driver (host side, standard library only).

For role nvidia_driver and preflight (through ugro_host_facts' ``kernel`` subset): the running and the installed
kernels, whether each has its headers and an NVIDIA module (and which version), the module the kernel has loaded,
Secure Boot and whether DKMS's signing key is enrolled, and the driver packages installed with where their
installed version comes from. Never changes anything.

Sources, as the kernel and the firmware publish them: ``/sys/module/nvidia/version`` (the loaded module),
``/sys/firmware/efi/efivars`` (``SecureBoot`` and ``MokListRT``, what ``mokutil --sb-state`` and
``mokutil --test-key`` read), ``/boot/vmlinuz-*`` and ``/lib/modules/<release>`` (installed kernels and their
modules; a module's version from its ELF ``.modinfo`` section, as ``modinfo`` reads it), dpkg and ``apt-cache policy``.
"""

from __future__ import annotations

import gzip
import lzma
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

EFI_GLOBAL = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
SHIM_GUID = "605dab50-e046-4300-abb6-3dd810dd8b23"
# The public keys that sign modules built by DKMS: Debian's dkms, then Ubuntu's shim-signed.
MOK_KEYS = ("/var/lib/dkms/mok.pub", "/var/lib/shim-signed/mok/MOK.der")
# Where a kernel's NVIDIA module is, in the order modprobe prefers them (depmod: updates/ first).
MODULE_DIRS = ("updates/dkms", "updates", "kernel/nvidia-*", "kernel/drivers/video", "extra", "misc")
MODULE_NAMES = ("nvidia.ko", "nvidia.ko.zst", "nvidia.ko.xz", "nvidia.ko.gz")
DRIVER_PATTERNS = ("nvidia-*", "libnvidia-*", "linux-modules-nvidia-*", "xserver-xorg-video-nvidia*", "libcuda1")
# A package of the driver itself carries the driver's version (580.159.03-1); NVIDIA's container toolkit
# (libnvidia-container1 1.17.8-1) or Ubuntu's nvidia-prime (0.8.17) match the names but are not the driver.
# Canonical's prebuilt modules carry the kernel's version.
DRIVER_VERSION = re.compile(r"^(\d+:)?\d{3}\.\d+")


def release_key(release: str) -> list[tuple[int, str]]:
    """Sort key of a kernel release (6.8.0-60-generic > 6.8.0-51-generic > 6.8.0-9-generic)."""
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.findall(r"\d+|[A-Za-z]+", release)]


def kernels(root: Path = Path("/")) -> tuple[str, list[str]]:
    """The running kernel and every installed one (those with a ``/boot/vmlinuz-*``, and the running), oldest first."""
    running = os.uname().release
    found = {path.name.removeprefix("vmlinuz-") for path in (root / "boot").glob("vmlinuz-*")}
    return running, sorted(found | {running}, key=release_key)


def has_headers(release: str, root: Path = Path("/")) -> bool:
    """Whether a module can be built for ``release``: its build tree (``linux-headers-<release>``) is there."""
    return (root / "lib/modules" / release / "build" / "Makefile").is_file()


def module_file(release: str, root: Path = Path("/")) -> Path | None:
    """The NVIDIA module modprobe would load for ``release``, or None."""
    base = root / "lib/modules" / release
    for folder in MODULE_DIRS:
        for directory in sorted(base.glob(folder)):
            for name in MODULE_NAMES:
                if (directory / name).is_file():
                    return directory / name
    return None


def _module_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        return gzip.decompress(data)
    if path.suffix == ".zst":
        zstd = shutil.which("zstd", path=os.environ.get("PATH", "") + ":/usr/bin:/bin")
        if zstd is None:
            raise ValueError("compressed with zstd, and zstd is not installed (apt install zstd)")
        return subprocess.run([zstd, "-dcq", str(path)], capture_output=True, check=True, timeout=60).stdout
    return data


def modinfo(path: Path) -> dict[str, str]:
    """The ``.modinfo`` strings of a kernel module (an ELF64 little-endian relocatable object), as modinfo prints."""
    data = _module_bytes(path)
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, shentsize, shnum, shstrndx = struct.unpack_from("<Q", data, 0x28)[0], *struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    for name_at, _type, _flags, _addr, offset, size in sections:
        end = data.index(b"\0", names_at + name_at)
        if data[names_at + name_at : end] == b".modinfo":
            fields: dict[str, str] = {}
            for entry in data[offset : offset + size].split(b"\0"):
                key, sep, value = entry.decode(errors="replace").partition("=")
                if sep and key not in fields:
                    fields[key] = value
            return fields
    raise ValueError("no .modinfo section")


def module(release: str, root: Path = Path("/")) -> dict[str, Any] | None:
    """``{path, version, error}`` of ``release``'s NVIDIA module, or None where it has none."""
    path = module_file(release, root)
    if path is None:
        return None
    try:
        return {"path": str(path), "version": modinfo(path).get("version"), "error": None}
    except (OSError, ValueError, struct.error, IndexError, subprocess.SubprocessError) as exc:
        return {"path": str(path), "version": None, "error": str(exc)}


def loaded(root: Path = Path("/")) -> str | None:
    """The version of the NVIDIA module the kernel runs now, or None where none is loaded."""
    try:
        return (root / "sys/module/nvidia/version").read_text().strip() or None
    except OSError:
        return None


def _efivar(name: str, guid: str, root: Path) -> bytes | None:
    try:
        return (root / "sys/firmware/efi/efivars" / f"{name}-{guid}").read_bytes()[4:]  # after the attributes
    except OSError:
        return None


def secure_boot(root: Path = Path("/")) -> dict[str, Any]:
    """``{state, mok_key, mok_enrolled}``: state ``enabled``/``disabled``, ``no_efi`` (booted by BIOS: no Secure
    Boot) or ``unknown`` (EFI without the variable); the DKMS signing key found and whether the firmware's MOK list
    (shim's ``MokListRT``) holds it, as ``mokutil --test-key`` would say."""
    if not (root / "sys/firmware/efi").is_dir():
        state = "no_efi"
    else:
        value = _efivar("SecureBoot", EFI_GLOBAL, root)
        state = "unknown" if not value else ("enabled" if value[0] == 1 else "disabled")
    key_path = next((k for k in MOK_KEYS if (root / k.lstrip("/")).is_file()), None)
    enrolled: bool | None = None
    if key_path is not None:
        moks = _efivar("MokListRT", SHIM_GUID, root) or b""
        enrolled = (root / key_path.lstrip("/")).read_bytes() in moks
    return {"state": state, "mok_key": key_path, "mok_enrolled": enrolled}


def _policy_origins(text: str) -> dict[str, list[str]]:
    """`apt-cache policy` of several packages -> package -> the sources of its installed version (the version table
    puts a version at five spaces, the installed one after `` *** ``, and its sources at eight)."""
    found: dict[str, list[str]] = {}
    package, in_installed = None, False
    for line in text.splitlines():
        if line and not line.startswith(" "):
            package, in_installed = line.rstrip(":"), False
        elif package is not None and line.startswith(" *** "):
            in_installed = True
            found[package] = []
        elif re.match(r"^ {5}\S", line):
            in_installed = False
        elif in_installed and package is not None and (source := re.match(r"^ {8}-?\d+ (\S.*)$", line)):
            found[package].append(source[1])
    return found


def driver_packages(
    repository: str | None = None, patterns: Iterable[str] = DRIVER_PATTERNS, timeout_s: float = 30
) -> list[dict[str, Any]]:
    """The driver's installed packages: ``{name, version, held, sources, from_repository}``, ``sources`` being where
    apt finds that exact version (repository lines of ``apt-cache policy``; only ``/var/lib/dpkg/status`` when no
    repository offers it: installed from a file, or from a source since removed), ``from_repository`` whether
    ``repository`` (a URL) is one of them."""
    listed = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${db:Status-Abbrev}\n", *patterns],
                            capture_output=True, text=True, check=False, timeout=timeout_s).stdout  # fmt: skip
    installed: list[dict[str, Any]] = []
    for line in listed.splitlines():
        name, version, status = [*line.split("\t"), "", ""][:3]
        if status[1:2] == "i" and (DRIVER_VERSION.match(version) or name.startswith("linux-modules-nvidia-")):
            installed.append({"name": name, "version": version, "held": status.startswith("h")})
    if installed:
        policy = subprocess.run(["apt-cache", "policy", *(str(p["name"]) for p in installed)], capture_output=True,
                                text=True, check=False, timeout=timeout_s).stdout  # fmt: skip
        origins = _policy_origins(policy)
        wanted = (repository or "").rstrip("/")
        for package in installed:
            package["sources"] = origins.get(package["name"], [])
            package["from_repository"] = bool(wanted) and any(
                source.split()[0].rstrip("/") == wanted for source in package["sources"]
            )
    return installed


def facts(repository: str | None = None, root: Path = Path("/"), timeout_s: float = 30) -> dict[str, Any]:
    running, installed = kernels(root)
    return {
        "running": running,
        "installed": installed,
        "newest": installed[-1],
        "headers": {release: has_headers(release, root) for release in installed},
        "modules": {release: module(release, root) for release in installed},
        "loaded": loaded(root),
        "secure_boot": secure_boot(root),
        "driver_packages": driver_packages(repository, timeout_s=timeout_s),
    }
