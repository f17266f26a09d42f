#!/usr/bin/env python3
"""A local stand-in for NVIDIA's CUDA apt repository, for the driver and CUDA roles' tests.

It builds a *flat* apt repository (like NVIDIA's `.../repos/debian12/x86_64/`, used with
`Suites: /`) of tiny dummy packages: the `cuda-keyring` package, the driver packages and
`cuda-toolkit-13-0` with its component packages, each at a PINNED and at a NEWER version, so a test can check
that the pinned one is installed and held and that an upgrade does not pull the newer one; headers for the
running kernel, and a newer kernel with its headers (a kernel update); and, outside the index, the pinned driver as
another origin builds it. The driver's DKMS package builds a module as DKMS does (testbed/standins.py).
The index is signed with a throwaway GPG key made in a temporary GNUPGHOME (removed afterwards); the dummy
`cuda-keyring` package ships that key where NVIDIA's ships theirs.

    python -m testbed.aptrepo build DIR   # prints the RepoInfo as JSON (also written to DIR/repo.json)

    from testbed.aptrepo import build
    info = build(Path("..."))

The dummy `nvidia-smi` answers the queries ugro makes (`--query-gpu=...`, `--list-gpus`) with its
own version; the dummy `nvcc` prints its release. Nothing runs at install time: no maintainer
scripts, no dependencies outside the repository, so each installs in a fraction of a second on a
Debian 12 minbase host.

A build is cached: `DIR/.complete` holds a hash of the whole spec (packages, their files and
this format's version); the same hash returns the recorded RepoInfo at once.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from testbed import standins

FORMAT = 2  # bump when the layout changes without the spec changing
EPOCH = 1735689600  # 2025-01-01: every file's mtime in the .debs

KEYRING_PATH = "/usr/share/keyrings/cuda-archive-keyring.gpg"
KEYRING_VERSION = "1.1-1"
KEYRING_DEB = f"cuda-keyring_{KEYRING_VERSION}_all.deb"

# The driver: one branch, R580 (what CUDA 13.0 needs, ugro/stack/cuda.py; open kernel modules for RTX 50), a
# pinned and a newer release. The pinned one must pass the nvidia_driver role's check against the lock.
DRIVER_PINNED = "580.159.03"
DRIVER_NEWER = "580.173.02"
# What the nvidia_driver role installs by default on Debian 12 with the open kernel modules (NVIDIA's
# compute-only install: nvidia-driver-cuda + nvidia-kernel-open-dkms; nvidia-smi is its own package).
DRIVER_PACKAGES = ("nvidia-kernel-open-dkms", "nvidia-driver-cuda", "nvidia-smi")

# The CUDA toolkit 13.0 (the CUDA of torch's wheels in the lock): a pinned and a newer release.
CUDA_PINNED = "13.0.2"
CUDA_NEWER = "13.0.3"
CUDA_PACKAGE = "cuda-toolkit-13-0"
# What the metapackage pulls, shaped like NVIDIA's repository: each release of it depends on that release's
# cuda-compiler/cuda-libraries metapackages, and they on the component packages, every dependency `>=` the
# version the release shipped (a component's own version, not the toolkit's), so apt alone takes a later
# release's components. A component a release did not change (cudart here) has one version for both.
# release -> package -> upstream version (nvcc prints its own as V...).
CUDA_COMPONENTS = {
    CUDA_PINNED: {
        "cuda-compiler-13-0": CUDA_PINNED,
        "cuda-libraries-13-0": CUDA_PINNED,
        "cuda-nvcc-13-0": "13.0.88",
        "cuda-cudart-13-0": "13.0.96",
        "libcublas-13-0": "13.1.0.3",
    },
    CUDA_NEWER: {
        "cuda-compiler-13-0": CUDA_NEWER,
        "cuda-libraries-13-0": CUDA_NEWER,
        "cuda-nvcc-13-0": "13.0.93",
        "cuda-cudart-13-0": "13.0.96",
        "libcublas-13-0": "13.1.1.3",
    },
}
# An unversioned dependency of the metapackage, one version for every release (NVIDIA's registers the
# toolkit's libraries with the loader: /etc/ld.so.conf.d/988_cuda-13.conf).
CUDA_CONFIG_PACKAGE = "cuda-toolkit-13-config-common"
CUDA_CONFIG_VERSION = "13.0.96"

# The pinned driver as another source builds it (testbed/standins.py's host that had a driver before ugro).
FOREIGN_REVISION = "0ubuntu0.24.04.1"

GPU_NAME = "NVIDIA GeForce RTX 5070 Ti"
GPU_MEMORY_MIB = 12227

NVIDIA_SMI = r"""#!/bin/sh
# Dummy nvidia-smi from ugro's test apt repository (testbed/aptrepo.py): no GPU, no driver,
# answers the queries ugro makes as a one-GPU host with driver @VERSION@ would, once the kernel
# has loaded that module (testbed/standins.py: /sys/module/nvidia/version), and fails as the real
# one does before.
version=@VERSION@
loaded=$(cat /sys/module/nvidia/version 2>/dev/null)
if [ -z "$loaded" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." \
       "Make sure that the latest NVIDIA driver is installed and running." >&2
  exit 9
fi
if [ "$loaded" != "$version" ]; then
  echo "Failed to initialize NVML: Driver/library version mismatch" >&2
  echo "NVML library version: $version" >&2
  exit 18
fi
name="@GPU_NAME@"
memory=@GPU_MEMORY@
query=""
nounits=0
for arg in "$@"; do
  case "$arg" in
    -L|--list-gpus)
      echo "GPU 0: $name (UUID: GPU-00000000-0000-0000-0000-000000000000)"
      exit 0 ;;
    --query-gpu=*) query="${arg#--query-gpu=}" ;;
    --format=*nounits*) nounits=1 ;;
    --format=*) ;;
    -h|--help) echo "dummy nvidia-smi $version: --query-gpu=F,.. --format=csv[,noheader][,nounits] | -L"; exit 0 ;;
    *) echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2; exit 2 ;;
  esac
