"""No member by accident: another account on a member host becomes neither root nor a rank (docs/security.md).

On the session's test cluster (tests/conftest.py ``testbed``: the hosts Ansible logs in to as root, their exporters
installed by the real provisioning playbook), tb1 gets a second account with useradd, an intruder outside the cluster.

- It creates, as after a reboot, the directories in /tmp where Ansible used to upload what root then unpacks and runs
  (``remote_tmp``); the real provisioning of those hosts (``playbooks/provision.yml --tags exporter``) runs with
  ``ANSIBLE_KEEP_REMOTE_FILES`` so that every upload stays where it landed: all are under root's own home, where the
  intruder can neither create nor write anything, and its directories stay empty.
- It tries to write a ``sitecustomize.py`` and a ``usercustomize.py`` where a rank could import them (the code
  directory, the venv) and cannot; root plants both in the code directory anyway, and a rank started by the real
  launch (``playbooks/train.yml``, its code sync, launch script and torchrun; the rank module a light one of the
  code, ``train.digest``, as torchrun starts ranks on a GPU host: ``python -m`` in a new interpreter) imports neither,
  and neither does the launcher that forks the ranks on a CPU host.

The ownership of a provisioned host's code directory, venv and wheelhouse (root's, the job user's group, sticky) is
molecule/python_env's (tests/test_owners.py there).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, Run

from testbed import cluster as testbed_cluster
from ugro.hosts import codesync

HOST = "tb1"
INTRUDER = "ugro-intruder"
# What the planted files do when imported: leave a mark naming the process that imported them.
PLANTED = "import os, sys\nopen('/tmp/ugro-planted-%d' % os.getpid(), 'w').write(' '.join(sys.orig_argv))\n"


def _ssh(bed: testbed_cluster.Testbed, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(bed.ssh_config), HOST, command], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def _as_intruder(command: str) -> str:
    return f"setpriv --reuid={INTRUDER} --regid={INTRUDER} --init-groups -- sh -c {shlex.quote(command)}"


@pytest.fixture(scope="module")
def intruder(testbed: testbed_cluster.Testbed) -> Iterator[testbed_cluster.Testbed]:
    """The session's test cluster with a second account on tb1 (no home: /home is this machine's), removed after."""
    made = _ssh(testbed, f"useradd -M -U -s /bin/sh {INTRUDER}")
    assert made.returncode == 0, made.stderr
    try:
        yield testbed
    finally:
        _ssh(testbed, f"userdel {INTRUDER}")


def test_provisioning_uploads_where_no_other_account_can_write(
    intruder: testbed_cluster.Testbed, ansible_playbook: Run
) -> None:
    bed = intruder
    # After a reboot /tmp is empty: the intruder creates first the names Ansible uploaded to ($USER is root's).
    planted = ["/tmp/.ansible-root", "/tmp/.ansible-0"]
    _ssh(bed, "rm -rf " + " ".join(planted))
    made = _ssh(bed, _as_intruder("mkdir -m 0777 " + " ".join(planted)))
    assert made.returncode == 0, made.stderr
    kept = "find /tmp /root -type d -name 'ansible-tmp-*' -prune -print"
    try:
        proc = ansible_playbook(Path(bed.inventory), "playbooks/provision.yml", "--tags", "exporter", "--limit", HOST,
                                "-e", "exporter_state=started", env={"ANSIBLE_KEEP_REMOTE_FILES": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        uploads = _ssh(bed, kept).stdout.split()
        assert uploads, "provisioning uploaded nothing: the test proves nothing"
        assert all(path.startswith("/root/.ansible/tmp/ansible-tmp-") for path in uploads), uploads
        assert _ssh(bed, "find " + " ".join(planted) + " -mindepth 1").stdout == ""
        owners = _ssh(bed, "stat -c '%U %a %n' /root /root/.ansible /root/.ansible/tmp").stdout.splitlines()
        assert owners == ["root 700 /root", "root 700 /root/.ansible", "root 700 /root/.ansible/tmp"], owners
        for attempt in ("touch /root/.ansible/tmp/swap", f"mv {uploads[0]} /root/.ansible/tmp/moved", "ls /root"):
            assert _ssh(bed, _as_intruder(attempt)).returncode != 0, attempt
    finally:
        _ssh(bed, f"{kept} | xargs -r rm -rf; rm -rf " + " ".join(planted))


def test_no_other_account_plants_what_a_rank_imports(
    intruder: testbed_cluster.Testbed, cluster: Path, ansible_playbook: Run, tmp_path: Path
) -> None:
    bed = intruder
    site = sysconfig.get_paths()["purelib"]  # the venv the test hosts' ranks run (this checkout's)
    code = "/opt/ugro"
    targets = [f"{code}/sitecustomize.py", f"{code}/usercustomize.py", f"{site}/sitecustomize.py"]
    for target in [*targets, f"{code}/train/__init__.py"]:
        tried = _ssh(bed, _as_intruder(f"echo 'import os' >> {target}"))
        assert tried.returncode != 0, f"{INTRUDER} wrote {target}"
    # root plants both anyway: a rank started as the launch starts it imports neither.
    plant = f"printf %s {shlex.quote(PLANTED)} | tee {targets[0]} > {targets[1]}; rm -f /tmp/ugro-planted-*"
    assert _ssh(bed, plant).returncode == 0
    archive = tmp_path / "code.tar.gz"
    job_id = f"planted-{os.getpid()}"
    extra = {
        "ugro_job_id": job_id,
        "ugro_job_file": "jobs/default.yaml",
        "ugro_resume": "none",
        "ugro_main_host": HOST,
        "ugro_code_archive": str(archive),
        "ugro_code_hash": codesync.pack(REPO, archive),
        "ugro_job_timeout_s": 300,
        "train_launch_module": "train.digest",  # a rank of the code that imports nothing heavy and exits
    }
    try:
        proc = ansible_playbook(cluster, "playbooks/train.yml", "--limit", HOST, "-e", json.dumps(extra))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        log = _ssh(bed, f"cat {code}/runs/{job_id}/hosts/{HOST}/torchrun.log").stdout
        assert "train.digest" in log and "launch script exits with 0" in log, log[-3000:]
        marks = _ssh(bed, "cat /tmp/ugro-planted-* 2>/dev/null").stdout
        assert marks == "", f"imported the planted files: {marks}"
    finally:
        _ssh(bed, f"rm -f {targets[0]} {targets[1]} /tmp/ugro-planted-*")
