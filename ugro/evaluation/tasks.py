"""The held-out set written as lm-evaluation-harness tasks (runs/<job-id>/eval/tasks/): YAML files over a local
jsonl (``dataset_path: json``), which lm-eval's ``TaskManager(include_path=...)`` loads like any of its own tasks.

heldout      loglikelihood of each answer given its prompt: token_perplexity (exp of the mean loss per answer token,
             the training's held-out figure), bits_per_byte, byte_perplexity (lm-eval's per-document perplexity,
             exp of a whole answer's mean summed loss, ~1e85 here, is left out: it says nothing a person reads)
heldout_gen  (chat and instruction data) a greedy answer of at most eval.max_new_tokens tokens, scored against the
             reference answer with sacrebleu's chrF and BLEU (lm-eval's chrf and bleu metrics)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ugro.evaluation import heldout_metrics
from ugro.evaluation.heldout import HeldOutSet

HELDOUT = "heldout"
HELDOUT_GEN = "heldout_gen"
# Bumped when what a task computes changes (its documents come from the run's data, not from this number).
VERSIONS = {HELDOUT: 1, HELDOUT_GEN: 1}
DOCS = "heldout.jsonl"


@dataclass(frozen=True)
class TaskDir:
    """The generated tasks of a run: their directory (lm-eval's include_path) and names."""

    path: Path
    names: tuple[str, ...]  # heldout, and heldout_gen where the data is chat-like

    def expand(self, name: str) -> list[str]:
        """A task name as asked -> lm-eval task names: 'heldout' is heldout and (chat-like data) heldout_gen."""
        return list(self.names) if name == HELDOUT else [name]


def _local_docs(data_files: str) -> dict[str, Any]:
    """Where both held-out tasks read their documents: the run's own jsonl, through datasets' json loader."""
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data_files}}, "test_split": "test"}


def _perplexity_task(data_files: str) -> dict[str, Any]:
    def metric(name: str, aggregation: str) -> dict[str, Any]:
        return {"metric": name, "aggregation": aggregation, "higher_is_better": False}

    return {
        "task": HELDOUT,
        **_local_docs(data_files),
        "output_type": "loglikelihood",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",
        "process_results": Function("utils.process_results"),
        "metric_list": [
            metric("token_perplexity", "weighted_perplexity"),
            metric("bits_per_byte", "bits_per_byte"),
            metric("byte_perplexity", "weighted_perplexity"),
        ],
        "metadata": {"version": VERSIONS[HELDOUT]},
    }


def _generation_task(data_files: str, max_new_tokens: int, stops: list[str]) -> dict[str, Any]:
    return {
        "task": HELDOUT_GEN,
        **_local_docs(data_files),
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{reference}}",
        "target_delimiter": "",
        "generation_kwargs": {"until": stops, "do_sample": False, "max_gen_toks": max_new_tokens},
        "metric_list": [
            {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True},
            {"metric": "bleu", "aggregation": "bleu", "higher_is_better": True},
        ],
        "metadata": {"version": VERSIONS[HELDOUT_GEN]},
    }


class Function(str):
    """A function of the task directory's utils.py, written as lm-eval's ``!function`` tag."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _yaml(config: dict[str, Any]) -> str:
    return yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def write_tasks(held_out: HeldOutSet, out: Path, max_new_tokens: int) -> TaskDir:
    """Write the tasks of ``held_out`` into ``out`` (replaced whole: a new run of make eval reads the data anew)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    docs = out / DOCS
    docs.write_text("".join(json.dumps(d.row(), ensure_ascii=False) + "\n" for d in held_out.docs), encoding="utf-8")
    shutil.copyfile(heldout_metrics.__file__, out / "utils.py")
    (out / f"{HELDOUT}.yaml").write_text(_yaml(_perplexity_task(str(docs.resolve()))), encoding="utf-8")
    names = [HELDOUT]
    if held_out.chat_like:
        stops = list(dict.fromkeys(s for d in held_out.docs for s in d.stop))
        gen = _generation_task(str(docs.resolve()), max_new_tokens, stops)
        (out / f"{HELDOUT_GEN}.yaml").write_text(_yaml(gen), encoding="utf-8")
        names.append(HELDOUT_GEN)
    return TaskDir(out, tuple(names))
