"""A preference job's keys are checked like every key: one error naming the key and the fix, before anything starts;
a pair counts as two rows in a host's micro-batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import write_job

from train.config import ConfigError, JobConfig, load_job

PAIRS = {"source": "data/preference/train.jsonl", "format": "preference", "packing": False}


def _load(tmp_path: Path, **overrides: Any) -> JobConfig:
    return load_job(write_job(tmp_path / "job.yaml", **overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"train": {"method": "dpo"}},
            r"train.method 'dpo' trains on chosen and rejected answers: set data.format: "
            r"preference",
        ),
        ({"data": PAIRS}, r"data.format 'preference' holds preference data, which train.method 'sft' does not train"),
        ({"data": {**PAIRS, "format": "unpaired"}, "train": {"method": "orpo"}}, r"set data.format: preference"),
        (
            {"data": PAIRS, "train": {"method": "dpo"}, "preference": {"loss": "kto"}},
            r"preference.loss 'kto' is no loss of train.method 'dpo': use sigmoid, hinge, ipo, robust",
        ),
        (
            {"data": PAIRS, "train": {"method": "dpo"}, "preference": {"label_smoothing": 0.1}},
            r"preference.label_smoothing applies to preference.loss: robust",
        ),
        (
            {"data": {**PAIRS, "packing": True}, "train": {"method": "kto"}},
            r"data.packing: preference pairs are never packed",
        ),
        (
            {"data": PAIRS, "train": {"method": "dpo"}, "parallel": {"stages": 2}},
            r"parallel: pipeline stages do not run train.method 'dpo'.*use parallel: data",
        ),
    ],
    ids=["dpo-on-sft-data", "sft-on-pairs", "orpo-unpaired", "foreign-loss", "smoothing", "packing", "stages"],
)
def test_a_preference_job_that_cannot_run_is_one_error_naming_the_key(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        _load(tmp_path, **overrides)
    assert str(caught.value).startswith(str(tmp_path / "job.yaml")) and "\n" not in str(caught.value)


def test_a_pair_is_two_rows_of_a_hosts_micro_batch_and_the_defaults_are_trls(tmp_path: Path) -> None:
    job = _load(tmp_path, data=PAIRS, train={"method": "dpo"}, rank_local={"micro_batch_size": 5})
    assert job.micro_batch_cap == 2 and job.rows_per_item == 2
    assert job.preference_loss == "sigmoid" and job.preference.beta == 0.1 and job.preference.disable_dropout
    kto = _load(tmp_path, data=PAIRS, train={"method": "kto"}, rank_local={"micro_batch_size": 1})
    assert kto.preference_loss == "kto" and kto.micro_batch_cap == 1  # never below one item
    sft = _load(tmp_path, rank_local={"micro_batch_size": 5})
    assert sft.micro_batch_cap == 5 and sft.rows_per_item == 1
    assert job.cluster_hash() != _load(tmp_path, data=PAIRS, train={"method": "dpo"},
                                       preference={"beta": 0.2}).cluster_hash()  # fmt: skip


def test_the_example_job_validates() -> None:
    job = load_job(Path(__file__).resolve().parent.parent / "jobs" / "dpo.example.yaml")
    assert job.train.method == "dpo" and job.data.format == "preference" and job.preference.reference == "cached"


def test_the_memory_model_counts_both_rows_of_a_pair(tmp_path: Path) -> None:
    """`make plan` and the stage planner: a micro-batch of 2 pairs holds the activations of 4 SFT sequences."""
    from train.layout import stageplan

    repo = Path(__file__).resolve().parent.parent
    dpo = _load(tmp_path, data=PAIRS, train={"method": "dpo"}, rank_local={"micro_batch_size": 4})
    sft = _load(tmp_path, data={"packing": False}, rank_local={"micro_batch_size": 4})
    shape = stageplan.read_shape(dpo, repo)
    whole = stageplan.Span(shape.layers)
    pairs, rows = (stageplan.estimate(shape, job, whole, "cuda") for job in (dpo, sft))
    assert dpo.micro_batch_cap == 2 and sft.micro_batch_cap == 4
    assert pairs.activations == pytest.approx(rows.activations) and pairs.activations > 0


def test_a_model_that_fits_no_rank_whole_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """parallel: auto would cut the model into stages (here the planner is made to): a preference job says why not."""
    import torch

    from train.dist.distributed import RankInfo
    from train.layout import placement, stageplan, topology

    repo = Path(__file__).resolve().parent.parent
    job = _load(tmp_path, data=PAIRS, train={"method": "dpo"})
    layers = stageplan.read_shape(job, repo).layers
    staged = topology.fixed(layers, ("a", "b"), [[layers // 2, layers - layers // 2]], "model needs 9.1 GiB")
    monkeypatch.setattr(stageplan, "plan", lambda *_: staged)
    info = RankInfo(0, 0, 1, "a", torch.device("cpu"), hosts=("a",))
    refused = r"train.method 'dpo': the model does not fit every rank whole \(model needs 9.1 GiB\), and pipeline"
    with pytest.raises(ConfigError, match=refused):
        placement.decide(job, info, repo)
