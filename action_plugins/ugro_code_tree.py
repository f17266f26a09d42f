"""Action plugin of the host module ugro_code_tree: send the controller's code archive only where the host's code
differs, and unpack it there in the same task.

Three steps at most, one where the code is already the controller's (the common launch), none where the caller
knows that already (``known``: the host's hash that make train's fast checks read just before): the module hashes the
host's code (and, where it differs, creates the code directory, the archive's landing place); the archive is
sent there; the module unpacks it and verifies the hash. unarchive would take a directory check, a temporary
directory, the transfer, a tar comparison of every member and its removal, plus a task to create the directory
and one to verify.
"""

from __future__ import annotations

import os
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False  # no temporary directory: the archive lands in the code directory, and only when needed

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        args = dict(self._task.args)
        src = args.pop("src", None)
        known = args.pop("known", None)
        if src is None:  # only the hash, or a check against the controller's: the module alone
            return self._module(args, task_vars, result)
        expected = args.get("expected")
        if not expected:
            raise AnsibleActionFail("ugro_code_tree: src needs expected, the controller's tree hash of the archive")
        if known == expected:  # the host's hash was read just before (the fast checks): no round trip at all
            return result | {"changed": False, "hash": known, "why": None}
        source = os.path.expanduser(str(src))
        if not os.path.isfile(source):
            raise AnsibleActionFail(f"ugro_code_tree: the code archive {source} does not exist on the controller")
        before = self._module({**args, "prepare": True}, task_vars, result)
        if before.get("failed") or not before.get("landing"):  # failed, the same code already, or check mode
            return before
        self._transfer_file(source, before["landing"])
        return self._module({**args, "archive": before["landing"]}, task_vars, result)

    def _module(self, args: dict[str, Any], task_vars: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        out = self._execute_module(module_name="ugro_code_tree", module_args=args, task_vars=task_vars)
        return result | out
