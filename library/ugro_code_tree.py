#!/usr/bin/python
"""Ansible module: the tree hash of the training code on a host, checked against the controller's, and the
controller's code unpacked where it differs."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_code_tree
short_description: Prove that a host's training code is the controller's, unpacking it where it is not
description:
  - Hashes the files that the last code sync listed in C(.ugro-code-manifest) under O(path) (or, where
    nothing was synced, the synced directories of a checkout) with the same function the controller
    packs with (module_utils C(ugro_codetree)).
  - Fails, naming the first missing file or both hashes, when O(expected) is given and differs.
  - With O(src) (the controller's code archive), where the host's hash differs from O(expected), the action plugin
    of the same name sends the archive and the module unpacks it into O(path) (created if missing; no member may
    leave it) and verifies the hash again. Where the code is already the controller's, nothing is sent or
    changed, in one round trip.
options:
  path:
    description: The code directory on the host.
    type: path
    required: true
  host:
    description: Inventory name of the host (C(inventory_hostname)), which names the host in a failure. Defaults to
      the hostname.
    type: str
  expected:
    description: The controller's tree hash; omitted, the module only reports the host's. Required with O(src).
    type: str
  src:
    description: The code archive (tar.gz with its C(.ugro-code-manifest)) on the controller.
    type: path
  known:
    description: The host's tree hash as the caller learned it just before (make train's fast checks read it). With
      O(src), where it equals O(expected), the action plugin reports the code as the controller's without asking
      the host again; elsewhere it is ignored.
    type: str
  prepare:
    description: Set by the action plugin, not by playbooks. Report the hash and, where it differs from O(expected),
      create O(path) and return C(landing), where the archive is to be sent.
    type: bool
    default: false
  archive:
    description: Set by the action plugin, not by playbooks. The archive sent to the host, unpacked into O(path)
      where the hash differs from O(expected), then removed.
    type: path
author: ugro
"""

EXAMPLES = r"""
- name: Install the controller's code where it differs
  ugro_code_tree:
    path: /opt/ugro
    src: runs/default-20261121-190000/.control/code.tar.gz
    expected: "{{ ugro_code_hash }}"
"""

RETURN = r"""
hash:
  description: The tree hash of the code under O(path), or null when it cannot be computed.
  type: str
  returned: always
why:
  description: Why there is no hash, or why it differs; null when all is well.
  type: str
  returned: always
landing:
  description: Where the action plugin sends the archive (with O(prepare), where the code differs).
  type: str
  returned: sometimes
"""

import os
import socket
import tarfile
from pathlib import Path, PurePosixPath

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ugro_codetree import current_hash, verify

FIX = "check free disk and permissions there, then launch again"
LANDING = ".ugro-code.tar.gz"  # where the action plugin sends the archive, in the code directory; removed once unpacked


def _unsafe(member: tarfile.TarInfo) -> bool:
    parts = PurePosixPath(member.name).parts
    return not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in parts


def unpack(archive: Path, root: Path) -> None:
    """The archive's files into ``root``: regular files and directories only, none outside ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = tar.getmembers()
        bad = [m.name for m in members if _unsafe(m)]
        if bad:
            raise ValueError(f"{archive} holds {len(bad)} member(s) that are not plain files inside it, first {bad[0]}")
        for member in members:
            member.mode = (member.mode | 0o644) & 0o755 if member.isfile() else 0o755
            member.uid, member.gid = os.geteuid(), os.getegid()  # owned by whoever runs the module, as a copy is
            member.uname = member.gname = ""
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, members=members, filter="data")
        else:  # Python before 3.12 without the backport: the members were checked above
            tar.extractall(root, members=members)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "host": {"type": "str"},
            "expected": {"type": "str"},
            "src": {"type": "path"},
            "known": {"type": "str"},  # read by the action plugin only
            # The action plugin's two steps (not for playbooks): prepare reports the hash and, where it differs from
            # expected, creates the code directory and names where the archive lands; archive unpacks what landed.
            "prepare": {"type": "bool", "default": False},
            "archive": {"type": "path"},
        },
        required_by={"src": "expected", "archive": "expected"},
        supports_check_mode=True,
    )
    root = Path(module.params["path"])
    host = module.params["host"] or socket.gethostname()
    expected = module.params["expected"]
    actual, why = current_hash(root)
    if module.params["prepare"]:
        if actual == expected:
            module.exit_json(changed=False, hash=actual, why=None)
        if not module.check_mode:
            root.mkdir(parents=True, exist_ok=True)
        landing = None if module.check_mode else str(root / LANDING)
        module.exit_json(changed=True, hash=actual, why=why, landing=landing)
    archive = module.params["archive"]
    changed = bool(archive) and actual != expected
    try:
        if changed:
            unpack(Path(archive), root)
            actual, why = current_hash(root)
    except (OSError, ValueError, tarfile.TarError) as exc:
        module.fail_json(msg=f"{host}: cannot unpack the training code into {root} ({exc}); {FIX}", changed=True)
    finally:
        if archive:
            Path(archive).unlink(missing_ok=True)
    if expected:
        why = verify(root, expected)
        if why:
            msg = f"{host}: the training code in {root} is not the controller's ({why}); {FIX}"
            module.fail_json(msg=msg, hash=actual, why=why, changed=changed)
    module.exit_json(changed=changed, hash=actual, why=why)


if __name__ == "__main__":
    main()
