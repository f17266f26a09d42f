"""Every make target runs in CI at least once, as a user types it (`make <target>`), and says what it should.

Most targets run elsewhere already, for what they do (``ELSEWHERE``: the test or CI step, and the line there that
runs it; the first test checks the line is still there). The others run here, for real, with the quickest settings
each allows (the benchmarks at their smallest sizes): exit 0, no traceback, and the figures or files they promise.
The first test also fails on a Makefile target that is in neither list.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from helpers import REPO, Run, copy_checkout
from helpers import make as plain_make

# target -> (the file that runs it, the text there that does): run for what it does by the suite or CI itself.
ELSEWHERE: dict[str, tuple[str, str]] = {
    "venv": (".ci/run", "make --no-print-directory venv"),
    "test": (".ci/run", "make --no-print-directory test"),
    "train": (".ci/run", "make --no-print-directory train"),
    "lint": ("Makefile", "lint typecheck"),  # make test's first phase
    "typecheck": ("Makefile", "lint typecheck"),
    "molecule": ("tools/pytest-pair", "make --no-print-directory molecule"),  # make test's last phase
    "validate": ("tests/test_make_train.py", 'make("validate"'),
    "logs": ("tests/test_make_train.py", 'make("logs"'),
    "doctor": ("tests/test_make_train.py", 'make("doctor"'),
    "export": ("tests/test_make_train.py", 'make("export"'),
    "status": ("tests/test_cluster.py", 'make("status"'),
    "stop": ("tests/test_cluster.py", 'make("stop"'),
    "release": ("tests/test_cluster_lending.py", '[*make, "release"]'),
    "bench": ("tests/test_balance.py", 'make("bench"'),
    "preflight": ("tests/test_preflight.py", 'make("preflight"'),
    "lend": ("tests/test_cluster_lending.py", '[*make, "lend"]'),
    "mlflow-venv": ("Makefile", "lint typecheck mlflow-venv"),  # make test's first phase, beside lint and types
    "mlflow-server": ("tests/test_tracking.py", '"mlflow-server"'),
    "eval": ("tests/test_eval_harness.py", 'make("eval"'),
}
# target -> why it does not run in CI, and what runs its command instead.
NOT_IN_CI: dict[str, str] = {
    "lock": "asks the package registry and rewrites requirements/locks/: tests/test_locks.py checks the locks it "
    "wrote (hashes, every Python, the node and controller sets agree)",
    "chat": "an interactive terminal: tests/test_chat.py drives `ugro chat`, the target's command, in tmux",
    "dashboard": "an interactive terminal: tests/test_monitoring.py drives the dashboard (Textual's Pilot)",
    "bench-launch": "three `ugro train` runs on a fresh test cluster (~2 min); bench-recovery here runs the same "
    "launch through the same controller, to its first step and beyond",
    "bench-pipeline-cluster": "the default model trained twice across the test cluster (minutes); "
    "tests/test_cluster_pipeline.py trains in pipeline stages there",
    "bench-4bit": "the default model trained twice with bitsandbytes (minutes); tests/test_real_model.py trains it "
    "in 4-bit",
}

FIGURES = re.compile(r"\d+\.\d")  # a measured figure, as the benchmarks print them


def _targets() -> set[str]:
    """Every target the Makefile defines (the rules whose name is a word, not a file)."""
    found: set[str] = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        rule = re.match(r"^([a-z][a-z0-9-]*(?: [a-z][a-z0-9-]*)*):(?!=)", line)
        if rule:
            found |= set(rule[1].split())
    return found


def _smoked() -> set[str]:
    """The targets the tests below run: each test's name says ``make_<target>`` (dashes as underscores)."""
    names = [n.removeprefix("test_make_") for n in globals() if n.startswith("test_make_")]
    return {n.replace("_", "-") for n in names}


def _clean(result: subprocess.CompletedProcess[str]) -> str:
    """The output of a target that ended well: exit 0 and no Python traceback."""
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    return out


