# ugro — the user's targets are thin calls into the Python controller (the `ugro` command, ugro/cli.py); the others
# call their tool directly (provision: ansible-playbook; venv, lock: uv; bench*: python -m bench.*; testbed-*: the
# test cluster; test, lint, typecheck, molecule: their runners). docs/architecture.md lists them.
# Knobs live in the job file (JOB) and the inventory (INVENTORY; defaults in roles/*/defaults), never here.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
# The checkout's own code (python -m imports from the current directory first), even with a venv it shares.
UGRO      := $(PY) -m ugro.cli
JOB       ?= jobs/default.yaml
INVENTORY ?= inventory/local.yml
RESUME    ?= none
JOB_ID    ?=
PYTEST_ARGS ?=
TESTS     ?= tests
BENCH_ARGS ?=

.PHONY: role-docs export chat train preflight doctor status logs stop release lend follow validate plan test test-fast bench bench-ddp-init lint typecheck venv lock clean help testbed-up testbed-down molecule provision dashboard prometheus-config bench-exporter bench-recovery bench-launch bench-rank-start bench-4bit bench-headloss bench-pipeline bench-pipeline-cluster mlflow-venv mlflow-server eval

help:
	@echo "make train [JOB=jobs/default.yaml] [INVENTORY=inventory/local.yml] [RESUME=auto] [SET=\"optim.lr=1e-4 train.max_steps=200\"]"
	@echo "make preflight [JOB=...] [INVENTORY=...] [JSON=1]   check every host before a launch (make train runs the fast checks; SKIP_PREFLIGHT=1 skips them)"
	@echo "make doctor [JOB_ID=...]   explain a failed run from its collected logs: host, cause, fix"
	@echo "make status|logs|stop [INVENTORY=...] [JOB_ID=...]   the newest job (runs/latest) by default"
	@echo "make release HOST=node4070 [INVENTORY=...] [JOB_ID=...]   take a host back: its ranks leave after this step"
	@echo "make lend HOST=node4070 [INVENTORY=...] [JOB_ID=...]      lend it to the job again: its ranks rejoin"
	@echo "make follow [JOB_ID=...]   follow a running job again after Ctrl-C, a closed terminal or a dead controller"
	@echo "make test            the whole test suite (ansible-lint, ruff, mypy, pytest, Molecule; root for the test cluster)"
	@echo "make test-fast       the fast tier: ruff and the unit tests (no cluster, ranks, Ansible or network; < 3 min)"
	@echo "make bench           balanced vs equal vs ideal on 3 emulated unequal ranks; trainer vs a bare loop"
	@echo "make bench-pipeline  planned vs equal layer split vs ideal: 3 pipeline stages on emulated unequal devices"
	@echo "make bench-pipeline-cluster  the default model in 3 stages across the test cluster vs data parallel (root)"
	@echo "make bench-ddp-init  bytes and time DDP broadcasts at start-up, plain vs ugro, on the test cluster (root)"
	@echo "make bench-exporter  the node exporter's CPU cost at one scrape every 5 s"
	@echo "make bench-recovery  launch -> first step, a killed host and the main host's cut link -> next step, on the test cluster (root)"
	@echo "make bench-launch    make train to its first step on the test cluster: fresh hosts, the same again, without the checks (root)"
	@echo "make bench-rank-start  one host's CPU to start a rank: torchrun's way vs train.launcher's (ranks forked where there is no GPU)"
	@echo "make bench-4bit      the default job in 4-bit QLoRA against the same job unquantized: held-out loss by step"
	@echo "make bench-headloss  the loss from full logits vs from hidden states (a 151,936-token head): memory, time, differences"
	@echo "make testbed-up N=3 [SUBNET=auto] [TESTBED_DIR=.testbed] / make testbed-down   a test cluster of N hosts on this machine (root)"
	@echo "make provision [INVENTORY=...] [ANSIBLE_ARGS=...]   provision the hosts: driver, CUDA, Python env, network, firewall, exporter"
	@echo "make export [JOB_ID=...] [FORMAT=gguf]   the run's model merged into its base (runs/<job-id>/merged), or as GGUF + Ollama Modelfile (runs/<job-id>/gguf)"
	@echo "make eval [JOB_ID=...] [TASKS=heldout,...]   lm-evaluation-harness on the base and the run's model, side by side (runs/<job-id>/eval)"
	@echo "make mlflow-server [PORT=5000] [MLFLOW_STORE=runs/mlflow]   an MLflow tracking server here for report_to: [mlflow]"
	@echo "make mlflow-venv     .venv-mlflow: the MLflow server's own venv from its lock (make test builds it)"
	@echo "make chat [JOB_ID=...]     talk to a run's model in the terminal (/base, /tuned, /reset, /quit)"
	@echo "make dashboard [INVENTORY=...]   live view of every node's exporter (GPUs, job, loss, per-rank balance); q quits"
	@echo "make prometheus-config [INVENTORY=...] [OUT=...]   runs/monitoring/prometheus.yml: a Prometheus scrape config of every exporter"
	@echo "make validate [JOB=...] [INVENTORY=...] [SHOW=2]   check a job file and its data (rows, steps an epoch; SHOW: rows with the trained tokens marked), with INVENTORY its hosts and ranks, without starting anything"
	@echo "make plan [JOB=...] [INVENTORY=...] [OFFLINE=1]   which host holds which layers: data parallel or pipeline stages, with memory estimates"
	@echo "make slurm-script [JOB=...] [NODES=2] [RESUME=auto] [SLURM_ARGS=...]   an sbatch script for the job (runs/<job-id>/slurm/)"
	@echo "make k8s-manifest [JOB=...] [NODES=2|gpu_12gb=1,gpu_8gb=2] [K8S_ARGS=...]   a Kubernetes manifest: indexed Jobs + headless Service"
	@echo "make lint            ansible-lint (production profile) and ruff"
	@echo "make typecheck       mypy"
	@echo "make molecule [SCENARIO=<role>]   every role's Molecule scenario on rootfs test hosts (root)"
	@echo "make venv            .venv from the locks (every other target makes it first)"
	@echo "make clean           remove runs/ and .pytest_cache"
	@echo "make lock            regenerate requirements/locks/py3.X/{node,gpu,controller}.txt from requirements/*.in (pinned uv, registry only)"
	@echo "make role-docs       every role's README.md from its meta/argument_specs.yml (hand-written part kept)"

