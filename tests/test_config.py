"""Job files and memory profiles: bad input gets one error naming the file and the key."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import PYTHON, REPO, small_job

from train.config import ConfigError, apply_profile, load_job, load_profile


def _write(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_default_job_is_the_real_model_with_a_held_out_set() -> None:
    job = load_job(REPO / "jobs" / "default.yaml")
    assert job.model.init == "pretrained" and job.model.source == "models/smollm2-135m-instruct"
    assert job.eval is not None and job.eval.source != job.data.source
    assert len(job.cluster_hash()) == 64
    assert load_job(REPO / "jobs" / "tiny.yaml").model.init == "random"


def test_a_held_out_question_also_trained_on_is_named(tmp_path: Path) -> None:
    from ugro.checks.jobcheck import check_data

    train = tmp_path / "train.jsonl"
    train.write_text('{"instruction": "Which port?", "output": "29500"}\n{"instruction": "Why?", "output": "x"}\n')
    held = tmp_path / "eval.jsonl"
    held.write_text('{"instruction": "Other?", "output": "y"}\n{"instruction": "Why?", "output": "x"}\n')
    job = load_job(_write(tmp_path / "j.yaml", small_job(data={"source": str(train)}, eval={"source": str(held)})))
    with pytest.raises(
        ConfigError, match=r"eval.jsonl:2: this held-out question is also trained on \(.*train.jsonl:2\)"
    ):
        check_data(job, REPO)


def test_unknown_key_names_file_and_dotted_key(tmp_path: Path) -> None:
    data = small_job()
    data["lora"] = {"rank": 8}
    path = _write(tmp_path / "typo.yaml", data)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert str(path) in str(err.value)
    assert "unknown key 'lora.rank'" in str(err.value)


def test_bad_value_names_key_and_value(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", small_job(lora={"r": -4}))
    with pytest.raises(ConfigError, match=r"key 'lora.r'.*greater than 0.*-4"):
        load_job(path)


def test_bad_choice_lists_choices(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.yaml", small_job(model={"quantization": "8bit"}))
    with pytest.raises(ConfigError, match=r"model.quantization.*'none' or '4bit'"):
        load_job(path)


def test_missing_section_is_named(tmp_path: Path) -> None:
    data = small_job()
    del data["data"]
    with pytest.raises(ConfigError, match="missing required key 'data'"):
        load_job(_write(tmp_path / "nodata.yaml", data))


def test_yaml_syntax_error_gives_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "broken.yaml", "name: x\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken.yaml \(line \d+, column \d+\): not valid YAML"):
        load_job(path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: file not found"):
        load_job(tmp_path / "nope.yaml")


def test_warmup_longer_than_run_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.yaml", small_job(schedule={"warmup_steps": 50}, train={"max_steps": 10}))
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_job(path)


def test_profile_may_not_set_cluster_wide_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "profile.yaml", {"micro_batch_size": 2, "data": {"seq_len": 64}})
    with pytest.raises(ConfigError) as err:
        load_profile(path, host="node3070")
    message = str(err.value)
    assert "node3070" in message and "'data'" in message and "cluster-wide" in message


def test_profile_overrides_only_rank_local_keys(tmp_path: Path) -> None:
    job = load_job(_write(tmp_path / "job.yaml", small_job()))
    profile = load_profile(_write(tmp_path / "p.yaml", {"micro_batch_size": 1, "gradient_checkpointing": True}), "h")
    merged = apply_profile(job, profile)
    assert merged.rank_local.micro_batch_size == 1
    assert merged.rank_local.gradient_checkpointing is True
    assert merged.cluster_hash() == job.cluster_hash()  # the profile never changes what the cluster trains


def test_a_token_budget_caps_the_micro_batch_for_any_sequence_length(tmp_path: Path) -> None:
    job = load_job(_write(tmp_path / "job.yaml", small_job(data={"seq_len": 128}, rank_local={"micro_batch_size": 8})))
    assert job.micro_batch_cap == 8
    profile = load_profile(_write(tmp_path / "p.yaml", {"micro_batch_tokens": 512}), "node3070")
    assert apply_profile(job, profile, "p.yaml on host node3070").micro_batch_cap == 4  # 512 // 128
    longer = job.model_copy(update={"data": job.data.model_copy(update={"seq_len": 256})})
    assert apply_profile(longer, profile).micro_batch_cap == 2  # the same profile, twice as long sequences

    short = load_profile(_write(tmp_path / "short.yaml", {"micro_batch_tokens": 100}), "node3070")
    with pytest.raises(ConfigError) as err:
        apply_profile(job, short, "/etc/ugro/profile.yaml on host node3070")
    message = str(err.value)
    assert "/etc/ugro/profile.yaml on host node3070" in message
    assert "rank_local.micro_batch_tokens (100) is smaller than one sequence (data.seq_len 128)" in message


def test_a_token_budget_below_one_sequence_in_the_job_file_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.yaml", small_job(rank_local={"micro_batch_tokens": 64}))
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert "job.yaml" in str(err.value) and "micro_batch_tokens (64)" in str(err.value)


def test_profile_bad_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_profile(_write(tmp_path / "p.yaml", {"micro_batch_size": 0}), "h")


def test_cli_reports_one_error_without_traceback(tmp_path: Path) -> None:
    data = small_job()
    data["optim"]["learning_rate"] = 1e-3
    path = _write(tmp_path / "job.yaml", data)
    result = subprocess.run(
        [PYTHON, "-m", "ugro.cli", "validate", "--job", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "optim.learning_rate" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_float16_is_refused_with_what_to_set_instead(tmp_path: Path) -> None:
    """float16 without loss scaling: the chunked loss's gradients underflow. One error before launch, and the fix."""
    path = _write(tmp_path / "j.yaml", small_job(model={"dtype": "float16"}))
    refusal = r"model.dtype: float16 trains.*underflow.*model.dtype: bfloat16.*float32"
    with pytest.raises(ConfigError, match=refusal) as err:
        load_job(path)
    assert str(path) in str(err.value)