done
if [ -z "$query" ]; then
  echo "NVIDIA-SMI $version    Driver Version: $version    CUDA Version: 13.0"
  echo "|   0  $name    ${memory}MiB |"
  exit 0
fi
out=""
IFS=,
for f in $query; do
  case "$f" in
    index) v=0 ;;
    driver_version) v="$version" ;;
    name) v="$name" ;;
    memory.total) if [ "$nounits" = 1 ]; then v="$memory"; else v="$memory MiB"; fi ;;
    memory.used) if [ "$nounits" = 1 ]; then v=0; else v="0 MiB"; fi ;;
    compute_cap) v="12.0" ;;
    *) echo "Field \"$f\" is not a valid field to query." >&2; exit 2 ;;
  esac
  out="${out:+$out, }$v"
done
echo "$out"
"""

NVCC = r"""#!/bin/sh
# Dummy nvcc from ugro's test apt repository (testbed/aptrepo.py): prints its release, compiles nothing.
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Copyright (c) 2005-2025 NVIDIA Corporation"
echo "Cuda compilation tools, release @RELEASE@, V@VERSION@"
echo "Build cuda_@RELEASE@.r@RELEASE@/compiler.dummy_0"
"""


@dataclass(frozen=True)
class Package:
    """One dummy .deb: control fields and the files it ships (path -> (mode, content))."""

    name: str
    version: str
    architecture: str = "amd64"
    depends: tuple[str, ...] = ()
    description: str = "dummy package for ugro's tests"
    files: tuple[tuple[str, int, str], ...] = ()
    section: str = "multiverse/devel"
    scripts: tuple[tuple[str, str], ...] = ()  # maintainer scripts: (postinst|prerm|postrm, text)

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_{self.architecture}.deb"

    def control(self) -> str:
        lines = [
            f"Package: {self.name}",
            f"Version: {self.version}",
            f"Architecture: {self.architecture}",
            "Maintainer: ugro tests <ugro@localhost>",
            "Priority: optional",
            f"Section: {self.section}",
        ]
        if self.depends:
            lines.append(f"Depends: {', '.join(self.depends)}")
        lines.append(f"Description: {self.description}")
        lines.append(" Built by ugro's testbed/aptrepo.py for tests; installs nothing real.")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RepoInfo:
    """What a test needs to know about a built repository (also written to <dest>/repo.json)."""

    dest: str
    keyring_deb: str
    keyring_path: str
    driver_packages: list[str]
    driver_pinned: str
    driver_newer: str
    cuda_package: str
    cuda_pinned: str
    cuda_newer: str
    packages: list[str] = field(default_factory=list)
    # The kernel packages (testbed/standins.py): headers of the running kernel, a newer kernel and its headers.
    kernel_running: str = ""
    kernel_newer: str = ""
    # The pinned driver from another source: .debs under foreign/, in no index (FOREIGN_REVISION).
    foreign_debs: list[str] = field(default_factory=list)
    foreign_version: str = ""
    # The toolkit's component packages (CUDA_COMPONENTS): package -> [upstream version in the pinned release,
    # in the newer one] (the same where the newer release did not change it).
    cuda_components: dict[str, list[str]] = field(
        default_factory=lambda: {
            name: [version, CUDA_COMPONENTS[CUDA_NEWER][name]] for name, version in CUDA_COMPONENTS[CUDA_PINNED].items()
        }
    )


def deb_version(version: str) -> str:
    """The Debian version of a dummy package built for an upstream version (revision 1)."""
    return f"{version}-1"


def _driver_packages(version: str, revision: str | None = None) -> list[Package]:
    revision = revision or deb_version(version)
    module = standins.module_elf({"version": version, "license": "Dual MIT/GPL", "name": "nvidia",
                                  "description": "NVIDIA open kernel module (ugro test stand-in)"})  # fmt: skip
    smi = (
        NVIDIA_SMI.replace("@VERSION@", version)
        .replace("@GPU_NAME@", GPU_NAME)
        .replace("@GPU_MEMORY@", str(GPU_MEMORY_MIB))
    )
    return [
        Package(
            "nvidia-kernel-open-dkms",
            revision,
            description=f"NVIDIA open kernel modules {version} (dummy)",
            files=(
                (f"/usr/src/nvidia-{version}/README.ugro", 0o644, "dummy: see testbed/standins.py\n"),
                (standins.BUILD_SCRIPT, 0o755, standins.dkms_build_script(version)),
                (standins.module_template(version), 0o644, "hex:" + module.hex()),
                (standins.HEADER_HOOK, 0o755, standins.header_hook()),
            ),
            section="non-free/kernel",
            scripts=tuple(standins.dkms_scripts().items()),
        ),
        Package(
            "nvidia-smi",
            revision,
            description=f"NVIDIA System Management Interface {version} (dummy)",
            files=(("/usr/bin/nvidia-smi", 0o755, smi),),
            section="non-free/utils",
        ),
        Package(
            "nvidia-driver-cuda",
            revision,
            depends=(f"nvidia-smi (= {revision})", f"nvidia-kernel-open-dkms (= {revision})"),
            description=f"NVIDIA driver CUDA integration components {version} (dummy)",
            section="non-free/libs",
        ),
    ]


def _cuda_package(version: str) -> Package:
    """The toolkit's metapackage of one release: nothing of its own, its release's parts at `>=` (as NVIDIA's)."""
    parts = CUDA_COMPONENTS[version]
    return Package(
        CUDA_PACKAGE,
        deb_version(version),
        depends=(
            CUDA_CONFIG_PACKAGE,
            f"cuda-compiler-13-0 (>= {parts['cuda-compiler-13-0']})",
            f"cuda-libraries-13-0 (>= {parts['cuda-libraries-13-0']})",
        ),
        description=f"CUDA Toolkit {version} meta-package (dummy)",
    )


def _cuda_components(version: str, since: str | None = None) -> list[Package]:
    """The component packages of one release (without those unchanged since the release `since`)."""
    parts = CUDA_COMPONENTS[version]
    release = ".".join(version.split(".")[:2])
    nvcc = NVCC.replace("@VERSION@", parts["cuda-nvcc-13-0"]).replace("@RELEASE@", release)
    packages = [
        Package(
            "cuda-compiler-13-0",
            deb_version(parts["cuda-compiler-13-0"]),
            depends=(f"cuda-nvcc-13-0 (>= {parts['cuda-nvcc-13-0']})",),
            description=f"CUDA compiler {version} meta-package (dummy)",
        ),
        Package(
            "cuda-libraries-13-0",
            deb_version(parts["cuda-libraries-13-0"]),
            depends=(
                f"cuda-cudart-13-0 (>= {parts['cuda-cudart-13-0']})",
                f"libcublas-13-0 (>= {parts['libcublas-13-0']})",
            ),
            description=f"CUDA libraries {version} meta-package (dummy)",
        ),
        Package(
            "cuda-nvcc-13-0",
            deb_version(parts["cuda-nvcc-13-0"]),
            description=f"CUDA nvcc {parts['cuda-nvcc-13-0']} (dummy)",
            files=((f"/usr/local/cuda-{release}/bin/nvcc", 0o755, nvcc),),
        ),
        Package(
            "cuda-cudart-13-0",
            deb_version(parts["cuda-cudart-13-0"]),
            description=f"CUDA Runtime native libraries {parts['cuda-cudart-13-0']} (dummy: no library)",
        ),
        Package(
            "libcublas-13-0",
            deb_version(parts["libcublas-13-0"]),
            description=f"CUBLAS native runtime libraries {parts['libcublas-13-0']} (dummy: no library)",
        ),
    ]
    unchanged = CUDA_COMPONENTS[since] if since else {}
    return [p for p in packages if unchanged.get(p.name) != parts[p.name]]


def _cuda_config_package() -> Package:
    """NVIDIA's per-major configuration package: the toolkit's libraries registered with the loader."""
    return Package(
        CUDA_CONFIG_PACKAGE,
        deb_version(CUDA_CONFIG_VERSION),
        architecture="all",
        description="CUDA 13 toolkit configuration (dummy)",
        files=(("/etc/ld.so.conf.d/988_cuda-13.conf", 0o644, "/usr/local/cuda-13/targets/x86_64-linux/lib\n"),),
    )


def _keyring_package(public_key: bytes) -> Package:
    # The key is binary; it travels through the spec as hex and is written back as bytes.
    return Package(
        "cuda-keyring",
        KEYRING_VERSION,
        architecture="all",
        description="GPG keyring for the (dummy) CUDA repository",
        files=((KEYRING_PATH, 0o644, "hex:" + public_key.hex()),),
        section="misc",
    )


def _kernel_packages() -> list[Package]:
    """Headers for the running kernel and for a newer one, and the newer kernel's image (a kernel update)."""
    running, newer = standins.running_kernel(), standins.newer_kernel(standins.running_kernel())
    headers = [
        Package(
            f"linux-headers-{release}",
            "1",
            description=f"Header files for Linux {release} (dummy)",
            files=((f"/usr/src/linux-headers-{release}/Makefile", 0o644, "# dummy kernel build tree\n"),),
            section="kernel",
            scripts=tuple(standins.headers_scripts(release).items()),
        )
        for release in (running, newer)
    ]
    image = Package(
        f"linux-image-{newer}",
        "1",
        description=f"Linux {newer} (dummy: a kernel update waiting for the next boot)",
        files=((f"/boot/vmlinuz-{newer}", 0o644, "dummy kernel\n"), (f"/lib/modules/{newer}/modules.order", 0o644, "")),
        section="kernel",
    )
    return [*headers, image]


def foreign_driver() -> list[Package]:
    """The pinned driver as another source built it (as Ubuntu's archive does, ``-0ubuntu0.24.04.1``): not in the
    repository's index, for a test to install from its file, as a host that had a driver before ugro."""
    return _driver_packages(DRIVER_PINNED, f"{DRIVER_PINNED}-{FOREIGN_REVISION}")


def spec() -> list[Package]:
    """Every package except the keyring (whose content is the key made at build time)."""
    return [
        *_driver_packages(DRIVER_PINNED),
        *_driver_packages(DRIVER_NEWER),
        *_kernel_packages(),
        _cuda_package(CUDA_PINNED),
        *_cuda_components(CUDA_PINNED),
        _cuda_package(CUDA_NEWER),
        *_cuda_components(CUDA_NEWER, since=CUDA_PINNED),
        _cuda_config_package(),
    ]


def spec_hash() -> str:
    payload = json.dumps(
        {
            "format": FORMAT,
            "keyring": [KEYRING_PATH, KEYRING_VERSION],
            "packages": [asdict(p) for p in [*spec(), *foreign_driver()]],
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> bytes:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {done.returncode}): {done.stderr.decode(errors='replace')}")
    return done.stdout


def _build_deb(package: Package, stage: Path, out: Path) -> None:
    root = stage / f"{package.name}_{package.version}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(package.control())
    for script, text in package.scripts:
        (root / "DEBIAN" / script).write_text(text)
        (root / "DEBIAN" / script).chmod(0o755)
    for path, mode, content in package.files:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if content.startswith("hex:"):
            target.write_bytes(bytes.fromhex(content[4:]))
        else:
            target.write_text(content)
        target.chmod(mode)
    # Reproducible: the same spec gives byte-identical .debs (an apt proxy may have cached the old ones).
    for staged in [root, *root.rglob("*")]:
        os.utime(staged, (EPOCH, EPOCH), follow_symlinks=False)
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH)}
    _run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(root), str(out / package.filename)], env)


