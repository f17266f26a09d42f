#!/usr/bin/python
"""Ansible module: a host's logs of a job, and on the main host the run's results, packed into one archive for the
controller (the action plugin of the same name brings it back and unpacks it)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_collect
short_description: Pack a host's logs of a job, and the main host's results, for the controller in one archive
description:
  - Packs into one uncompressed tar, under the names they take in the controller's run directory, the host's
    rank logs (C(logs/*.log) under O(run_dir)), its launcher's log (as C(logs/<host>-torchrun.log)), its failure
    records (C(hosts/<host>/failures.jsonl)) and, with O(results), every file under O(run_dir) whose path matches
    it (the adapter, metrics, TensorBoard events, the loss picture).
  - The action plugin of the same name runs it into a temporary directory on the host, brings the archive back in
    one transfer, unpacks it into O(dest) on the controller and removes it on both sides. One module run and one
    transfer a host, where a fetch a file takes a module run each.
  - With O(paths), exactly those files and directories under O(run_dir) instead (a checkpoint and the run's records,
    which the controller copies while it follows a run); with O(unpack=false) the action plugin keeps the archive
    as the file O(dest).
  - A file that is missing is left out; a host without the job's run directory gives an empty archive.
options:
  run_dir:
    description: The job's run directory on the host.
    type: path
    required: true
  host:
    description: Inventory name of the host (C(inventory_hostname)), which names its launcher's log and failure
      records in the archive.
    type: str
    required: true
  logs:
    description: Whether to pack the rank logs and, with O(results), the results. The launcher's log and the failure
      records are packed either way.
    type: bool
    default: true
  results:
    description: A regular expression searched in each file's path under O(run_dir) (C(*.pid) files excepted); the
      files that match are packed under their path relative to O(run_dir). Omitted, no results are packed.
    type: str
  paths:
    description: Paths relative to O(run_dir) to pack under their own names, a directory with every file under it;
      given, O(logs) and O(results) are not used.
    type: list
    elements: str
  dest:
    description: The controller's run directory of the job, where the action plugin unpacks the archive (with
      O(unpack=false), the file it saves the archive as). Not used by the module.
    type: path
  unpack:
    description: Whether the action plugin unpacks the archive into O(dest) or saves it as O(dest). Not used by the
      module.
    type: bool
    default: true
  archive:
    description: Set by the action plugin, not by playbooks. Where on the host to write the archive.
    type: path
author: ugro
"""

EXAMPLES = r"""
- name: Collect this host's logs and the main host's results
  ugro_collect:
    run_dir: /opt/ugro/runs/default-20261121-190000
    host: "{{ inventory_hostname }}"
    results: "/(adapter/[^/]+|metrics\\.jsonl|run\\.json)$"
    dest: runs/default-20261121-190000
"""

RETURN = r"""
files:
  description: The names packed, as they are unpacked under O(dest).
  type: list
  elements: str
  returned: always
archive:
  description: The archive on the host (removed by the action plugin once brought back).
  type: str
  returned: always
"""

import re
import tarfile
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule


def members(run_dir: Path, host: str, logs: bool, results: str | None) -> dict[str, Path]:
    """Name in the controller's run directory -> the file on this host."""
    found: dict[str, Path] = {}
    if logs:
        found |= {f"logs/{p.name}": p for p in sorted((run_dir / "logs").glob("*.log")) if p.is_file()}
    host_dir = run_dir / "hosts" / host
    for name, path in ((f"logs/{host}-torchrun.log", host_dir / "torchrun.log"),
                       (f"hosts/{host}/failures.jsonl", host_dir / "failures.jsonl")):  # fmt: skip
        if path.is_file():
            found[name] = path
    if logs and results:
        pattern = re.compile(results)
        for path in sorted(run_dir.rglob("*")):
            if path.is_file() and not path.name.endswith(".pid") and pattern.search(str(path)):
                found[path.relative_to(run_dir).as_posix()] = path
    return found


def listed(run_dir: Path, paths: list[str]) -> dict[str, Path]:
    """``paths`` under ``run_dir``, each directory as every file under it (missing ones left out)."""
    found: dict[str, Path] = {}
    for name in paths:
        path = run_dir / name
        if path.is_dir():
            found |= {p.relative_to(run_dir).as_posix(): p for p in sorted(path.rglob("*")) if p.is_file()}
        elif path.is_file():
            found[Path(name).as_posix()] = path
    return found


def pack(archive: Path, files: dict[str, Path]) -> list[str]:
    """The files into an uncompressed tar at ``archive``; the names of those still there when read."""
    packed = []
    with tarfile.open(archive, "w") as tar:
        for name, path in files.items():
            try:
                with path.open("rb") as fh:  # a log still being written: the bytes there when it is read
                    info = tar.gettarinfo(fileobj=fh, arcname=name)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    tar.addfile(info, fh)
            except FileNotFoundError:  # removed since it was listed (a rotated log, a checkpoint pruned)
                continue
            packed.append(name)
    return packed


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "run_dir": {"type": "path", "required": True},
            "host": {"type": "str", "required": True},
            "logs": {"type": "bool", "default": True},
            "results": {"type": "str"},
            "paths": {"type": "list", "elements": "str"},
            "dest": {"type": "path"},  # read by the action plugin only
            "unpack": {"type": "bool", "default": True},  # read by the action plugin only
            "archive": {"type": "path"},  # set by the action plugin
        },
        supports_check_mode=True,
    )
    params = module.params
    if not params["archive"]:
        module.fail_json(msg="ugro_collect: run it as a task (its action plugin names the archive), not alone")
    try:
        run_dir = Path(params["run_dir"])
        if params["paths"] is not None:
            files = listed(run_dir, params["paths"])
        else:
            files = members(run_dir, params["host"], params["logs"], params["results"])
    except re.error as exc:
        module.fail_json(msg=f"ugro_collect: results is not a regular expression ({exc})")
    if module.check_mode:
        module.exit_json(changed=False, files=sorted(files), archive=params["archive"])
    try:
        packed = pack(Path(params["archive"]), files)
    except (OSError, tarfile.TarError) as exc:
        module.fail_json(msg=f"{params['host']}: cannot pack the job's logs into {params['archive']} ({exc}); "
                         "check free disk there, then run make logs again")  # fmt: skip
    module.exit_json(changed=False, files=packed, archive=params["archive"])


if __name__ == "__main__":
    main()
