"""What the test apt repository's driver and kernel packages do on a test host, as the real ones do where it matters.

A test host has no kernel of its own to build for and no firmware; it stands in for them with plain files where a real
host has them, which the stand-ins and ugro read alike (ugro/module_utils/ugro_kernel.py):

- ``/sys/module/nvidia/version``: the module the kernel has loaded. Absent until a test "boots" the host
  (writes the running kernel's module version there); the dummy ``nvidia-smi`` answers only then, and with that
  version, as the real one does ("couldn't communicate with the NVIDIA driver", "Driver/library version mismatch").
- ``/sys/firmware/efi/efivars/SecureBoot-<guid>`` and ``MokListRT-<guid>``: Secure Boot's state and the enrolled
  machine owner keys, in the firmware's format (4 bytes of attributes, then the value).

The driver's DKMS package builds its module, as DKMS does, for every installed kernel whose headers are there
(``/lib/modules/<release>/build``), and nothing for one without them (still "installed successfully"); with Secure
Boot on and DKMS's key (``/var/lib/dkms/mok.pub``) not in the MOK list, the build fails: the kernel would refuse the
module. Headers installed later build it through ``/etc/kernel/header_postinst.d``, as dkms's hook does. A module is a
real ELF object with a ``.modinfo`` section, so it is read as modinfo reads one.
"""

from __future__ import annotations

import os
import re
import struct

EFI_GLOBAL = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
SHIM_GUID = "605dab50-e046-4300-abb6-3dd810dd8b23"
BUILD_SCRIPT = "/usr/lib/ugro-testbed/nvidia-dkms-build"
HEADER_HOOK = "/etc/kernel/header_postinst.d/ugro-nvidia-dkms"
MOK_PUB = "/var/lib/dkms/mok.pub"


def running_kernel() -> str:
    """The kernel release a test host reports (it shares this machine's kernel)."""
    return os.uname().release


def newer_kernel(release: str) -> str:
    """A kernel release newer than ``release``: its third number one up (6.8.0-51-generic -> 6.8.1-51-generic)."""
    parts = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?(.*)$", release)
    if parts is None:
        return release + ".1"
    return f"{parts[1]}.{parts[2]}.{int(parts[3] or 0) + 1}{parts[4]}"


def module_elf(fields: dict[str, str]) -> bytes:
    """A minimal ELF64 relocatable object holding a ``.modinfo`` section of ``key=value`` strings, as a kernel
    module does."""
    modinfo = b"".join(f"{key}={value}".encode() + b"\0" for key, value in fields.items())
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    at_modinfo = 64
    at_shstrtab = at_modinfo + len(modinfo)
    at_sections = (at_shstrtab + len(shstrtab) + 7) & ~7
    header = struct.pack("<4sBBBBB7sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7,
                         1, 62, 1, 0, 0, at_sections, 0, 64, 0, 0, 64, 3, 2)  # fmt: skip

    def section(name: int, kind: int, flags: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, flags, 0, offset, size, 0, 0, 1, 0)

    body = header + modinfo + shstrtab
    body += b"\0" * (at_sections - len(body))
    return (
        body
        + section(0, 0, 0, 0, 0)
        + section(1, 1, 2, at_modinfo, len(modinfo))
        + section(10, 3, 0, at_shstrtab, len(shstrtab))
    )


def module_template(version: str) -> str:
    return f"/usr/lib/ugro-testbed/nvidia-{version}.ko"


def dkms_build_script(version: str) -> str:
    """The DKMS package's build: ``nvidia-dkms-build [RELEASE...]`` (every installed kernel without arguments)."""
    return f"""#!/bin/sh
# Stand-in for `dkms install nvidia/{version}` (testbed/standins.py): builds for kernels with headers only.
set -u
kernels="$*"
if [ -z "$kernels" ]; then
  kernels="$(uname -r) $(ls /boot 2>/dev/null | sed -n 's/^vmlinuz-//p')"
fi
secure_boot=0
if [ -f /sys/firmware/efi/efivars/SecureBoot-{EFI_GLOBAL} ]; then
  [ "$(od -An -tu1 -j4 -N1 /sys/firmware/efi/efivars/SecureBoot-{EFI_GLOBAL} | tr -d ' ')" = 1 ] && secure_boot=1
fi
status=0
for k in $(echo $kernels | tr ' ' '\\n' | sort -u); do
  if [ ! -f "/lib/modules/$k/build/Makefile" ]; then
    echo "Module build for kernel $k was skipped since the kernel headers for this kernel do not seem to be installed."
    continue
  fi
  if [ "$secure_boot" = 1 ]; then
    key=$(od -An -v -tx1 {MOK_PUB} 2>/dev/null | tr -d ' \\n')
    moks=$(od -An -v -tx1 /sys/firmware/efi/efivars/MokListRT-{SHIM_GUID} 2>/dev/null | tr -d ' \\n')
    case "$moks" in
      *"$key"*) ;;
      *) key="" ;;
    esac
    if [ -z "$key" ]; then
      echo "nvidia/{version} for $k: Secure Boot is on and {MOK_PUB} is not an enrolled key:" \\
           "modprobe: ERROR: could not insert 'nvidia': Key was rejected by service" >&2
      status=1
      continue
    fi
  fi
  mkdir -p "/lib/modules/$k/updates/dkms"
  cp {module_template(version)} "/lib/modules/$k/updates/dkms/nvidia.ko"
  echo "nvidia/{version}, $k, x86_64: installed"
done
exit $status
"""


def dkms_scripts() -> dict[str, str]:
    """postinst (build for every kernel) and prerm (remove the built modules) of the DKMS package."""
    postinst = f'#!/bin/sh\nset -e\nif [ "$1" = configure ]; then {BUILD_SCRIPT}; fi\n'
    prerm = "#!/bin/sh\nrm -f /lib/modules/*/updates/dkms/nvidia.ko\n"
    return {"postinst": postinst, "prerm": prerm}


def header_hook() -> str:
    """dkms's hook run for a kernel whose headers were just installed."""
    return f'#!/bin/sh\n[ -x {BUILD_SCRIPT} ] && exec {BUILD_SCRIPT} "$1"\nexit 0\n'


def headers_scripts(release: str) -> dict[str, str]:
    postinst = (
        "#!/bin/sh\nset -e\n"
        f"mkdir -p /lib/modules/{release}\n"
        f"ln -sfn /usr/src/linux-headers-{release} /lib/modules/{release}/build\n"
        f"run-parts --arg={release} /etc/kernel/header_postinst.d 2>/dev/null || true\n"
    )
    postrm = f"#!/bin/sh\nrm -f /lib/modules/{release}/build\n"
    return {"postinst": postinst, "postrm": postrm}
