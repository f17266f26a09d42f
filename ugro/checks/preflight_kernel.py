"""The preflight's kernel rows on GPU hosts (ugro_host_facts' ``kernel`` subset): Secure Boot and what it means for
the NVIDIA module, the module the kernel runs against the one installed, and the newest installed kernel's module
(the driver after the next boot)."""

from __future__ import annotations

from typing import Any

from ugro.checks.preflight_report import Cell, Check

PROVISION = "make provision ANSIBLE_ARGS='--limit {host}'"


def _has_gpu(facts: dict[str, Any]) -> bool:
    gpu = facts.get("gpu", {})
    return bool(gpu.get("gpus") or gpu.get("pci_devices"))


def _version(kernel: dict[str, Any], release: str) -> str | None:
    module = kernel.get("modules", {}).get(release)
    return module.get("version") if module else None


def secure_boot_cell(host: str, kernel: dict[str, Any]) -> Cell:
    sb = kernel.get("secure_boot", {})
    state = sb.get("state")
    if state != "enabled":
        return Cell("PASS", {"disabled": "off", "no_efi": "off (BIOS boot)"}.get(str(state), str(state)))
    loaded = kernel.get("loaded")
    if loaded and loaded == _version(kernel, kernel["running"]):
        return Cell("PASS", "on; the NVIDIA module loads (signed)")
    if sb.get("mok_enrolled"):
        return Cell("PASS", "on; DKMS's key enrolled")
    key = sb.get("mok_key") or "/var/lib/dkms/mok.pub"
    return Cell(
        "FAIL",
        "on; no key enrolled",
        f"{host}: Secure Boot is on and DKMS's key {key} is not enrolled: the kernel refuses an NVIDIA module DKMS "
        "builds (Key was rejected by service)",
        f"on {host}: sudo mokutil --import {key}, reboot and enroll it in the MOK Manager; or turn Secure Boot off; "
        f"then {PROVISION.format(host=host)}",
    )


def module_cell(host: str, kernel: dict[str, Any]) -> Cell:
    installed = _version(kernel, kernel["running"])
    loaded = kernel.get("loaded")
    if installed is None:
        return Cell(
            "FAIL",
            f"none for {kernel['running']}",
            f"{host}: the running kernel {kernel['running']} has no NVIDIA module",
            PROVISION.format(host=host) + " (installs its headers and builds it)",
        )
    if loaded == installed:
        return Cell("PASS", f"{loaded} loaded")
    return Cell(
        "FAIL",
        f"{loaded or 'none'} loaded, {installed} installed",
        f"{host}: the kernel runs {('module ' + loaded) if loaded else 'no NVIDIA module'} and {installed} is "
        "installed: a reboot is pending",
        f"reboot {host} (or set nvidia_driver_reboot_allowed: true and {PROVISION.format(host=host)})",
    )


def next_kernel_cell(host: str, kernel: dict[str, Any]) -> Cell:
    newest, running = kernel["newest"], kernel["running"]
    if newest == running:
        return Cell("PASS", "the running kernel is the newest")
    wanted, found = _version(kernel, running), _version(kernel, newest)
    if found is not None and found == wanted:
        return Cell("PASS", f"{newest}: {found}")
    return Cell(
        "FAIL",
        f"{newest}: {found or 'no module'}",
        f"{host}: the kernel it boots next, {newest}, has {('module ' + found) if found else 'no NVIDIA module'}"
        f"{'' if wanted is None else ', not ' + wanted}: after the next reboot the GPU has no driver",
        PROVISION.format(host=host) + " (installs that kernel's headers and builds its module)",
    )


def kernel_rows(facts: dict[str, dict[str, Any]]) -> list[Check]:
    """``secure boot``, ``nvidia module`` and ``next kernel``: PASS "no GPU" on CPU hosts."""
    rows = [Check("secure boot"), Check("nvidia module"), Check("next kernel")]
    for host, f in facts.items():
        kernel = f.get("kernel")
        if not _has_gpu(f) or kernel is None:
            for row in rows:
                row.cells[host] = Cell("SKIP", "-") if _has_gpu(f) else Cell("PASS", "no GPU")
            continue
        rows[0].cells[host] = secure_boot_cell(host, kernel)
        rows[1].cells[host] = module_cell(host, kernel)
        rows[2].cells[host] = next_kernel_cell(host, kernel)
    return rows
