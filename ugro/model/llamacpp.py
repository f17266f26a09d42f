"""llama.cpp on the controller, built once from the registry's llama-cpp-python source distribution and cached.

The registry has no prebuilt llama.cpp. The source distribution of ``llama-cpp-python`` (pinned here by exact
version and sha256) vendors llama.cpp whole: its converter ``convert_hf_to_gguf.py`` with the ``gguf-py`` it is
written against, and the C++ library that the Python binding wraps. :func:`ensure` downloads it once with pip
(``--no-deps``, this machine's pip configuration ignored), unpacks it, builds the binding's wheel with cmake
(a few minutes on 2 cores) and installs it into a private directory; later calls find everything in the cache
(``$UGRO_CACHE``, else ``~/.cache/ugro``), keyed by the source's hash, the build's options, this Python and this
machine's architecture.

The build is portable (``GGML_NATIVE=OFF``: on x86-64, AVX2 with FMA and F16C, no AVX-512 or AMX) rather than
llama.cpp's default ``-march=native``: on a CPU with AMX, the native build's AMX matrix kernel crashed (SIGSEGV)
in the first decode of a q8_0 file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ugro.model.basemodel import ModelError, cache_root, locked
from ugro.module_utils.ugro_checkpoints import sha256_file

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# Only the library the binding loads: no multimodal library, examples, tools, tests or server.
CMAKE_ARGS = (
    "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
    "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF"
)
MARKER = "build.json"


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: the vendored source tree (the converter) and the installed Python binding."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "source" / "vendor" / "llama.cpp"

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def site(self) -> Path:
        return self.root / "site"

    def binding(self) -> ModuleType:
        """The ``llama_cpp`` module of this build (its directory goes first on ``sys.path``)."""
        if str(self.site) not in sys.path:
            sys.path.insert(0, str(self.site))
        import llama_cpp

        # llama.cpp logs through the binding's logger; below ERROR it would print every tensor it loads or quantizes.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        return llama_cpp


def _pip_env() -> dict[str, str]:
    """pip as a user's machine runs it: the registry, none of this machine's configuration or local wheels."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return env


def _run(cmd: list[str], what: str, timeout: float, env: dict[str, str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise ModelError(f"{what} failed (exit {done.returncode}):\n{tail}")


def fetch_sdist(cache: Path) -> Path:
    """The pinned source distribution from the registry (once), checked against its sha256."""
    sdists = cache / "sdists"
    path = sdists / SDIST
    if path.is_file() and sha256_file(path) == SHA256:
        return path
    sdists.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=sdists) as tmp:
        spec = f"{PACKAGE}=={VERSION}"
        # Hash-checking mode: pip compares the archive with the pinned sha256 before it runs anything of it (reading
        # an sdist's metadata runs its build backend). --no-build-isolation: that backend is the scikit-build-core of
        # the controller lock, not an unpinned one pip would fetch.
        pinned = Path(tmp) / "pinned.txt"
        pinned.write_text(f"{spec} --hash=sha256:{SHA256}\n")
        _run(
            [sys.executable, "-m", "pip", "--isolated", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", "--require-hashes", "-d", tmp, "-r", str(pinned)],
            f"pip download {spec}", 900, _pip_env(),
        )  # fmt: skip
        got = Path(tmp) / SDIST
        if not got.is_file():
            raise ModelError(f"pip download {spec} gave no {SDIST}")
        actual = sha256_file(got)
        if actual != SHA256:
            raise ModelError(f"{spec}: the downloaded source's sha256 is {actual}, ugro pins {SHA256}")
        os.replace(got, path)
    return path


def build_dir(cache: Path) -> Path:
    options = hashlib.sha256(CMAKE_ARGS.encode()).hexdigest()[:8]
    tag = f"{VERSION}-{SHA256[:12]}-{options}-py{sys.version_info.major}{sys.version_info.minor}-{platform.machine()}"
    return cache / "llama.cpp" / tag


def _compilers() -> None:
    missing = [name for name in ("cc", "c++") if shutil.which(name) is None]
    if missing:
        raise ModelError(
            f"building llama.cpp needs a C and C++ compiler ({' and '.join(missing)} not found): install them "
            "(Debian/Ubuntu: sudo apt-get install build-essential) and run the export again"
        )


def built(root: Path) -> bool:
    return (root / MARKER).is_file() and (root / "site" / "llama_cpp").is_dir()


def ensure(log: Callable[[str], object] = print) -> LlamaCpp:
    """The cached build, made first if needed (download ~77 MB, build a few minutes on 2 cores)."""
    cache = cache_root()
    root = build_dir(cache)
    if built(root):
        return LlamaCpp(root)
    with locked(root.with_suffix(".lock")):
        if built(root):  # another process built it while this one waited
            return LlamaCpp(root)
        _compilers()
        sdist = fetch_sdist(cache)
        log(f"building llama.cpp from {SDIST} (once per machine; a few minutes on 2 cores)")
        started = time.monotonic()
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root.parent, prefix=".build-") as tmp:
            staging, source = Path(tmp) / "root", Path(tmp) / "root" / "source"
            staging.mkdir()
            with tarfile.open(sdist) as archive:
                archive.extractall(Path(tmp), filter="data")
            os.replace(Path(tmp) / SDIST.removesuffix(".tar.gz"), source)
            env = _pip_env() | {"CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
            # The controller's .venv has the build backend and cmake (controller lock); pip's own isolated build
            # environment would fetch unpinned ones.
            wheels = Path(tmp) / "wheels"
            _run([sys.executable, "-m", "pip", "--isolated", "wheel", "--no-deps", "--no-build-isolation",
                  "-w", str(wheels), str(source)], f"building {SDIST}", 3600, env)  # fmt: skip
            wheel = next(wheels.glob("llama_cpp_python-*.whl"))
            _run([sys.executable, "-m", "pip", "--isolated", "install", "--quiet", "--no-deps", "--target",
                  str(staging / "site"), str(wheel)], f"installing {wheel.name}", 600, _pip_env())  # fmt: skip
            record = {
                "package": f"{PACKAGE}=={VERSION}",
                "sdist_sha256": SHA256,
                "wheel": wheel.name,
                "wheel_sha256": sha256_file(wheel),
                "cmake_args": CMAKE_ARGS,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "build_s": round(time.monotonic() - started, 1),
            }
            (staging / MARKER).write_text(json.dumps(record, indent=1))
            if root.exists():
                shutil.rmtree(root)
            os.replace(staging, root)
        log(f"llama.cpp built in {record['build_s']:.0f} s, cached in {root}")
    return LlamaCpp(root)


if __name__ == "__main__":  # python -m ugro.model.llamacpp: build (or find) the cached llama.cpp
    print(ensure().root)