def _hashes(data: bytes) -> dict[str, str]:
    return {name: hashlib.new(name, data).hexdigest() for name in ("md5", "sha1", "sha256", "sha512")}


def _packages_index(packages: list[Package], dest: Path) -> bytes:
    stanzas = []
    for package in packages:
        data = (dest / package.filename).read_bytes()
        digest = _hashes(data)
        control = package.control().rstrip("\n").split("\n")
        # Filename, Size and the hashes go after the Description's first line's fields, like dpkg-scanpackages.
        desc_at = next(i for i, line in enumerate(control) if line.startswith("Description:"))
        extra = [
            f"Filename: ./{package.filename}",
            f"Size: {len(data)}",
            f"MD5sum: {digest['md5']}",
            f"SHA1: {digest['sha1']}",
            f"SHA256: {digest['sha256']}",
            f"SHA512: {digest['sha512']}",
        ]
        stanzas.append("\n".join(control[:desc_at] + extra + control[desc_at:]) + "\n")
    return "\n".join(stanzas).encode()


def _release(files: dict[str, bytes]) -> str:
    lines = [
        "Origin: ugro-test",
        "Label: ugro test CUDA repository (dummy)",
        "Architectures: amd64 all",
        f"Date: {datetime.now(UTC).strftime('%a, %d %b %Y %H:%M:%S UTC')}",
        "Acquire-By-Hash: no",
    ]
    for field_name, algo in (("MD5Sum", "md5"), ("SHA1", "sha1"), ("SHA256", "sha256"), ("SHA512", "sha512")):
        lines.append(f"{field_name}:")
        for name, data in sorted(files.items()):
            lines.append(f" {hashlib.new(algo, data).hexdigest()} {len(data):>8} {name}")
    return "\n".join(lines) + "\n"


