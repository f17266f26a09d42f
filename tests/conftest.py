"""Fixtures, and the tiers: every test is marked by what it uses, from the fixtures it requests.

A test that runs something real requests it as a fixture (the helpers themselves are in helpers.py):

    testbed, netns          the test cluster (root, network namespaces)        -> cluster
    torchrun, torchrun_cmd  torchrun and train/ for real                        -> torchrun
    spawn                   ranks spawned with torch.distributed                -> torchrun
    ugro                    the CLI on a command that runs playbooks            -> ansible
    ugro_train              the CLI's `train`: playbooks and ranks              -> ansible, torchrun
    make                    the README's `make` lines: playbooks and ranks     -> ansible, torchrun
    ansible_module          a host module through the real `ansible`            -> ansible
    ansible_playbook        the real `ansible-playbook`                         -> ansible
    slurm_cluster           Debian's SLURM daemons, whose jobs run torchrun      -> slurm, torchrun
    registry                the package registry over the network (~1 min)      -> slow

A fixture built on one of these counts as it (item.fixturenames is the whole closure): `cluster` and
`unbroken_run` need `testbed`, so a test of either is a `cluster` test. `make test-fast` runs the tests
with none of the markers.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import helpers
import pytest
from helpers import (
    RUNS_ENV,
    SESSION_SUBNET,
    cli,
    cluster_job,
    newest_run,
    remove_runs,
    run_module,
    unavailable,
    why_no_testbed,
)

from testbed import cluster as testbed_cluster

REPO = Path(__file__).resolve().parent.parent

# Fixture -> the markers of every test that requests it (directly or through another fixture).
USES: dict[str, tuple[str, ...]] = {
    "testbed": ("cluster",),
    "netns": ("cluster",),
    "torchrun": ("torchrun",),
    "torchrun_cmd": ("torchrun",),
    "spawn": ("torchrun",),
    "ugro": ("ansible",),
    "ugro_train": ("ansible", "torchrun"),
    "make": ("ansible", "torchrun"),
    "ansible_module": ("ansible",),
    "ansible_playbook": ("ansible",),
    "slurm_cluster": ("slurm", "torchrun"),
    "registry": ("slow",),
}


# `make test` runs pytest processes side by side (tools/pytest-pair): the `cluster` tests, and the others. These
# files' tests run with the cluster's, so that both processes take about as long (docs/results.md "CI time"). Whole
# files, so that a module's fixtures are built once; only tests whose ranks take a free port (torchrun, spawn),
# never `make train`'s default port 29500 on this machine, which the other process's tests use.
WITH_CLUSTER = frozenset({"test_real_model.py", "test_datasets.py", "test_fault_equivalence.py"})
# These files' tests mostly wait (a collective timeout, a stalled peer, the package registry over the network: each
# took under half a core over its time), so `make test` runs them in a third pytest process beside the two: waited
# out in the others' process, that time was the suite's. Their ranks take free ports too.
WAITS = frozenset({"test_locks.py", "test_failure_records.py", "test_nccl_like.py", "test_heartbeat.py",
                   "test_gloo_hook.py"})  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for marker in sorted({m for fixture, marks in USES.items() if fixture in names for m in marks}):
            item.add_marker(marker)
        if item.path.name in WITH_CLUSTER:
            item.add_marker("with_cluster")
        if item.path.name in WAITS:
            item.add_marker("waits")


WHY_NOT = why_no_testbed()


@pytest.fixture(scope="session", autouse=True)
def _runs_in_a_temporary_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The controller's runs (UGRO_RUNS_DIR) go to the session's temporary directory, never the repository's."""
    runs = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUNS_ENV, str(runs))
        yield runs


@pytest.fixture(scope="session", autouse=True)
def _ranks_fail_where_nccl_would() -> Iterator[None]:
    """Every rank a test starts on this machine (spawned, torchrun, `make train` on localhost) runs its default group
    on the backend that behaves as NCCL does (train/dist/nccl_like.py: results land at ``work.wait()``, sends wait for
    their receive, a lost peer hangs until an abort), and under the device checker (train/dist/devicecheck.py): a
    collective given a tensor NCCL would not carry fails the test. The test cluster's ranks get the first from their
    hosts' env file (testbed/cluster.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UGRO_NCCL_LIKE", os.environ.get("UGRO_NCCL_LIKE", "1"))  # =0 to run on plain gloo
        patch.setenv("UGRO_CHECK_DEVICES", os.environ.get("UGRO_CHECK_DEVICES", "1"))  # =0 to run without it
        yield


# The tests whose ranks run plain gloo on purpose, by the top directory of their temporary files: what CPU hosts run,
# where that is what the test is of (docs/recovery.md).
PLAIN_GLOO = {"stack": "tests/test_node_stack.py: the provisioned stack's hosts run what make provision leaves"}
RECORD_BYTES = 1 << 20  # a run's run.json is a few KB


@pytest.fixture(scope="session", autouse=True)
def _every_run_recorded_the_nccl_like_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the session: every multi-rank run the tests started recorded the NCCL-like backend as what carried its
    collectives (run.json ``collectives``, written by the main rank), but for PLAIN_GLOO's: the environment variable
    only asks for it, and a run started somewhere it did not reach would have passed on gloo's kinder rules."""
    yield
    if os.environ.get("UGRO_NCCL_LIKE", "1") != "1":
        return
    base = tmp_path_factory.getbasetemp()
    odd: list[str] = []
    for path in base.rglob("run.json"):
        try:  # a regular file, never a link: tests plant run.json -> /dev/zero (tests/test_host_facts.py)
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_size > RECORD_BYTES:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        top = path.relative_to(base).parts[0].rstrip("0123456789")
        ran = data.get("collectives") if isinstance(data, dict) else None
        several = isinstance(data, dict) and int(data.get("world_size") or 1) > 1
        if ran is not None and ran != "ugro_nccl_like" and several and top not in PLAIN_GLOO:
            odd.append(f"{path}: {ran}")
    assert not odd, "multi-rank runs that did not run the NCCL-like backend:\n" + "\n".join(odd)


