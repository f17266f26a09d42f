"""One coherent GPU stack (ugro/stack/cuda.py): the pinned driver runs the lock's CUDA runtime, `make provision`
refuses one that does not before any host changes, and the table's rules hold for the reference cluster's
cards and for the cards torch's CUDA 13 build dropped. docs/stack.md states the versions the locks pin.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import PYTHON, REPO, Run, run_env

from testbed import aptrepo
from ugro.stack import cuda as stack
from ugro.stack import lockfile as locks

OLD_DRIVER = "570.172.08"  # the R570 pin of CUDA 12.8 days


def _role_default(role: str, key: str) -> str:
    return str(yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())[key])


def test_the_pinned_driver_runs_the_cuda_runtime_of_every_lock() -> None:
    cuda = stack.lock_cuda_runtime(locks.LOCKS)
    assert cuda == "13.0"  # torch 2.13.0's nvidia-cuda-runtime 13.0.96
    for node in sorted(locks.LOCKS.glob("py3.*/node.txt")):
        assert stack.lock_cuda_runtime(node) == cuda, node
    pinned = _role_default("nvidia_driver", "nvidia_driver_version")
    assert pinned == stack.pinned_driver() and pinned.startswith("580.")
    assert stack.min_driver(cuda) == "580.65.06" and stack.driver_ok(pinned, cuda)
    assert stack.check_driver(pinned, locks.LOCKS).ok
    # The optional toolkit compiles extensions for the CUDA torch runs, with the same driver.
    toolkit = _role_default("cuda_toolkit", "cuda_toolkit_version")
    assert stack.major_minor(toolkit) == cuda and stack.driver_ok(pinned, toolkit)
    # The Molecule scenarios install the dummy repository's pinned driver: it passes the role's check too.
    assert stack.driver_ok(aptrepo.DRIVER_PINNED, cuda) and stack.major_minor(aptrepo.CUDA_PINNED) == cuda


def test_driver_versions_compare_as_numbers() -> None:
    assert not stack.driver_ok("580.9", "13.0")  # as strings "580.9" > "580.65.06"
    assert stack.driver_ok("580.65.06", "13.0") and stack.driver_ok("1000.1", "13.0")
    assert not stack.driver_ok(OLD_DRIVER, "13.0") and not stack.driver_ok("575.64.05", "13.0")
    with pytest.raises(stack.StackError, match="driver table"):
        stack.min_driver("14.0")
    with pytest.raises(stack.StackError, match="not a version"):
        stack.driver_ok("580.x", "13.0")


@pytest.mark.parametrize(
    ("cc", "how", "cubin"),
    [
        ("12.0", "native", "sm_120"),  # RTX 5070 Ti
        ("8.9", "native", "sm_86"),  # RTX 4070: Ada runs the Ampere cubin
        ("8.6", "native", "sm_86"),  # RTX 3070 Ti
        ("7.5", "native", "sm_75"),  # Turing, the oldest CUDA 13 supports
        ("10.3", "native", "sm_100"),
        ("12.1", "native", "sm_120"),
        ("13.0", "none", None),  # a card newer than the build: no PTX in torch 2.13's wheels to compile for it
        ("7.0", "none", None),  # V100: Volta, dropped by CUDA 13
        ("6.1", "none", None),  # GTX 1080: Pascal
        ("5.2", "none", None),  # GTX 980: Maxwell
    ],
)
def test_a_card_runs_a_cubin_of_its_major_or_newer_ptx(cc: str, how: str, cubin: str | None) -> None:
    assert stack.support(cc, "13.0") == how
    assert stack.runs_natively(cc, "13.0") == (how == "native")
    assert stack.cubin_for(cc, "13.0") == cubin


def test_ptx_runs_on_newer_cards_only(monkeypatch: pytest.MonkeyPatch) -> None:
    build = stack.TorchBuild("13.0", sass=("8.0",), ptx=("9.0",))
    monkeypatch.setitem(stack.TORCH_BUILDS, "13.0", build)
    assert [stack.support(cc, "13.0") for cc in ("8.6", "9.0", "12.0", "7.5")] == ["native", "ptx", "ptx", "none"]
    assert build.arch_list() == "sm_80 compute_90"


def test_the_table_matches_the_torch_installed_here() -> None:
    """This machine's torch is the lock's CUDA 13.0 build: its compiled architectures are the table's."""
    import torch

    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} here is a CPU build")
    build = stack.torch_build(torch.version.cuda)
    assert torch._C._cuda_getArchFlags().split() == build.arch_list().split()