def _last_json(out: str) -> dict[str, Any]:
    line = [x for x in out.splitlines() if x.startswith("{")][-1]
    return dict(json.loads(line))


def test_every_make_target_runs_somewhere_in_ci_or_says_why_not() -> None:
    targets = _targets()
    smoked = _smoked() & targets
    unaccounted = targets - smoked - set(ELSEWHERE) - set(NOT_IN_CI)
    assert not unaccounted, f"make targets that nothing in CI runs: {sorted(unaccounted)}"
    assert not (set(ELSEWHERE) | set(NOT_IN_CI)) - targets, "a target listed here is no longer in the Makefile"
    for target, (path, line) in ELSEWHERE.items():
        assert line in (REPO / path).read_text(), f"make {target}: {path} no longer runs it ({line!r})"
    assert "provision" in smoked and "bench-recovery" in smoked


# -- no cluster -----------------------------------------------------------------------------------------------------


def test_make_help() -> None:
    out = _clean(plain_make("help"))
    unnamed = {"help", "export-slurm", "export-k8s"}  # itself; the former names of slurm-script and k8s-manifest
    missing = [t for t in sorted(_targets() - unnamed) if not re.search(rf"make (\S+\|)?{re.escape(t)}\b", out)]
    assert not missing, f"make help names no line for: {missing}"


def test_make_clean(tmp_path: Path) -> None:
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for path in ("runs/some-job/run.json", ".pytest_cache/v/x", "jobs/mine.yaml"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    _clean(plain_make("clean", cwd=tmp_path))
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".pytest_cache").exists()
    assert (tmp_path / "jobs" / "mine.yaml").is_file()  # only what the runs left


def test_make_plan(make: Run, tmp_path: Path) -> None:
    """From an inventory alone (OFFLINE=1): two hosts of unequal memory profiles."""
    hosts = {
        h: {"ansible_connection": "local", "memory_profile_name": p} for h, p in (("a", "gpu_12gb"), ("b", "gpu_8gb"))
    }
    inventory = tmp_path / "two.yml"
    inventory.write_text(json.dumps({"all": {"children": {"ugro_cluster": {"hosts": hosts}}}}))
    out = " ".join(_clean(make("plan", "JOB=jobs/tiny.yaml", f"INVENTORY={inventory}", "OFFLINE=1")).split())
    assert "plan of jobs/tiny.yaml" in out and "(offline)" in out, out
    assert re.search(r"\ba\b.*\bb\b", out), out


def test_make_export_slurm(make: Run, tmp_path: Path) -> None:
    """slurm-script under its former name (export-slurm runs it)."""
    out = _clean(make("export-slurm", "JOB=jobs/tiny.yaml", "NODES=2", f"SLURM_ARGS=--runs-dir {tmp_path}"))
    (script,) = tmp_path.glob("*/slurm/job.sbatch")
    assert "#SBATCH --nodes=2" in script.read_text() and script.name in out


def test_make_slurm_script(make: Run, tmp_path: Path) -> None:
    _clean(make("slurm-script", "JOB=jobs/tiny.yaml", "NODES=1", f"SLURM_ARGS=--runs-dir {tmp_path}"))
    (script,) = tmp_path.glob("*/slurm/job.sbatch")
    assert "#SBATCH --nodes=1" in script.read_text()


def test_make_export_k8s(make: Run, tmp_path: Path) -> None:
    """k8s-manifest under its former name (export-k8s runs it)."""
    out = _clean(make("export-k8s", "JOB=jobs/tiny.yaml", "NODES=2", f"K8S_ARGS=--out {tmp_path / 'job.yaml'}"))
    text = (tmp_path / "job.yaml").read_text()
    assert "kind: Job" in text and "kind: Service" in text, out


