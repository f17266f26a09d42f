"""The driver packages role nvidia_driver installs, as its vars name them: NVIDIA's compute-only set on Ubuntu, whose
names lose the branch from 590 on (NVIDIA's renaming), and Canonical's signed modules for the running kernel and its
flavour where Secure Boot is on."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import REPO, ansible_playbook

PLAY = """
- name: The role's package names.
  hosts: localhost
  gather_facts: false
  vars:
    ansible_facts: {distribution: "{{ distribution }}"}
    __nvidia_driver_before: {ansible_facts: {ugro_host: {kernel: {running: 6.8.0-51-generic}}}}
  tasks:
    - name: Load the role's vars.
      ansible.builtin.include_vars:
        file: "%s/roles/nvidia_driver/vars/main.yml"
    - name: Print the names.
      ansible.builtin.debug:
        msg: "{{ {'default': __nvidia_driver_default_packages, 'signed': __nvidia_driver_signed_packages,
          'modules': __nvidia_driver_signed_modules} }}"
"""


def _names(tmp_path: Path, distribution: str, version: str, open_modules: bool = True) -> dict[str, list[str]]:
    (tmp_path / "play.yml").write_text(PLAY % REPO)
    (tmp_path / "inventory").write_text("localhost ansible_connection=local\n")
    extra = {"distribution": distribution, "nvidia_driver_version": version, "nvidia_driver_open_modules": open_modules}
    run = ansible_playbook(tmp_path / "inventory", tmp_path / "play.yml", "-e", json.dumps(extra),
                           env={"ANSIBLE_CALLBACK_RESULT_FORMAT": "json"})  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    printed = re.findall(r"(?ms)^ok: \[localhost\] => (\{.*?^\})", run.stdout)[-1]  # the last task's result
    names: dict[str, list[str]] = json.loads(printed)["msg"]
    return names


def test_ubuntu_gets_the_compute_only_set_named_for_its_branch_until_590(tmp_path: Path) -> None:
    assert _names(tmp_path, "Ubuntu", "580.173.02")["default"] == [
        "libnvidia-compute-580", "nvidia-dkms-580-open", "nvidia-utils-580"]  # fmt: skip
    assert _names(tmp_path, "Ubuntu", "595.71.05")["default"] == [
        "libnvidia-compute",
        "nvidia-dkms-open",
        "nvidia-utils",
    ]
    assert _names(tmp_path, "Debian", "580.173.02", open_modules=False)["default"] == [
        "nvidia-kernel-dkms", "nvidia-driver-cuda", "nvidia-smi"]  # fmt: skip


def test_secure_boot_on_ubuntu_takes_the_signed_modules_of_the_running_kernel_and_its_flavour(tmp_path: Path) -> None:
    names = _names(tmp_path, "Ubuntu", "580.173.02")
    assert names["modules"] == [
        "linux-modules-nvidia-580-open-6.8.0-51-generic",
        "linux-modules-nvidia-580-open-generic",
    ]
    assert names["signed"] == ["nvidia-headless-no-dkms-580-open", "nvidia-utils-580"]