def test_the_backend_is_what_the_host_really_runs() -> None:
    reference = ["12.0"], "580.173.02", "13.0"
    assert stack.backend(*reference, unsloth_installed=True).label() == "unsloth (CUDA, nccl)"
    assert stack.backend(*reference, unsloth_installed=False).label() == "hf (CUDA, nccl)"
    assert stack.backend(*reference, unsloth_installed=True, requested="hf").name == "hf"
    cpu = stack.backend([], None, "13.0", unsloth_installed=False)
    assert cpu.ok and cpu.label() == "hf (CPU, gloo)"
    assert stack.backend([], None, "13.0", False, "unsloth").problem == "no gpu"
    old = stack.backend(["8.9"], OLD_DRIVER, "13.0", unsloth_installed=True)
    assert (old.name, old.device, old.problem) == ("hf", "cpu", "driver") and "580.65.06" in old.why
    pascal = stack.backend(["6.1"], "580.173.02", "13.0", unsloth_installed=True)
    assert pascal.problem == "arch" and "6.1" in pascal.why and "sm_75" in pascal.why
    assert stack.backend(["8.6"], "580.173.02", "13.0", False, "unsloth").problem == "no unsloth"


def _check_driver(driver: str, *lock: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "ugro.stack.cuda", "check-driver", "--driver", driver, *lock],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_driver_refuses_an_old_driver_naming_both_versions_and_the_fix() -> None:
    refused = _check_driver(OLD_DRIVER, "--lock", "requirements/locks/py3.12/node.txt")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    message = refused.stdout
    assert f"nvidia_driver_version {OLD_DRIVER} is older than the 580.65.06 that CUDA 13.0 needs" in message
    assert "torch 2.13.0" in message and "13.0.96" in message and "requirements/locks/py3.12/node.txt" in message
    assert f'Fix: set nvidia_driver_version: "{stack.pinned_driver()}"' in message
    passed = _check_driver(stack.pinned_driver())
    assert passed.returncode == 0 and "runs CUDA 13.0" in passed.stdout, passed.stdout + passed.stderr
    bad = _check_driver("580.x")
    assert bad.returncode == 2 and "not a version" in bad.stderr and "Traceback" not in bad.stderr


def test_make_provision_refuses_an_old_driver_before_touching_a_host(tmp_path: Path, ansible_playbook: Run) -> None:
    """The real playbook, two hosts (local connections): both stop at the check, before any role runs."""
    hosts = {
        name: {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
            "ugro_cluster_address": "127.0.0.1",
        }
        for name in ("node-a", "node-b")
    }
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"children": {"ugro_cluster": {"hosts": hosts, "vars": {"nvidia_driver_version": OLD_DRIVER}}}}}
        )
    )
    done = ansible_playbook(inventory, "playbooks/provision.yml")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    tasks = re.findall(r"^TASK \[(.*?)\]", out, re.M)
    assert tasks[-1] == "nvidia_driver : Refuse a driver pin older than the lock's CUDA runtime needs.", tasks
    assert not [t for t in tasks if t.startswith(("ugro :", "cluster_network", "firewall"))], tasks
    assert re.search(r"node-a\s*:\s*ok=\d+\s+changed=0\s+unreachable=0\s+failed=1", out), out[-2000:]
    assert re.search(r"node-b\s*:\s*ok=\d+\s+changed=0\s+unreachable=0\s+failed=1", out), out[-2000:]
    flat = " ".join(out.split())
    assert f"nvidia_driver_version {OLD_DRIVER} is older than the 580.65.06 that CUDA 13.0 needs" in flat, out


def test_docs_state_the_versions_the_locks_pin() -> None:
    text = (REPO / "docs" / "stack.md").read_text()
    node = stack.lock_pins(locks.LOCKS / "py3.12" / "node.txt")
    gpu = stack.lock_pins(locks.LOCKS / "py3.12" / "gpu.txt")
    for name, version in [
        ("torch", node["torch"]),
        ("nvidia-cuda-runtime", node["nvidia-cuda-runtime"]),
        ("triton", node["triton"]),
        ("bitsandbytes", node["bitsandbytes"]),
        ("nvidia-nccl-cu13", node["nvidia-nccl-cu13"]),
        ("unsloth", gpu["unsloth"]),
        ("unsloth-zoo", gpu["unsloth-zoo"]),
        ("nvidia_driver_version", stack.pinned_driver()),
        ("cuda_toolkit_version", _role_default("cuda_toolkit", "cuda_toolkit_version")),
        ("minimum driver", stack.min_driver("13.0")),
    ]:
        assert re.search(rf"\| `?{re.escape(name)}`? .*\| `?{re.escape(version)}`? ", text), (name, version)


def test_validate_says_which_backend_the_job_runs_where() -> None:
    done = subprocess.run(
        [PYTHON, "-m", "ugro.cli", "validate", "--job", "jobs/default.yaml"],
        cwd=REPO,
        env=run_env() | {"COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("backend: "))
    assert "model.backend 'auto': unsloth on a host with unsloth installed" in line, line
    assert ">= 580.65.06 for CUDA 13.0" in line and "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120" in line, line
    assert "transformers + peft (hf) elsewhere, on CPU with gloo" in line, line
    assert "unsloth': every host needs" in stack.policy("unsloth", "13.0")
    assert stack.policy("hf", "13.0").startswith("model.backend 'hf': transformers + peft on every host")
