"""Role python_env on each host: files with owners by design. root's venv and wheelhouse are root's alone; the code
directory is root's, its group the job user's (ugro-job on tb2, root on tb1), sticky; runs/, data/, jobs/ and models/
are the job user's. A second account (ugro-intruder, prepare.yml) can write nothing that a rank imports or root runs;
the job user writes its code beside the venv and the wheelhouse but can neither change nor move them.

A file of another account's left in the venv, which the next run empties and rebuilds without running it, is
verify.yml's.
"""

from __future__ import annotations

import shlex
from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

CODE = "/opt/ugro"
VENV = f"{CODE}/.venv"
WHEELHOUSE = f"{CODE}/wheelhouse"
SITE = f"{VENV}/lib/python3.11/site-packages"
INTRUDER = "ugro-intruder"
# Anything in root's trees that is not root's, or that an account other than root may write (but uv's lock file in
# the venv, 0666 by uv's design: empty, nothing reads or runs it).
NOT_ROOTS_ALONE = (
    rf"\( -path {VENV}/.lock -type f -uid 0 \) -prune -o"
    r" \( ! -uid 0 -o \( ! -type l \( -perm -0002 -o \( -perm -0020 ! -gid 0 \) \) \) \) -print"
)


def _job_user(host: Any) -> str:
    return "ugro-job" if host.backend.get_hostname() == "tb2" else "root"


def _as(user: str, command: str) -> str:
    return f"setpriv --reuid={user} --regid={user} --init-groups -- sh -c {shlex.quote(command)}"


def test_the_code_directory_is_roots_the_job_users_group_writes_it_sticky(host: Any) -> None:
    code = host.file(CODE)
    user = _job_user(host)
    assert (code.user, code.group, code.mode) == ("root", user, 0o755 if user == "root" else 0o1775)


def test_runs_data_jobs_and_models_are_the_job_users(host: Any) -> None:
    user = _job_user(host)
    for name, mode in (("runs", 0o755), ("data", 0o750), ("jobs", 0o750), ("models", 0o750)):
        entry = host.file(f"{CODE}/{name}")
        assert (entry.is_directory, entry.user, entry.group, entry.mode) == (True, user, user, mode), name


def test_the_venv_and_the_wheelhouse_are_roots_alone(host: Any) -> None:
    for tree in (VENV, WHEELHOUSE):
        top = host.file(tree)
        assert (top.is_directory, top.user, top.group, top.mode) == (True, "root", "root", 0o755), tree
    assert host.check_output(f"find {VENV} {WHEELHOUSE} {NOT_ROOTS_ALONE}") == ""


def test_another_account_writes_nothing_a_rank_imports_or_root_runs(host: Any) -> None:
    attempts = [
        f"echo 'import os' > {CODE}/sitecustomize.py",
        f"echo 'import os' > {CODE}/usercustomize.py",
        f"echo 'import os' > {SITE}/sitecustomize.py",
        f"echo 'import os' >> {VENV}/bin/python3",
        f"echo '#!/bin/sh' >> {WHEELHOUSE}/base/uv",
        f"mv {VENV} {CODE}/venv-moved",
        f"mv {WHEELHOUSE} {CODE}/wheelhouse-moved",
        f"mkdir {CODE}/train",
        f"ls {CODE}/jobs",  # the job user's job files, data and models are not the intruder's to read
    ]
    for attempt in attempts:
        assert host.run(_as(INTRUDER, attempt)).rc != 0, attempt
    for planted in (f"{CODE}/sitecustomize.py", f"{CODE}/usercustomize.py", f"{SITE}/sitecustomize.py"):
        assert not host.file(planted).exists, planted


def test_the_job_user_writes_its_code_beside_roots_trees_but_cannot_change_or_move_them(host: Any) -> None:
    user = _job_user(host)
    if user == "root":
        return  # tb1: the job runs as root, to whom nothing is out of reach
    made = host.run(_as(user, f"mkdir {CODE}/probe && echo ok > {CODE}/probe/file && mv {CODE}/probe {CODE}/probe2"))
    assert made.rc == 0, made.stderr
    assert host.run(_as(user, f"rm -r {CODE}/probe2")).rc == 0
    for attempt in (
        f"mv {VENV} {CODE}/venv-moved",
        f"rm -rf {WHEELHOUSE}",
        f"touch {VENV}/bin/planted",
        f"echo '#!/bin/sh' >> {WHEELHOUSE}/base/uv",
        f"echo 'import os' > {SITE}/sitecustomize.py",
    ):
        assert host.run(_as(user, attempt)).rc != 0, attempt
    assert host.file(f"{WHEELHOUSE}/base/uv").user == "root"
    assert host.check_output(f"find {VENV} {WHEELHOUSE} {NOT_ROOTS_ALONE}") == ""
