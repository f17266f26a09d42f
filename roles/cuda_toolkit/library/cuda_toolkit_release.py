#!/usr/bin/python
"""Ansible module (role cuda_toolkit): every package of one CUDA toolkit release, each at the version that release
shipped, read from the apt cache."""
# ruff: noqa: E402  (DOCUMENTATION and RETURN come before the imports, as ansible-doc expects: library/'s rule)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: cuda_toolkit_release
short_description: Every package of one CUDA toolkit release, at the version that release shipped
description:
  - NVIDIA's C(cuda-toolkit-X-Y) metapackage depends on the release's other metapackages and they on the component
    packages (C(cuda-nvcc-X-Y), C(cuda-cudart-X-Y), C(libcublas-X-Y), ...), each C(>=) the version that release
    shipped (a component's own version, such as 13.0.88 for nvcc in toolkit 13.0.2). Left to apt, a later X.Y.z
    release's components satisfy them too, and apt takes those.
  - Reads O(name) at the upstream version O(version) from the apt cache (C(apt-cache show)) and follows its
    C(Depends) and C(Pre-Depends); each dependency that names a version is taken at the oldest version the cache has
    that satisfies it (for NVIDIA's, the version the release shipped) and followed in turn.
  - A dependency without a version (NVIDIA's configuration packages, shared by every release) is not followed; it is
    returned in C(unversioned), left to apt.
  - Reads only; fails, naming the versions there are, when the cache has no O(name) at O(version) or nothing that
    satisfies a dependency.
options:
  name:
    description: The toolkit's metapackage, such as C(cuda-toolkit-13-0).
    type: str
    required: true
  version:
    description: Its upstream version, such as C(13.0.2) (no Debian revision); of several revisions the newest.
    type: str
    required: true
author: ugro
"""

EXAMPLES = r"""
- name: Find the packages of CUDA 13.0.2
  cuda_toolkit_release:
    name: cuda-toolkit-13-0
    version: 13.0.2
  register: release
"""

RETURN = r"""
packages:
  description: Every package of the release (O(name) first) -> its Debian version.
  type: dict
  returned: success
  sample: {"cuda-toolkit-13-0": "13.0.2-1", "cuda-nvcc-13-0": "13.0.88-1"}
unversioned:
  description: The dependencies that name no version, not followed.
  type: list
  elements: str
  returned: success
"""

import functools
import re
from collections.abc import Callable, Iterable

from ansible.module_utils.basic import AnsibleModule

Reader = Callable[[list[str]], None]

_DEPENDENCY = re.compile(r"^([a-z0-9][a-z0-9+.-]*)(?::[a-z0-9-]+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?")


def _order(c: str) -> int:
    if c == "~":
        return -1
    if c == "" or c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: an upstream version or revision against another."""
    i = j = 0
    while i < len(a) or j < len(b):
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac, bc = _order(a[i] if i < len(a) else ""), _order(b[j] if j < len(b) else "")
            if ac != bc:
                return ac - bc
            i, j = i + 1, j + 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        first_diff = 0
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            first_diff = first_diff or ord(a[i]) - ord(b[j])
            i, j = i + 1, j + 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


def _split(version: str) -> tuple[int, str, str]:
    epoch, _, rest = version.rpartition(":") if ":" in version else ("0", "", version)
    upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
    return int(epoch or 0), upstream, revision


def compare(a: str, b: str) -> int:
    """Debian version order: negative, zero or positive as `a` is older than, the same as or newer than `b`."""
    (ea, ua, ra), (eb, ub, rb) = _split(a), _split(b)
    return (ea - eb) or _compare_part(ua, ub) or _compare_part(ra, rb)


def satisfies(version: str, op: str, bound: str) -> bool:
    c = compare(version, bound)
    return {"<<": c < 0, "<=": c <= 0, "<": c <= 0, "=": c == 0, ">=": c >= 0, ">": c >= 0, ">>": c > 0}[op]


def parse_show(text: str) -> dict[str, dict[str, list[str]]]:
    """`apt-cache show` output -> package -> version -> its dependencies (Pre-Depends and Depends, as written)."""
    found: dict[str, dict[str, list[str]]] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"(?m)^([A-Za-z-]+):[ \t]*(.*)$", stanza))
        if "Package" not in fields or "Version" not in fields:
            continue
        depends = [d.strip() for key in ("Pre-Depends", "Depends") for d in fields.get(key, "").split(",")]
        found.setdefault(fields["Package"], {})[fields["Version"]] = [d for d in depends if d]
    return found


def _oldest_first(versions: Iterable[str]) -> list[str]:
    return sorted(versions, key=functools.cmp_to_key(compare))


def release(name: str, version: str, show: dict[str, dict[str, list[str]]], read: Reader) -> dict[str, object]:
    """The packages of the release of `name` at upstream `version`. `show` holds what apt-cache showed (package ->
    version -> dependencies); `read` adds the packages named to it."""
    read([name])
    versions = _oldest_first(v for v in show.get(name, {}) if _split(v)[1] == version)
    if not versions:
        there = ", ".join(_oldest_first(show.get(name, {}))) or "none"
        raise ReleaseError(f"{name} {version} is not in the apt cache (versions there: {there})")
    packages = {name: versions[-1]}
    needs: dict[str, list[tuple[str, str, str]]] = {}  # dependency -> (op, bound, who asks)
    unversioned: set[str] = set()
    todo = [name]
    while todo:
        asked: set[str] = set()
        for package in todo:
            for dependency in show[package][packages[package]]:
                match = _DEPENDENCY.match(dependency.split("|")[0].strip())
                if not match:
                    continue
                dep, op, bound = match.groups()
                if op is None:
                    unversioned.add(dep)
                    continue
                needs.setdefault(dep, []).append((op, bound, f"{package} {packages[package]}"))
                asked.add(dep)
        read(sorted(asked - set(show)))
        todo = []
        for dep in sorted(asked):
            fits = _oldest_first(v for v in show.get(dep, {}) if all(satisfies(v, o, b) for o, b, _ in needs[dep]))
            if not fits:
                wants = "; ".join(f"{who} needs {dep} ({o} {b})" for o, b, who in needs[dep])
                there = ", ".join(_oldest_first(show.get(dep, {}))) or "none"
                raise ReleaseError(f"{wants}, which the apt cache does not hold (versions there: {there})")
            if packages.get(dep) != fits[0]:
                packages[dep] = fits[0]
                todo.append(dep)
    return {"packages": packages, "unversioned": sorted(unversioned - set(packages))}


class ReleaseError(Exception):
    """The release cannot be read from the apt cache."""


def main() -> None:
    module = AnsibleModule(
        argument_spec={"name": {"type": "str", "required": True}, "version": {"type": "str", "required": True}},
        supports_check_mode=True,
    )
    show: dict[str, dict[str, list[str]]] = {}

    def read(names: list[str]) -> None:
        if names:
            # Exit status 100 where one of them is unknown (a virtual package): the others are still shown.
            _, out, _ = module.run_command(["apt-cache", "show", *names], environ_update={"LC_ALL": "C"})
            for package, versions in parse_show(out).items():
                show.setdefault(package, {}).update(versions)
            for package in names:
                show.setdefault(package, {})

    try:
        found = release(module.params["name"], module.params["version"], show, read)
    except ReleaseError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
