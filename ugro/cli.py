"""The ``ugro`` command, which the Makefile's targets call: it parses the options and prints; the work is elsewhere.
One module per command in ugro/commands/, each registering itself; this module builds the app from them.

train, follow, validate            a job on the inventory's hosts (ugro/run/, ugro/checks/prelaunch.py, jobcheck.py)
plan                               which rank holds which layers: data parallel or pipeline stages (ugro/checks/plan.py)
preflight, doctor                  checks before a launch and after a failure (ugro/checks/)
status, logs, stop                 a running or finished job on its hosts (playbooks/)
export, chat                       use the run's model: merged, GGUF for llama.cpp / Ollama, a chat (ugro/model/)
eval                               lm-evaluation-harness, base vs tuned (ugro/evaluation/)
dashboard, prometheus-config       watching the cluster (ugro/monitoring/)
slurm-script, k8s-manifest         the same job under a batch scheduler (ugro/schedulers/)

Runs go to runs/ of this repository, or to $UGRO_RUNS_DIR (a bigger disk; the tests' temporary directories):
the controller's records, collected logs and results, runs/latest and the playbooks' private directories.
Hosts that run this checkout itself (ugro_code_sync: false, inventory/local.yml) write their runs into its runs/.
"""

from __future__ import annotations

import typer

from ugro.commands import (
    chat,
    dashboard,
    doctor,
    eval,
    export,
    follow,
    k8s_manifest,
    lend,
    logs,
    plan,
    preflight,
    prometheus_config,
    slurm_script,
    status,
    stop,
    train,
    validate,
)

# In the order of `ugro --help`.
COMMANDS = (
    validate,
    plan,
    train,
    follow,
    preflight,
    doctor,
    export,
    eval,
    chat,
    status,
    lend,
    stop,
    logs,
    dashboard,
    prometheus_config,
    slurm_script,
    k8s_manifest,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ugro: LoRA fine-tuning across the GPUs of a LAN.")
for command in COMMANDS:
    command.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