def test_make_k8s_manifest(make: Run, tmp_path: Path) -> None:
    _clean(make("k8s-manifest", "JOB=jobs/tiny.yaml", "NODES=1", f"K8S_ARGS=--out {tmp_path / 'job.yaml'}"))
    assert "kind: Job" in (tmp_path / "job.yaml").read_text()


def test_make_prometheus_config(tmp_path: Path) -> None:
    """The paths it prints are whole on their lines however long the checkout's path (output not a terminal: the
    console must not wrap them), and so is the path in an error naming a file."""
    checkout = copy_checkout(tmp_path / "a-checkout-in-a-directory-with-a-long-name-as-people-make" / "ugro")
    out_file = checkout / "runs" / "monitoring" / "prometheus.yml"
    out = _clean(plain_make("prometheus-config", f"OUT={out_file}", cwd=checkout, timeout=300))
    assert "scrape_configs" in out_file.read_text()
    said = next(line for line in out.splitlines() if "scrape configuration" in line)
    assert said.startswith(f"{out_file}: ") and f"--config.file={out_file})" in said, out
    assert str(checkout / "ugro" / "monitoring" / "grafana-dashboard.json") in said, out
    missing = checkout / "inventory" / "not-there.yml"
    refused = plain_make("prometheus-config", f"INVENTORY={missing}", f"OUT={out_file}", cwd=checkout, timeout=300)
    error = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in error, error
    assert any(str(missing) in line for line in error.splitlines()), error


def test_make_test_fast(make: Run) -> None:
    """The fast tier's ruff and pytest, on one test of it (TESTS: the files pytest collects; all of them took ~25 s
    more on a loaded machine)."""
    chosen = ["TESTS=tests/test_supervisor_states.py", "PYTEST_ARGS=-p no:cacheprovider -k a_new_run_begins"]
    out = _clean(make("test-fast", *chosen, timeout=300))
    assert "All checks passed" in out and re.search(r"\b1 passed\b", out), out[-3000:]


def test_make_role_docs(tmp_path: Path) -> None:
    """In a copy of the checkout: it writes every role's README, and they are the ones in the repository."""
    checkout = copy_checkout(tmp_path / "checkout")
    before = {p: p.read_text() for p in checkout.glob("roles/*/README.md")}
    _clean(plain_make("role-docs", cwd=checkout, timeout=300))
    after = {p: p.read_text() for p in checkout.glob("roles/*/README.md")}
    assert before and after == before


def test_make_bench_exporter(make: Run) -> None:
    out = _clean(make("bench-exporter", "BENCH_ARGS=--duration 2 --interval 0.5 --burst 10", timeout=300))
    assert re.search(r"exporter, one scrape every 0\.5 s .* % of a core", out), out[-3000:]


def test_make_bench_headloss(make: Run) -> None:
    small = "BENCH_ARGS=--vocab 4096 --hidden 64 --seq 64 --batch 2 --reps 1"
    result = _last_json(_clean(make("bench-headloss", small, timeout=300)))
    assert result["peak_new_over_old"] > 0 and result["time_new_over_old"] > 0, result
    assert result["max_rel_diff"] < 1e-3, result  # the two paths give the same loss and gradients


def test_make_bench_pipeline(make: Run, tmp_path: Path) -> None:
    small = f"BENCH_ARGS=--factors 1.0,0.5 --layers 2 --steps 3 --skip 1 --global-batch 8 --micro-batch 2 \
--seq-len 16 --out {tmp_path}"
    result = _last_json(_clean(make("bench-pipeline", small, timeout=600)))
    assert all(result[f"{way}_tokens_per_s"] > 0 for way in ("planned", "equal", "ideal")), result


def test_make_bench_rank_start(make: Run) -> None:
    result = _last_json(_clean(make("bench-rank-start", "BENCH_ARGS=--repeat 1", timeout=600)))
    assert result["torchrun_cpu_s"] > 0 and result["launcher_cpu_s"] > 0, result


# -- the test cluster (root) ----------------------------------------------------------------------------------------


