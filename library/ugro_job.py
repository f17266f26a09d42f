#!/usr/bin/python
"""Ansible module: start a ugro job on a host, or stop its own processes there and confirm they are gone."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_job
short_description: Start a ugro job on a host, or stop its own processes there
description:
  - With O(state=started), writes O(script) as the host's launch script (C(runs/<job>/hosts/<host>/launch.sh)),
    clears the pid file, exit status and stop mark of an earlier launch of the run, starts the script in a
    session of its own, waits up to O(start_timeout_s) seconds for it to write its process group id
    (C(launch.pid)), and records the job in C(runs/active-job). One round trip for what a launch does on a
    host; checking that the host may start the job (M(ugro_host_facts) C(job)) comes before it, on every host.
  - With O(state=stopped), sends SIGTERM to the job's recorded process group (C(runs/<job>/hosts/<host>/launch.pid))
    and recorded worker pids (C(worker-rank<N>.pid)), waits O(grace_s) seconds, sends SIGKILL to those left, and
    fails when one survives.
  - A recorded pid counts as the job's only while its command line names the run directory, so a pid reused by
    another process is never signalled; nothing is ever matched by name (module_utils C(ugro_jobstate), the same
    code the job's state in M(ugro_host_facts) comes from).
  - Marks the host's run C(stopped) and clears C(runs/active-job) when it names this job.
  - In check mode, reports what it would signal.
  - Needs psutil in the Python that runs the module (Debian/Ubuntu package C(python3-psutil)).
options:
  code_dir:
    description: The code directory on the host; the run is C(<code_dir>/runs/<job_id>).
    type: path
    required: true
  job_id:
    description: The job id, such as C(default-20261121-190000).
    type: str
    required: true
  host:
    description: Inventory name of the host (C(inventory_hostname)), which names its directory of the run.
    type: str
    required: true
  state:
    description: C(started) launches the job, C(stopped) stops it.
    type: str
    choices: [started, stopped]
    default: stopped
  script:
    description: The launch script's text (rendered on the controller); required with O(state=started).
    type: str
  job_key:
    description: With O(state=started), the run's key (64 hex digits, made by the controller), written to
      C(runs/<job>/job.key) (mode 0600) before the job starts; its ranks prove to each other with it what they write
      to a store (train/recovery/jobkey.py).
    type: str
  start_timeout_s:
    description: Seconds the started script has to write its pid file.
    type: float
    default: 30
  grace_s:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 30
author: ugro
"""

EXAMPLES = r"""
- name: Start the job on this host
  ugro_job:
    code_dir: /opt/ugro
    job_id: default-20261121-190000
    host: "{{ inventory_hostname }}"
    state: started
    script: "{{ lookup('ansible.builtin.template', 'ugro-launch.sh.j2') }}"

- name: Stop the job on this host
  ugro_job:
    code_dir: /opt/ugro
    job_id: default-20261121-190000
    host: "{{ inventory_hostname }}"
    state: stopped
"""

RETURN = r"""
pgid:
  description: The started job's process group id (the launch script's pid).
  type: int
  returned: when O(state=started)
  sample: 4242
log:
  description: torchrun's log on the host.
  type: str
  returned: when O(state=started)
signalled:
  description: The job's processes that were alive and got SIGTERM, name to pid (C(launcher) is the process group).
  type: dict
  returned: when O(state=stopped)
  sample: {launcher: 4242, worker-rank0: 4300}
killed:
  description: Those still alive after O(grace_s) seconds, which got SIGKILL.
  type: dict
  returned: when O(state=stopped)
remaining:
  description: Those still alive 10 s after SIGKILL (the module then fails).
  type: dict
  returned: when O(state=stopped)
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ugro_jobkey import write as write_job_key
from ansible.module_utils.ugro_jobstate import HAS_PSUTIL, JOB_ID, job_pids, psutil_missing, start, stop


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "code_dir": {"type": "path", "required": True},
            "job_id": {"type": "str", "required": True},
            "host": {"type": "str", "required": True},
            "state": {"type": "str", "choices": ["started", "stopped"], "default": "stopped"},
            "grace_s": {"type": "float", "default": 30.0},
            "script": {"type": "str"},
            "start_timeout_s": {"type": "float", "default": 30.0},
            "job_key": {"type": "str", "no_log": True},
        },
        required_if=[("state", "started", ["script"])],
        supports_check_mode=True,
    )
    host, job_id = module.params["host"], module.params["job_id"]
    if not HAS_PSUTIL:
        module.fail_json(msg=psutil_missing(host, "ugro_job"))
    if not JOB_ID.match(job_id):
        module.fail_json(msg=f"{host}: job_id '{job_id}' is not a job id such as default-20261121-190000")
    if module.params["grace_s"] < 0:
        module.fail_json(msg=f"{host}: grace_s must be 0 or more seconds, not {module.params['grace_s']:g}")
    run_dir = Path(module.params["code_dir"]) / "runs" / job_id
    if module.params["state"] == "started":
        if module.check_mode:
            module.exit_json(changed=True)
        try:
            if module.params["job_key"]:
                write_job_key(run_dir, module.params["job_key"])
            started = start(run_dir, host, module.params["script"], module.params["start_timeout_s"])
        except (OSError, RuntimeError, ValueError) as exc:
            module.fail_json(msg=f"{host}: job {job_id} did not start: {exc}")
        module.exit_json(changed=True, **started)
    if module.check_mode:
        alive = job_pids(run_dir, host)
        module.exit_json(changed=bool(alive), signalled=alive, killed={}, remaining={})
    result = stop(run_dir, host, module.params["grace_s"])
    if result["remaining"]:
        pids = ", ".join(f"{name} {pid}" for name, pid in sorted(result["remaining"].items()))
        module.fail_json(msg=f"{host}: processes of job {job_id} survived SIGKILL: {pids}", changed=True, **result)
    module.exit_json(changed=bool(result["signalled"]), **result)


if __name__ == "__main__":
    main()