# The controller's (and developer's) virtual environment: exactly the node and controller locks of this
# Python (requirements/locks/py3.X/), synced by the pinned uv from the registry alone (--no-config): the
# same torch every node gets (the CUDA build on Linux x86-64), never this machine's pip configuration.
# --reinstall: a torch 2.13.0+cpu already there satisfies torch==2.13.0; only the registry's wheel (its hash) may stay.
# --compile-bytecode: every module compiled once, here, as pip does and uv does not by default. Without it each
# process compiles what it imports where it cannot write __pycache__ (PYTHONDONTWRITEBYTECODE, or the test hosts, which
# see a clone under /tmp read-only): an ansible-playbook start 1.75 CPU-s instead of 1.1, torch and transformers'
# import 20 CPU-s instead of 7.6 (docs/results.md "CI time").
PYVER   := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
LOCKDIR := requirements/locks/py$(PYVER)
LOCKS   := $(LOCKDIR)/node.txt $(LOCKDIR)/controller.txt

$(VENV)/.installed: $(wildcard $(LOCKS)) requirements/locks/uv.txt pyproject.toml
	@test -f $(LOCKDIR)/node.txt || { echo "make venv: $(PYTHON) is Python $(or $(PYVER),?), which has no lock \
	(requirements/locks/py3.11, py3.12, py3.13): run make with PYTHON=python3.12, say"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(VENV)/bin/pip --isolated install --quiet --disable-pip-version-check \
		--no-deps --require-hashes -r requirements/locks/uv.txt
	$(VENV)/bin/uv pip sync --no-config --require-hashes --reinstall --compile-bytecode --python $(PY) $(LOCKS)
	$(VENV)/bin/uv pip install --no-config --python $(PY) --no-deps --no-build-isolation -e .
	$(VENV)/bin/uv cache prune --no-config --quiet  # --reinstall unpacks every wheel anew: ~5 GB of cache a build
	touch $@

venv: $(VENV)/.installed

# An MLflow tracking server in a venv of its own (requirements/locks/py3.X/mlflow-server.txt: its pyarrow could not sit
# beside the node lock's); the controller is only its client. `make mlflow-server` serves runs/mlflow on this machine's
# loopback (PORT=5000; MLFLOW_HOST=0.0.0.0 for the LAN), the tracker tests start their own from the same venv.
MLFLOW_VENV    := .venv-mlflow
PORT           ?= 5000
MLFLOW_HOST    ?= 127.0.0.1
MLFLOW_STORE   ?= runs/mlflow
MLFLOW_WORKERS ?= 2
$(MLFLOW_VENV)/.installed: $(LOCKDIR)/mlflow-server.txt | $(VENV)/.installed
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(VENV)/bin/uv pip sync --no-config --require-hashes --compile-bytecode --python $(MLFLOW_VENV)/bin/python $<
	touch $@

mlflow-venv: $(MLFLOW_VENV)/.installed

mlflow-server: mlflow-venv
	mkdir -p $(MLFLOW_STORE)
	$(MLFLOW_VENV)/bin/mlflow server --host $(MLFLOW_HOST) --port $(PORT) --workers $(MLFLOW_WORKERS) \
		--backend-store-uri sqlite:///$(abspath $(MLFLOW_STORE))/mlflow.db \
		--artifacts-destination $(abspath $(MLFLOW_STORE))/artifacts

# SET="optim.lr=1e-4 train.max_steps=200": keys of the job laid over the job file (ugro/run/settings.py).
SET_ARGS = $(foreach setting,$(SET),--set '$(setting)')

train: venv
	$(UGRO) train --job $(JOB) --inventory $(INVENTORY) --resume $(RESUME) $(SET_ARGS)

preflight: venv
	$(UGRO) preflight --job $(JOB) --inventory $(INVENTORY) $(if $(JSON),--json)

doctor: venv
	$(UGRO) doctor $(if $(JOB_ID),--job-id $(JOB_ID)) $(if $(JSON),--json)

status logs stop: venv
	$(UGRO) $@ --inventory $(INVENTORY) $(if $(JOB_ID),--job-id $(JOB_ID))

# Take a host back from the running job, and lend it again (docs/recovery.md, "Hosts lent and taken back").
release lend: venv
	@test -n "$(HOST)" || { echo "make $@: name the host, e.g. make $@ HOST=node4070" >&2; exit 2; }
	$(UGRO) $@ $(HOST) --inventory $(INVENTORY) $(if $(JOB_ID),--job-id $(JOB_ID))

# Follow a running job again after Ctrl-C, a closed terminal or a controller that died (docs/recovery.md).
follow: venv
	$(UGRO) follow $(if $(JOB_ID),--job-id $(JOB_ID))

# The run's adapter merged into its base model (runs/<job-id>/merged), checked against base + adapter.
export: venv
	$(UGRO) export $(if $(JOB_ID),--job-id $(JOB_ID)) $(if $(FORMAT),--format $(FORMAT)) $(if $(QUANT),--quant $(QUANT)) $(if $(QUESTIONS),--questions $(QUESTIONS))

# Talk to a run's model in the terminal (default: the newest run); /base and /tuned switch the adapter off and on.
chat: venv
	$(UGRO) chat $(if $(JOB_ID),--job-id $(JOB_ID))

# lm-evaluation-harness on the base and the run's model (docs/export.md, "Benchmarks: make eval").
eval: venv
	$(UGRO) eval $(if $(JOB_ID),--job-id $(JOB_ID)) $(if $(TASKS),--tasks $(TASKS)) $(if $(LIMIT),--limit $(LIMIT))

validate: venv
	$(UGRO) validate --job $(JOB) $(if $(filter-out file,$(origin INVENTORY)),--inventory $(INVENTORY)) $(SET_ARGS) $(if $(SHOW),--show $(SHOW))

# Which host holds which layers (docs/pipeline.md); OFFLINE=1: from the inventory alone, without the hosts.
plan: venv
	$(UGRO) plan --job $(JOB) --inventory $(INVENTORY) $(if $(OFFLINE),--offline) $(SET_ARGS)

# The same job under a batch scheduler (docs/schedulers.md): an sbatch script in runs/<job-id>/slurm/
# (submit it with sbatch), or a Kubernetes manifest in runs/<job-id>/k8s/. NODES: SLURM nodes, or pods (a
# number, or profile=count,... per memory profile); SLURM_ARGS / K8S_ARGS: further options (ugro slurm-script --help).
NODES      ?= 2
SLURM_ARGS ?=
K8S_ARGS   ?=
.PHONY: slurm-script k8s-manifest export-slurm export-k8s
slurm-script: venv
	$(UGRO) slurm-script --job $(JOB) --nodes $(NODES) --resume $(RESUME) $(SLURM_ARGS)

k8s-manifest: venv
	$(UGRO) k8s-manifest --job $(JOB) --nodes $(NODES) $(K8S_ARGS)

# The names these targets had before "export" came to mean the trained model only (make export).
export-slurm: slurm-script
export-k8s: k8s-manifest

# Every node's exporter (role exporter) on one screen; `q` quits.
dashboard: venv
	$(UGRO) dashboard --inventory $(INVENTORY)

# A Prometheus scrape configuration from the inventory (every exporter, and node_exporter where set).
prometheus-config: venv
	$(UGRO) prometheus-config --inventory $(INVENTORY) $(if $(OUT),--out $(OUT))

PY_DIRS := train ugro library action_plugins bench tests models molecule data tools testbed

lint: venv
	$(VENV)/bin/ansible-lint --profile production
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)