@pytest.fixture(scope="session")
def repo_jobs() -> Iterator[Path]:
    """A directory for the session's job files inside jobs/ (the code archive ships jobs/ to the hosts), ignored by
    git through its own .gitignore and removed at the end."""
    directory = REPO / "jobs" / f".pytest-{os.getpid()}"
    directory.mkdir()
    (directory / ".gitignore").write_text("*\n")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


# --------------------------------------------------------------------------------------------------
# What a test uses for real: each fixture hands over the helper of the same name (helpers.py).


@pytest.fixture(scope="session")
def torchrun() -> Callable[..., subprocess.CompletedProcess[str]]:
    return helpers.torchrun


@pytest.fixture(scope="session")
def torchrun_cmd() -> Callable[..., list[str]]:
    return helpers.torchrun_cmd


@pytest.fixture(scope="session")
def spawn() -> Callable[..., None]:
    return helpers.spawn


@pytest.fixture(scope="session")
def ugro() -> Callable[..., subprocess.CompletedProcess[str]]:
    return cli


@pytest.fixture(scope="session")
def ugro_train() -> Callable[..., subprocess.CompletedProcess[str]]:
    return cli


@pytest.fixture(scope="session")
def make() -> Callable[..., subprocess.CompletedProcess[str]]:
    return helpers.make


@pytest.fixture(scope="session")
def ansible_module() -> Callable[..., dict[str, Any]]:
    return run_module


@pytest.fixture(scope="session")
def ansible_playbook() -> Callable[..., subprocess.CompletedProcess[str]]:
    return helpers.ansible_playbook


@pytest.fixture(scope="session")
def registry() -> None:
    """The test asks the package registry over the network (about a minute)."""


# --------------------------------------------------------------------------------------------------
# The test cluster.


@pytest.fixture(scope="session")
def netns() -> ModuleType:
    """Root and network namespaces, for tests that build test hosts of their own: the testbed's module."""
    if WHY_NOT is not None:
        unavailable(WHY_NOT)
    return testbed_cluster


@pytest.fixture(scope="session")
def testbed(netns: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[testbed_cluster.Testbed]:
    """A 3-host test cluster (tb1..tb3 on eth0/enp5s0/ens3), up for the session and down afterwards."""
    directory = tmp_path_factory.mktemp("testbed")
    # Every SSH session there, so every rank the plays launch, runs the backend that behaves as NCCL does.
    nccl_like = {"UGRO_NCCL_LIKE": os.environ.get("UGRO_NCCL_LIKE", "1")}
    bed = testbed_cluster.up(directory, hosts=3, subnet=SESSION_SUBNET, session_env=nccl_like)
    try:
        # The exporters, as `make provision` leaves a cluster: the controller that follows a job reads its state
        # from them over HTTP, where a host without one costs a status playbook every poll (~2.5 CPU-s;
        # docs/results.md "CI time"). tests/test_monitoring.py stops one to see the poll turn to Ansible.
        helpers.start_exporters(Path(bed.inventory))
        yield bed
    finally:
        testbed_cluster.down(directory)


@pytest.fixture(scope="session")
def cluster(testbed: testbed_cluster.Testbed) -> Path:
    """The test cluster's inventory, one CPU process per host (3 ranks on this 2-core machine)."""
    return testbed_cluster.one_rank_per_host(testbed, Path(testbed.inventory).parent / "cluster.yml")


@pytest.fixture(scope="session")
def unbroken_run(
    cluster: Path, repo_jobs: Path, ugro_train: Callable[..., subprocess.CompletedProcess[str]]
) -> Iterator[tuple[Path, subprocess.CompletedProcess[str]]]:
    """The cluster job once across the 3 test hosts, without faults: (its run directory, the CLI's result)."""
    path = cluster_job(repo_jobs, "cluster-test")
    try:
        result = ugro_train("train", "--job", str(path), "--inventory", str(cluster), "--poll", "2")
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        yield newest_run("cluster-test"), result
    finally:
        remove_runs("cluster-test")