def test_make_bench_recovery(make: Run, netns: Any) -> None:
    """Its own 3 test hosts (subnet 10.213.9.0/24): a launch, tb2's job killed, tb1's link cut, to the end."""
    out = _clean(make("bench-recovery", timeout=600))
    figures = _last_json(out)
    for key in ("launch_to_first_step_s", "kill_to_next_step_s", "rendezvous_cut_to_next_step_s"):
        assert isinstance(figures[key], float) and figures[key] >= 0, figures  # a step under way may end at once
    assert figures["kill_steps_redone"] == 0 and figures["cut_steps_redone"] == 0, figures
    assert figures["kill_decided_by"] == "controller" and figures["launch_cpu_s"] > 0, figures
    assert figures["collectives"] == "ugro_nccl_like", figures  # measured as NCCL behaves, not on kinder gloo
    # Each fault is the restart the run's record names it by (make doctor reads the same), also on a loaded machine.
    assert re.match(r"restart \d+: lost on tb2: ", figures["kill_recorded_as"]), figures
    assert re.match(r"restart \d+: unreachable on tb1: .* -> regrouped on tb3 ", figures["cut_recorded_as"]), figures
    assert "SIGKILL of tb2's job -> next step on tb1 + tb3" in out and "the first launch's phases (s): {" in out
    assert re.search(r"final hosts \['tb\d'(, 'tb\d')*\], main host tb\d", out), out[-3000:]


def test_make_bench_ddp_init(make: Run, netns: Any) -> None:
    small = "BENCH_ARGS=--hidden 64 --layers 2 --vocab 1000 --hosts 2"
    out = _clean(make("bench-ddp-init", small, timeout=600))
    assert re.search(r"^DDP init: plain [\d.]+ MiB in [\d.]+ s, ugro [\d.]+ MiB in [\d.]+ s$", out, re.M), out[-3000:]


def test_make_testbed_up(make: Run, netns: Any, tmp_path: Path) -> None:
    """make testbed-up, then make testbed-down (a directory and a free subnet of their own)."""
    where = [f"TESTBED_DIR={tmp_path / 'bed'}"]
    try:
        out = _clean(make("testbed-up", "N=1", "SUBNET=auto", *where, timeout=300))
        assert "testbed up in" in out and (tmp_path / "bed" / "inventory.yml").is_file(), out
    finally:
        down = make("testbed-down", *where, timeout=120)
    assert "removed" in _clean(down)


def test_make_testbed_down(make: Run, netns: Any, tmp_path: Path) -> None:
    """On a directory with no test cluster: nothing to remove, and it says so without failing."""
    out = _clean(make("testbed-down", f"TESTBED_DIR={tmp_path / 'none'}", timeout=120))
    assert f"no testbed in {tmp_path / 'none'}" in out, out


def test_make_provision(make: Run, cluster: Path) -> None:
    """`make provision` on the session's test cluster, its exporter role only (the whole playbook runs in
    tests/test_node_stack.py, as ansible-playbook, and every role's in Molecule): started where it does not run, left
    alone where it does (the session started them)."""
    args = "ANSIBLE_ARGS=--tags exporter -e exporter_state=started"
    out = _clean(make("provision", f"INVENTORY={cluster}", args, timeout=600))
    recap = re.findall(r"^(tb\d)\s*: ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", out, re.MULTILINE)
    assert sorted(recap) == ["tb1", "tb2", "tb3"], out[-3000:]


def test_make_follow(make: Run, unbroken_run: tuple[Path, Any]) -> None:
    """A finished run followed again: the controller polls its hosts, finds it finished, and reports it."""
    run_dir, _ = unbroken_run
    out = _clean(make("follow", f"JOB_ID={run_dir.name}", timeout=600, env={"UGRO_RUNS_DIR": str(run_dir.parent)}))
    assert f"following job {run_dir.name}" in " ".join(out.split()), out[-3000:]