typecheck: venv
	$(VENV)/bin/mypy
	# An action plugin shares its module's name (library/), so mypy checks it on its own.
	$(VENV)/bin/mypy action_plugins

# The full tier (what CI runs): lint and types side by side (each uses one core: ansible-lint and mypy), every
# test (the test cluster, torchrun, Ansible and SLURM ones need root and the tools .ci/run installs) as two pytest
# processes side by side, the test cluster's tests and the others (and a third for the tests that mostly wait), and
# every role's Molecule scenario, started when the first of the two ends (tools/pytest-pair --then-molecule). Not all three from the start: on two cores pytest's
# ranks and Molecule's Ansible both want the CPU, and together they took longer (docs/results.md). Each phase prints
# its duration as it ends (tools/timed); a failing check's output comes whole (--output-sync).
TIMED := tools/timed
test: venv
	$(TIMED) "make test: lint, types and the MLflow server's venv" \
		$(MAKE) --no-print-directory -j2 --output-sync=target lint typecheck mlflow-venv
	$(TIMED) "make test: pytest and Molecule" tools/pytest-pair --then-molecule $(PY) $(PYTEST_ARGS)

# The fast tier, a developer's loop (tests/README.md): ruff, then the tests that use none of the test cluster,
# real ranks, Ansible, SLURM or the network (markers applied by tests/conftest.py); no root, under 3 minutes.
FAST_TESTS := not (cluster or torchrun or ansible or slurm or slow)
test-fast: venv
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)
	$(PY) -m pytest -m "$(FAST_TESTS)" $(PYTEST_ARGS) $(TESTS)

