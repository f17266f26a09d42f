"""The run's key: made once per run on the controller, written into a host's run directory readable by its owner
only and never through a link planted there, read by the ranks; without a controller the first rank to need it makes
it, and every process of the run directory gets the same one."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

from train.recovery import jobkey
from ugro.module_utils import ugro_jobkey


def test_the_controllers_key_is_made_once_and_written_for_the_owner_only(tmp_path: Path) -> None:
    controller, host = tmp_path / "controller" / "job-1", tmp_path / "host" / "job-1"
    key = ugro_jobkey.controller_key(controller)
    assert ugro_jobkey.controller_key(controller) == key and len(bytes.fromhex(key)) == jobkey.KEY_BYTES
    assert stat.S_IMODE((controller / "job.key").stat().st_mode) == 0o600
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    host.mkdir(parents=True)
    (host / "job.key").symlink_to(victim)  # planted by whoever could write the run directory
    assert ugro_jobkey.write(host, key) is True
    assert victim.read_text() == "root's file\n" and not (host / "job.key").is_symlink()
    assert stat.S_IMODE((host / "job.key").stat().st_mode) == 0o600
    assert jobkey.read(host) == bytes.fromhex(key)
    assert ugro_jobkey.write(host, key) is False  # the same key again: nothing changes


def _ensure(run_dir: Path, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(jobkey.ensure(run_dir).hex())


def test_ranks_without_a_controller_make_one_key_for_the_run(tmp_path: Path) -> None:
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    procs = [multiprocessing.Process(target=_ensure, args=(tmp_path, queue)) for _ in range(4)]
    for proc in procs:
        proc.start()
    keys = {queue.get(timeout=30) for _ in procs}
    for proc in procs:
        proc.join(timeout=30)
    assert len(keys) == 1 and jobkey.read(tmp_path) == bytes.fromhex(keys.pop())
    assert [p.name for p in tmp_path.iterdir()] == ["job.key"]  # no partial file left behind


def test_a_proof_holds_for_its_fields_and_key_only() -> None:
    key, other = bytes(range(32)), bytes(32)
    fields = {"host": "h2", "ranks": 1}
    proof = jobkey.proof(key, fields)
    assert jobkey.proves(key, {"ranks": 1, "host": "h2"}, proof)  # key order does not matter
    assert not jobkey.proves(other, fields, proof) and not jobkey.proves(key, fields | {"ranks": 2}, proof)
    assert not jobkey.proves(key, fields, None)
