"""Checkpoints: atomic, verified, keep-last-K, and a torn one is never loaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, small_job

from train.config import JobConfig
from train.model.load import load_model
from train.recovery import checkpoint
from train.schedule import warmup_cosine
from ugro.module_utils import ugro_checkpoints


@pytest.fixture()
def parts() -> tuple[object, torch.optim.Optimizer, object]:
    job = JobConfig.model_validate(small_job())
    model, _, _ = load_model(job, REPO, torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt, warmup_cosine(opt, 2, 20, 0.1)


def _train_a_bit(model: object, opt: torch.optim.Optimizer, sched: object) -> None:
    ids = torch.randint(0, 100, (2, 16))
    loss = model(input_ids=ids).logits.float().pow(2).mean()  # type: ignore[operator]
    loss.backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    opt.zero_grad()


def test_save_keeps_last_k_and_roundtrips(tmp_path: Path, parts: tuple) -> None:
    model, opt, sched = parts
    for step in (2, 4, 6):
        _train_a_bit(model, opt, sched)
        checkpoint.save(tmp_path, step, model, opt, sched, keep_last=2, is_main=True, extra={})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    final = tmp_path / "checkpoints" / "step-000006"
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    saved = checkpoint.trainable_state(model)

    _train_a_bit(model, opt, sched)  # move away, then restore
    moved = checkpoint.trainable_state(model)
    assert any(not torch.equal(value, saved[name]) for name, value in moved.items())  # or restoring proves nothing
    restored = checkpoint.restore(tmp_path, model, opt, sched, rank=0)
    assert restored is not None and restored.step == 6
    for name, value in checkpoint.trainable_state(model).items():
        assert torch.equal(value, saved[name]), name
    assert sched.last_epoch == 3  # type: ignore[attr-defined]


def test_torn_checkpoints_are_never_loaded(tmp_path: Path, parts: tuple) -> None:
    model, opt, sched = parts
    _train_a_bit(model, opt, sched)
    checkpoint.save(tmp_path, 5, model, opt, sched, keep_last=10, is_main=True, extra={})
    good = tmp_path / "checkpoints" / "step-000005"
    root = good.parent

    # 1. killed before the rename: only a temporary directory is left
    partial = root / ".tmp-step-000009-4242"
    shutil.copytree(good, partial)
    (partial / "manifest.json").unlink()
    # 2. killed after the rename but the data never reached the disk: a truncated file
    truncated = root / "step-000008"
    shutil.copytree(good, truncated)
    state = truncated / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    # 3. a directory without its manifest
    unfinished = root / "step-000007"
    shutil.copytree(good, unfinished)
    (unfinished / "manifest.json").unlink()

    assert checkpoint.verify(truncated) == "state.pt does not match its checksum"
    assert checkpoint.verify(unfinished) == "no manifest (the write never finished)"
    assert checkpoint.latest_valid(tmp_path) == good
    # The hosts' fact module and the controller judge them by the same rule (its copy ships alone to hosts).
    for path in (good, truncated, unfinished):
        assert ugro_checkpoints.problem(path) == checkpoint.verify(path), path
    assert ugro_checkpoints.newest_intact(tmp_path) == {"name": good.name, "step": 5, "path": str(good)}
    restored = checkpoint.restore(tmp_path, model, opt, sched, rank=0)
    assert restored is not None and restored.step == 5


def test_no_checkpoint_means_fresh_start(tmp_path: Path, parts: tuple) -> None:
    model, opt, sched = parts
    assert checkpoint.restore(tmp_path, model, opt, sched, rank=0) is None


class _Planted:
    """What a crafted state.pt carries: unpickling it runs code (here, it writes a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_crafted_checkpoint_is_refused_unread_and_the_run_resumes_from_the_one_before(
    tmp_path: Path, parts: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    """A run directory someone shares, or a checkpoint relayed from another host, with a valid manifest (integrity,
    not origin) and a state.pt that runs code when unpickled: nothing of it runs, the log names it, the rank resumes
    from the newest checkpoint that holds only tensors and plain values."""
    model, opt, sched = parts
    _train_a_bit(model, opt, sched)
    checkpoint.save(tmp_path, 5, model, opt, sched, keep_last=10, is_main=True, extra={})
    marker = tmp_path / "code-ran"
    state = torch.load(tmp_path / "checkpoints" / "step-000005" / "state.pt", weights_only=True)
    crafted = checkpoint.write(tmp_path, 9, state | {"plan": _Planted(marker)}, 10, lambda folder: folder.mkdir())
    assert checkpoint.verify(crafted) is None  # its manifest is valid
    with caplog.at_level("WARNING"):
        restored = checkpoint.restore(tmp_path, model, opt, sched, rank=0)
    assert not marker.exists(), "unpickling the crafted checkpoint ran its code"
    assert restored is not None and restored.step == 5
    assert any("step-000009" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records), caplog.text