def _info(dest: Path, packages: list[Package]) -> RepoInfo:
    return RepoInfo(
        dest=str(dest),
        keyring_deb=KEYRING_DEB,
        keyring_path=KEYRING_PATH,
        driver_packages=list(DRIVER_PACKAGES),
        driver_pinned=DRIVER_PINNED,
        driver_newer=DRIVER_NEWER,
        cuda_package=CUDA_PACKAGE,
        cuda_pinned=CUDA_PINNED,
        cuda_newer=CUDA_NEWER,
        packages=[p.filename for p in packages],
        kernel_running=standins.running_kernel(),
        kernel_newer=standins.newer_kernel(standins.running_kernel()),
        foreign_debs=[f"foreign/{p.filename}" for p in foreign_driver()],
        foreign_version=f"{DRIVER_PINNED}-{FOREIGN_REVISION}",
    )


def _current(dest: Path, wanted: str) -> RepoInfo | None:
    marker = dest / ".complete"
    if marker.is_file() and marker.read_text().strip() == wanted and (dest / "repo.json").is_file():
        return RepoInfo(**json.loads((dest / "repo.json").read_text()))
    return None


def _sign_and_index(out: Path, work: Path) -> list[Package]:
    gnupg = work / "g"  # short: gpg-agent's socket path must fit in 108 bytes
    gnupg.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(gnupg)}
    gpg = ["gpg", "--batch", "--quiet", "--no-tty"]
    try:
        uid = "ugro test repository <ugro@localhost>"
        _run([*gpg, "--passphrase", "", "--quick-gen-key", uid, "ed25519", "sign", "never"], env=env)
        public_key = _run([*gpg, "--export"], env=env)
        packages = [_keyring_package(public_key), *spec()]
        for package in packages:
            _build_deb(package, work / "stage", out)
        (out / "foreign").mkdir()
        for package in foreign_driver():
            _build_deb(package, work / "stage-foreign", out / "foreign")
        (out / "cuda-archive-keyring.gpg").write_bytes(public_key)
        index = _packages_index(packages, out)
        packages_gz = gzip.compress(index, mtime=0)
        (out / "Packages").write_bytes(index)
        (out / "Packages.gz").write_bytes(packages_gz)
        (out / "Release").write_text(_release({"Packages": index, "Packages.gz": packages_gz}))
        _run([*gpg, "--yes", "--clearsign", "-o", str(out / "InRelease"), str(out / "Release")], env=env)
        _run([*gpg, "--yes", "-abs", "-o", str(out / "Release.gpg"), str(out / "Release")], env=env)
    finally:
        subprocess.run(["gpgconf", "--kill", "all"], env=env, capture_output=True, check=False)
    return packages


def build(dest: Path) -> RepoInfo:
    """Build the repository in `dest` unless it is current; an outdated one is replaced whole.

    The new repository is built beside `dest` and renamed into place, so a server of `dest` (or a
    second build racing this one) never sees half a repository.
    """
    dest = Path(dest).resolve()
    wanted = spec_hash()
    current = _current(dest, wanted)
    if current is not None:
        return current
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ugro-aptrepo-"))
    out = Path(tempfile.mkdtemp(prefix=f".{dest.name}-new-", dir=dest.parent))
    try:
        out.chmod(0o755)
        packages = _sign_and_index(out, work)
        info = _info(dest, packages)
        (out / "repo.json").write_text(json.dumps(asdict(info), indent=2) + "\n")
        (out / ".complete").write_text(wanted + "\n")
        current = _current(dest, wanted)  # another build finished first: keep its key, drop ours
        if current is not None:
            return current
        old = dest.parent / f".{dest.name}-old-{os.getpid()}"
        if dest.exists():
            dest.rename(old)
        out.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
        return info
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.aptrepo", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build (or reuse) the repository in DIR and print its RepoInfo as JSON")
    build_cmd.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    info = build(args.dir)
    json.dump(asdict(info), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
