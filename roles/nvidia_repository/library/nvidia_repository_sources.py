#!/usr/bin/python
"""Ansible module (role nvidia_repository): every other apt source of one repository URL taken out, so that apt
reads the repository from one file only."""
# ruff: noqa: E402  (DOCUMENTATION and RETURN come before the imports, as ansible-doc expects: library/'s rule)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_repository_sources
short_description: Take every other apt source of a repository URL out, so that the repository is configured once
description:
  - Reads O(sources_list) and every C(*.list) and C(*.sources) file in O(sources_dir) except O(keep), and finds the
    enabled entries whose URI is O(url), whatever their options or file name (C(add-apt-repository)'s
    C(archive_uri-*.list), NVIDIA's C(cuda-*.list), a hand-written deb822 file). Two entries for one URL with
    different C(Signed-By) make apt refuse every command (C(Conflicting values set for option Signed-By)); the
    same one twice makes apt warn.
  - URIs compare without trailing slashes, with the scheme and host in any case, http and https alike.
  - A file that holds nothing else is removed. Otherwise a one-line entry is commented out under a note naming
    O(keep), and a deb822 stanza is removed (or, with other URIs beside, loses that URI); the file's other
    entries stay as they were. Commented-out lines and stanzas with C(Enabled: no) are left alone.
options:
  url:
    description: The repository's URI.
    type: str
    required: true
  keep:
    description: The source file that configures the repository, never read or changed.
    type: path
    required: true
  sources_list:
    description: The main one-line sources file (it is never removed).
    type: path
    default: /etc/apt/sources.list
  sources_dir:
    description: The directory of further sources files.
    type: path
    default: /etc/apt/sources.list.d
author: ugro
"""

EXAMPLES = r"""
- name: Take other sources of NVIDIA's repository out
  nvidia_repository_sources:
    url: https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/
    keep: /etc/apt/sources.list.d/cuda.sources
"""

RETURN = r"""
entries:
  description: Each entry taken out, as C(file: entry).
  type: list
  elements: str
  returned: always
removed:
  description: The files removed (they held nothing else).
  type: list
  elements: str
  returned: always
edited:
  description: The files that keep other entries.
  type: list
  elements: str
  returned: always
"""

import os
import re
import tempfile

from ansible.module_utils.basic import AnsibleModule

_ONE_LINE = re.compile(r"^\s*(?:deb|deb-src)\s+(?:\[[^\]]*\]\s*)?(\S+)")
_FIELD = re.compile(r"^([^\s:#][^:]*):(.*)$")


def normalize(uri: str) -> str:
    """A URI as apt would reach the same repository: no trailing slash, scheme and host lower case, https as http,
    file:/x as file:///x."""
    uri = uri.strip()
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", uri)
    if not match:
        return uri.rstrip("/")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        return "file://" + ("/" + rest.lstrip("/")).rstrip("/")
    if scheme == "https":
        scheme = "http"
    if rest.startswith("//"):
        host, _, path = rest[2:].partition("/")
        rest = "//" + host.lower() + ("/" + path if path else "")
    return f"{scheme}:{rest.rstrip('/')}"


def clear_one_line(text: str, url: str, note: str, main: bool) -> tuple[str | None, list[str]]:
    """A one-line sources file without the entries of `url`: (new text, or None to remove the file; entries)."""
    lines = text.splitlines()
    entries: list[str] = []
    out: list[str] = []
    others = False
    for line in lines:
        match = _ONE_LINE.match(line)
        if match and normalize(match.group(1)) == url:
            entries.append(line.strip())
            out.extend([note, "# " + line.strip()])
        else:
            out.append(line)
            others = others or bool(line.strip() and not line.lstrip().startswith("#"))
    if not entries:
        return text, []
    if not others and not main:
        return None, entries
    return "\n".join(out) + "\n", entries


def _paragraphs(text: str) -> list[list[str]]:
    paragraphs: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip():
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    return [p for p in paragraphs if p]


def _fields(paragraph: list[str]) -> dict[str, tuple[int, int, str]]:
    """Field name (lower case) -> (first line, line after its last, value) of a deb822 stanza."""
    fields: dict[str, tuple[int, int, str]] = {}
    name, start, value = None, 0, ""
    for i, line in enumerate([*paragraph, "End:"]):
        if line.startswith("#"):
            continue
        if line[:1] in (" ", "\t") and name is not None:
            value += " " + line.strip()
            continue
        if name is not None:
            fields[name] = (start, i, value.strip())
        match = _FIELD.match(line)
        name, start, value = (match.group(1).strip().lower(), i, match.group(2)) if match else (None, i, "")
    return fields


def clear_deb822(text: str, url: str) -> tuple[str | None, list[str]]:
    """A deb822 sources file without the enabled stanzas (or URIs) of `url`: (new text, or None; entries)."""
    entries: list[str] = []
    kept: list[list[str]] = []
    for paragraph in _paragraphs(text):
        fields = _fields(paragraph)
        uris = fields.get("uris", (0, 0, ""))[2].split()
        enabled = fields.get("enabled", (0, 0, "yes"))[2].lower() not in ("no", "false", "0")
        ours = [uri for uri in uris if normalize(uri) == url]
        if not enabled or not ours:
            kept.append(paragraph)
            continue
        entries.append("URIs: " + " ".join(ours))
        others = [uri for uri in uris if normalize(uri) != url]
        if others:
            start, end, _ = fields["uris"]
            kept.append([*paragraph[:start], "URIs: " + " ".join(others), *paragraph[end:]])
    if not entries:
        return text, []
    if not any(_fields(paragraph) for paragraph in kept):
        return None, entries
    return "\n\n".join("\n".join(paragraph) for paragraph in kept) + "\n", entries


def _write(module: AnsibleModule, path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".ugro-")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    module.atomic_move(tmp, path)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "keep": {"type": "path", "required": True},
            "sources_list": {"type": "path", "default": "/etc/apt/sources.list"},
            "sources_dir": {"type": "path", "default": "/etc/apt/sources.list.d"},
        },
        supports_check_mode=True,
    )
    params = module.params
    url, keep = normalize(params["url"]), os.path.realpath(params["keep"])
    note = f"# Disabled by ugro (role nvidia_repository): this repository's source is {params['keep']}."
    paths = [params["sources_list"]]
    if os.path.isdir(params["sources_dir"]):
        names = sorted(os.listdir(params["sources_dir"]))
        paths += [os.path.join(params["sources_dir"], n) for n in names if n.endswith((".list", ".sources"))]
    result: dict[str, list[str]] = {"entries": [], "removed": [], "edited": []}
    diffs = []
    for path in paths:
        if not os.path.isfile(path) or os.path.realpath(path) == keep:
            continue
        with open(path, encoding="utf-8", errors="surrogateescape") as handle:
            text = handle.read()
        if path.endswith(".sources"):
            new, entries = clear_deb822(text, url)
        else:
            new, entries = clear_one_line(text, url, note, main=path == params["sources_list"])
        if not entries:
            continue
        result["entries"] += [f"{path}: {entry}" for entry in entries]
        result["removed" if new is None else "edited"].append(path)
        diffs.append({"before_header": path, "after_header": path, "before": text, "after": new or ""})
        if module.check_mode:
            continue
        if new is None:
            os.remove(path)
        else:
            _write(module, path, new)
    module.exit_json(changed=bool(result["entries"]), diff=diffs, **result)


if __name__ == "__main__":
    main()
