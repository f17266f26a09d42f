"""The code sync's one task, the host module ugro_code_tree with its action plugin, run for real through `ansible`.

What a user relies on: a host gets exactly the controller's code where its own differs (a fresh host, a hand
edit), a host that already has it is sent nothing, an archive that would write outside the code directory is
refused, and a hash that does not match fails naming the host.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from helpers import run_module

from ugro.hosts import codesync

REPO = Path(__file__).resolve().parent.parent
HOST = "node4070"
LANDING = ".ugro-code.tar.gz"

pytestmark = pytest.mark.usefixtures("ansible_module")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    archive = tmp_path_factory.mktemp("control") / "code.tar.gz"
    return archive, codesync.pack(REPO, archive)


def _sync(dest: Path, archive: Path, expected: str, known: str | None = None) -> dict[str, object]:
    args = {"path": str(dest), "host": HOST, "src": str(archive), "expected": expected}
    return run_module("ugro_code_tree", args | ({"known": known} if known else {}))


def test_a_fresh_host_gets_the_controllers_code_and_a_second_sync_sends_nothing(
    tmp_path: Path, packed: tuple[Path, str]
) -> None:
    archive, code_hash = packed
    dest = tmp_path / "opt" / "ugro"  # not there yet
    first = _sync(dest, archive, code_hash)
    assert first["changed"] and not first["failed"], first.get("msg")
    assert first["hash"] == code_hash
    assert (dest / "train" / "worker.py").read_bytes() == (REPO / "train" / "worker.py").read_bytes()
    assert not (dest / LANDING).exists()

    second = _sync(dest, archive, code_hash)
    assert not second["changed"] and not second["failed"] and second["hash"] == code_hash
    assert "landing" not in second  # the archive was not sent again


def test_a_job_file_removed_while_packing_leaves_an_archive_the_host_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another command (a second job, a test session beside this one) removes its job file between the walk and
    # the read: the archive, its manifest and the hash are the tree without it, and the host verifies it.
    walked = [*codesync.code_files(REPO), "jobs/.removed-while-packing.yaml"]
    monkeypatch.setattr(codesync, "code_files", lambda root: walked)
    archive = tmp_path / "control" / "code.tar.gz"
    code_hash = codesync.pack(REPO, archive)
    result = _sync(tmp_path / "opt" / "ugro", archive, code_hash)
    assert result["changed"] and not result["failed"] and result["hash"] == code_hash, result.get("msg")
    assert not (tmp_path / "opt" / "ugro" / "jobs" / ".removed-while-packing.yaml").exists()


def test_a_hash_the_fast_checks_just_read_spares_the_round_trip_only_where_it_is_the_controllers(
    tmp_path: Path, packed: tuple[Path, str]
) -> None:
    """make train's fast checks read every host's code hash just before the launch (code_sync_known_hash)."""
    archive, code_hash = packed
    dest = tmp_path / "ugro"  # not there: a host asked anything would have to create it
    spared = _sync(dest, archive, code_hash, known=code_hash)
    assert not spared["changed"] and not spared["failed"] and spared["hash"] == code_hash
    assert not dest.exists()
    synced = _sync(dest, archive, code_hash, known="0" * 64)  # the host had other code: it gets the controller's
    assert synced["changed"] and synced["hash"] == code_hash
    assert (dest / "train" / "worker.py").read_bytes() == (REPO / "train" / "worker.py").read_bytes()


def test_a_hand_edit_on_the_host_is_put_back(tmp_path: Path, packed: tuple[Path, str]) -> None:
    archive, code_hash = packed
    dest = tmp_path / "ugro"
    assert not _sync(dest, archive, code_hash)["failed"]
    worker = dest / "train" / "worker.py"
    worker.write_text(worker.read_text() + "# edited on the node\n")
    again = _sync(dest, archive, code_hash)
    assert again["changed"] and again["hash"] == code_hash
    assert worker.read_bytes() == (REPO / "train" / "worker.py").read_bytes()


def test_a_hash_that_is_not_the_codes_fails_naming_the_host(tmp_path: Path, packed: tuple[Path, str]) -> None:
    archive, _ = packed
    result = _sync(tmp_path / "ugro", archive, "0" * 64)
    assert result["failed"]
    assert str(result["msg"]).startswith(f"{HOST}: the training code in {tmp_path / 'ugro'} is not the controller's")
    assert "differs from the controller's 000000000000" in str(result["msg"])


def test_an_archive_that_writes_outside_the_code_directory_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        payload = b"owned\n"
        info = tarfile.TarInfo("../outside.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    dest = tmp_path / "code"
    result = _sync(dest, archive, "1" * 64)
    assert result["failed"]
    assert str(result["msg"]).startswith(f"{HOST}: cannot unpack the training code into {dest}")
    assert "../outside.txt" in str(result["msg"])
    assert not (tmp_path / "outside.txt").exists() and not (dest / LANDING).exists()


def test_a_missing_archive_on_the_controller_is_named(tmp_path: Path) -> None:
    result = _sync(tmp_path / "ugro", tmp_path / "nowhere.tar.gz", "1" * 64)
    assert result["failed"] and f"the code archive {tmp_path / 'nowhere.tar.gz'} does not exist" in str(result["msg"])
