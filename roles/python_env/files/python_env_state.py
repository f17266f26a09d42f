"""State of a node's Python environment, in one round trip (role python_env).

Run by the node's interpreter: python_env_state.py VENV WHEELHOUSE_DEST GPU_MODE, with the lock
files' text as JSON on stdin ({"base": "...", "gpu": "..." or null}). Prints one JSON object: the
interpreter's version and machine, the venv's Python, whether the
host has an NVIDIA GPU, the lock lines the venv lacks, the packages it holds beyond the locks, and
the lock hashes of the wheelhouses already on the node. Changes nothing. Standard library only.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys

# Tools pip itself manages and `pip freeze` leaves out.
IGNORED = {"pip", "setuptools", "wheel", "distribute", "pkg-resources"}

LIST_CODE = (
    "import json, sys, importlib.metadata as m; "
    "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
    "'dists': [[d.metadata['Name'], d.version] for d in m.distributions() if d.metadata['Name']]}))"
)


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(label, text):
    """Pins of a lock file as {canonical name: (line, version)}, and the lines that are not pins."""
    pins, errors = {}, []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)$", line)
        if not match:
            errors.append("%s line %d: '%s' is not a pin of the form name==version" % (label, number, line))
            continue
        pins[canonical(match.group(1))] = (line, match.group(3))
    return pins, errors


def same_version(wanted, installed):
    """1.0 == 1.0; a pin without a local label (torch==2.13.0) accepts any local build (+cpu)."""
    return installed == wanted or ("+" not in wanted and installed.split("+", 1)[0] == wanted)


def venv_state(venv):
    python = os.path.join(venv, "bin", "python")
    if not os.path.lexists(python):
        return None, []
    try:
        out = subprocess.run([python, "-c", LIST_CODE], capture_output=True, text=True, timeout=120, check=True)
        data = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return "broken", []
    return data["python"], data["dists"]


def detect_gpu():
    smi = shutil.which("nvidia-smi") or ("/usr/bin/nvidia-smi" if os.path.exists("/usr/bin/nvidia-smi") else None)
    if smi:
        try:
            out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=60)
            gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
            if out.returncode == 0 and gpus:
                return True, "nvidia-smi lists %d GPU(s)" % len(gpus)
        except (OSError, subprocess.SubprocessError):
            pass
    root = "/sys/bus/pci/devices"
    for device in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, device, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(root, device, "class")) as f:
                klass = f.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and klass.startswith("0x03"):
            return True, "PCI display device %s of vendor 10de (NVIDIA)" % device
    return False, "no nvidia-smi listing a GPU and no PCI display device of vendor 10de (NVIDIA)"


def wheelhouse_hash(directory):
    try:
        with open(os.path.join(directory, "ugro-wheelhouse.json")) as f:
            return json.load(f).get("lock_sha256", "")
    except (OSError, ValueError, AttributeError):
        return ""


def main():
    venv, dest, gpu_mode = sys.argv[1:4]
    locks = json.load(sys.stdin)
    gpu_found, gpu_how = detect_gpu()
    gpu_enabled = gpu_mode == "present" or (gpu_mode == "auto" and gpu_found)

    wanted, errors = parse_lock("python_env_requirements", locks["base"])
    if gpu_enabled and locks.get("gpu") is not None:
        gpu_pins, gpu_errors = parse_lock("python_env_gpu_requirements", locks["gpu"])
        wanted.update(gpu_pins)
        errors += gpu_errors
    for name in IGNORED:
        wanted.pop(name, None)

    venv_python, dists = venv_state(venv)
    installed = {canonical(name): version for name, version in dists if canonical(name) not in IGNORED}
    missing = [
        line if name not in installed else "%s (installed: %s)" % (line, installed[name])
        for name, (line, version) in sorted(wanted.items())
        if name not in installed or not same_version(version, installed[name])
    ]
    extra = sorted(name for name in installed if name not in wanted)

    print(
        json.dumps(
            {
                "python": "%d.%d" % sys.version_info[:2],
                "machine": platform.machine(),
                "venv_python": venv_python,
                "gpu_found": gpu_found,
                "gpu_how": gpu_how,
                "gpu_enabled": gpu_enabled,
                "lock_errors": errors,
                "missing": missing,
                "extra": extra,
                "wheelhouse": {
                    "base": wheelhouse_hash(os.path.join(dest, "base")),
                    "gpu": wheelhouse_hash(os.path.join(dest, "gpu")),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
