"""Role python_env on each host: the venv holds exactly the lock files' packages (the GPU lock's only on tb2),
read by the venv's own Python; the wheelhouses hold their wheels and the pinned uv; no route out.

A package removed by hand put back, and a Python without a lock refused, are verify.yml's
(molecule/conftest.py runs it last): they apply the role again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

testinfra_hosts = ["ansible://ugro_cluster"]

VENV = "/opt/ugro/.venv"
WHEELHOUSE = "/opt/ugro/wheelhouse"
LOCKS = Path(__file__).resolve().parent.parent / "locks" / "py3.11"
PIN = re.compile(r"(?m)^[A-Za-z0-9][^ =]*==[^ ]+")
# The venv's own Python lists what it holds (importlib.metadata), independently of uv.
LIST = (
    "import importlib.metadata as m; print('\\n'.join(sorted(d.metadata['Name'].lower().replace('_', '-')"
    " + '==' + d.version for d in m.distributions())))"
)


def _gpu(host: Any) -> bool:
    return bool(host.backend.get_hostname() == "tb2")


def _expected(gpu: bool) -> list[str]:
    locks = [LOCKS / "node.txt", *([LOCKS / "gpu.txt"] if gpu else [])]
    return sorted(pin.lower().replace("_", "-") for lock in locks for pin in PIN.findall(lock.read_text()))


def _uv() -> str:
    return next(pin for pin in _expected(False) if pin.startswith("uv==")).removeprefix("uv==")


def test_the_venv_holds_exactly_the_locks(host: Any) -> None:
    assert host.check_output(f'{VENV}/bin/python -c "{LIST}"').splitlines() == _expected(_gpu(host))


def test_the_wheelhouses_hold_their_wheels_and_uv(host: Any) -> None:
    names = sorted(
        line.removeprefix(WHEELHOUSE + "/") for line in host.check_output(f"find {WHEELHOUSE} -type f").splitlines()
    )
    base = [
        n
        for n in names
        if re.match(rf"^base/(idna-3.20|six-1.17.0|typing_extensions-4.16.0|uv-{re.escape(_uv())})-", n)
    ]
    gpu = [n for n in names if re.match(r"^gpu/(mdurl-0.1.2|typing_inspection-0.4.5)-", n)]
    assert len(base) == 4, names
    assert (len(gpu) == 2) == _gpu(host), names
    assert len([n for n in names if n.endswith(".whl")]) == (6 if _gpu(host) else 4), names
    assert "base/uv" in names


def test_both_uvs_are_the_locks(host: Any) -> None:
    for uv in (f"{WHEELHOUSE}/base/uv", f"{VENV}/bin/uv"):
        assert host.check_output(f"{uv} --version").split()[1] == _uv()


def test_the_host_has_no_route_out(host: Any) -> None:
    # uv installed offline from the wheelhouse: a route out would make the test prove nothing.
    assert host.run("ip route get 151.101.0.223").rc != 0


# Every module of the venv with no bytecode beside it (its __pycache__ entry for the venv's own Python).
UNCOMPILED = (
    "import importlib.util as u, pathlib, sysconfig; site = pathlib.Path(sysconfig.get_paths()['purelib']);"
    " print('\\n'.join(str(p) for p in site.rglob('*.py') if not pathlib.Path(u.cache_from_source(str(p))).is_file()))"
)


def test_every_module_is_compiled_for_a_job_user_who_cannot_write_the_venv(host: Any) -> None:
    # The venv is root's; a job runs as the login user, who cannot write __pycache__ there and would compile every
    # module it imports at each start.
    assert host.check_output(f'{VENV}/bin/python -c "{UNCOMPILED}"').strip() == ""
    assert int(host.check_output(f"find {VENV}/lib -name '*.pyc' | wc -l")) > 0
