#!/usr/bin/python
"""Ansible module: the tree hash of the training code on a host, checked against the controller's."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_code_tree
short_description: Prove that a host's training code is the controller's
description:
  - Hashes the files that the last code sync listed in C(.ugro-code-manifest) under O(path) (or, where
    nothing was synced, the synced directories of a checkout) with the same function the controller
    packs with (module_utils C(ugro_codetree)).
  - Fails, naming the first missing file or both hashes, when O(expected) is given and differs.
  - Never changes anything.
options:
  path:
    description: The code directory on the host.
    type: path
    required: true
  expected:
    description: The controller's tree hash; omitted, the module only reports the host's.
    type: str
author: ugro
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
"""

from pathlib import Path

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.ugro_codetree import current_hash, verify


def main() -> None:
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True}, "expected": {"type": "str"}},
        supports_check_mode=True,
    )
    root = Path(module.params["path"])
    actual, why = current_hash(root)
    expected = module.params["expected"]
    if expected:
        why = verify(root, expected)
        if why:
            module.fail_json(msg=why, hash=actual, why=why)
    module.exit_json(changed=False, hash=actual, why=why)


if __name__ == "__main__":
    main()