# Every role's Molecule scenario (converge, idempotence, verify) on rootfs test hosts (root);
# SCENARIO=<role> runs one. The first run debootstraps the test hosts' Debian 12 (~3 min, cached).
# Three scenarios side by side (MOLECULE_JOBS), each on test hosts of its own: they mostly wait on SSH and apt.
# MOLECULE_ARGS: more options of tools/molecule_all.py (make test's --fewer-until).
MOLECULE_JOBS ?= 3
molecule: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(if $(SCENARIO),molecule test -s $(SCENARIO),$(PY) -m tools.molecule_all --jobs $(MOLECULE_JOBS) $(MOLECULE_ARGS))

# Provision the hosts of INVENTORY (driver, CUDA, Python env, network, firewall, NCCL env, profile).
provision: venv
	$(VENV)/bin/ansible-playbook -i $(INVENTORY) playbooks/provision.yml $(ANSIBLE_ARGS)

# The test cluster on this machine (root): N hosts tb1..tbN, inventory in .testbed/inventory.yml.
# Figures, not pass/fail: see bench/bench.py. The last line printed is the balanced/ideal ratio.
bench: venv
	$(PY) -m bench.bench run $(BENCH_ARGS)

# One 3-stage pipeline on 3 emulated devices (1.0 / 0.6 / 0.5): the planner's layer split vs an equal one vs the
# bubble-free bound (bench/pipeline.py, docs/pipeline.md "Benchmark"). The last line printed is a JSON object.
bench-pipeline: venv
	$(PY) -m bench.pipeline $(BENCH_ARGS)

# The default job in 3 pipeline stages across the 3-host test cluster (each host's memory capped below the whole
# model's need) against data parallel: held-out loss, tokens/s, peak memory, bytes per step (root).
bench-pipeline-cluster: venv
	$(PY) -m bench.pipeline_cluster $(BENCH_ARGS)

bench-ddp-init: venv
	$(PY) -m bench.ddp_init run $(BENCH_ARGS)

# Launch -> first step, and a lost host -> first step on the survivors, on the 3-host test cluster (root).
bench-recovery: venv
	$(PY) -m bench.recovery $(BENCH_ARGS)

# make train on the 3-host test cluster, its fast checks included, to the first step: fresh hosts, the same hosts
# again (the launch reads the checks' facts), and without the checks (needs root).
bench-launch: venv
	$(PY) -m bench.launch

# The CPU one host spends to start a rank and run one step: torchrun starting `-m train.worker` anew, against a
# launcher that imported the stack once and forks its rank (bench/rank_start.py). The last line is a JSON object.
bench-rank-start: venv
	$(PY) -m bench.rank_start $(BENCH_ARGS)

# The default job with model.quantization 4bit against the same job unquantized (same seed): held-out and
# training loss side by side. BENCH_ARGS="--variants none-float32,4bit-float32,4bit-bfloat16 --steps 24".
bench-4bit: venv
	$(PY) -m bench.quantization $(BENCH_ARGS)

# The loss of a Qwen2.5-sized head (vocabulary 151,936, seq 1024, micro-batch 4, fp32) from its full logits against
# the loss from hidden states (train/model/headloss.py), each path in its own process: peak memory, time, differences.
# BENCH_ARGS="--head lora" for LoRA (r 16) on the head; the last line printed is a JSON object.
bench-headloss: venv
	$(PY) -m bench.headloss $(BENCH_ARGS)

# The node exporter's CPU cost at one scrape every 5 s (a real exporter process, real HTTP scrapes).
bench-exporter: venv
	$(PY) -m bench.exporter $(BENCH_ARGS)

# TESTBED_DIR: where its state lives (one test cluster per directory); SUBNET: its own (auto: the first free one).
TESTBED_DIR ?= .testbed
testbed-up: venv
	$(PY) -m testbed up --hosts $(or $(N),3) --dir $(TESTBED_DIR) $(if $(SUBNET),--subnet $(SUBNET)) $(if $(ROOTFS),--rootfs)

testbed-down:
	$(PY) -m testbed down --dir $(TESTBED_DIR)

# Every lock from its .in, for every Python a node may run (requirements/locks/py3.X/), with the pinned uv
# from the registry alone (~1 min, mostly the index's answers).
lock: venv
	$(PY) -m tools.lock

clean:
	rm -rf runs .pytest_cache

# Every role's README from its meta/argument_specs.yml, defaults and tasks/main.yml (hand-written part kept);
# tests/test_role_docs.py fails on a README that differs from what this writes.
role-docs: venv
	$(PY) -m tools.role_docs
