"""Which memory profile a node of a batch scheduler uses: the profile map (``jobs/profile-map.yml``).

On the LAN, role ``memory_profile`` renders one profile per host. Under SLURM and Kubernetes there is
no per-host inventory, so a map says which profile a node gets:

* ``profiles``: the profiles by name (rank-local knobs only). Absent: the LAN's own,
  ``memory_profile_profiles`` in ``roles/memory_profile/defaults/main.yml``;
* ``match``: SLURM's rules, the first that matches a node wins: ``gpu`` (the node's GRES type,
  ``gpu:<type>:N``, or a part of the name nvidia-smi gives its GPU, case-insensitive) or ``feature``
  (a node feature, ``Features=`` in slurm.conf), and the ``profile`` it gets;
* ``default``: the profile of a node no rule matches;
* ``node_selectors``: Kubernetes' ``nodeSelector`` of each profile's pods (node labels, e.g. from
  NVIDIA's GPU feature discovery).

Everything is checked before a script or manifest is written: every profile with the trainer's own
``check_profile`` and merged over the job (``apply_profile``), every rule and name; an error names
the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.config import ConfigError, JobConfig, apply_profile, check_profile

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MAP = Path("jobs/profile-map.yml")
LAN_PROFILES = REPO / "roles" / "memory_profile" / "defaults" / "main.yml"
KEYS = ("profiles", "match", "default", "node_selectors")
MATCH_KINDS = ("gpu", "feature")
# A profile name becomes a file name and a Kubernetes object name.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,40}\Z")
# Kubernetes label keys ([prefix/]name) and values.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class Rule:
    kind: str  # gpu | feature
    value: str
    profile: str


@dataclass(frozen=True)
class ProfileMap:
    source: str  # the file, for messages
    profiles: dict[str, dict[str, Any]]
    match: list[Rule] = field(default_factory=list)
    default: str = "cpu"
    node_selectors: dict[str, dict[str, str]] = field(default_factory=dict)


def _read(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the profile map ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def lan_profiles() -> dict[str, Any]:
    """The LAN's profiles: role memory_profile's default ``memory_profile_profiles``."""
    raw = _read(LAN_PROFILES)
    profiles = raw.get("memory_profile_profiles") if isinstance(raw, dict) else None
    if not isinstance(profiles, dict):
        raise ConfigError(f"{LAN_PROFILES}: no memory_profile_profiles mapping")
    return profiles


def _profiles(raw: Any, where: str, job: JobConfig) -> dict[str, dict[str, Any]]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: a mapping of profile name -> rank-local knobs, not {raw!r}")
    checked: dict[str, dict[str, Any]] = {}
    for name, knobs in raw.items():
        key = f"{where}.{name}"
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(f"{key}: a profile name is letters, digits, '_' and '-' (at most 41 characters)")
        checked[name] = check_profile(knobs if knobs is not None else {}, key)
        apply_profile(job, checked[name], key)  # e.g. a token budget smaller than one sequence of this job
    return checked


def _known(name: Any, key: str, profiles: dict[str, Any]) -> str:
    if not isinstance(name, str) or name not in profiles:
        raise ConfigError(f"{key}: {name!r} is not one of the profiles ({', '.join(profiles)})")
    return name


def _rules(raw: Any, source: str, profiles: dict[str, Any]) -> list[Rule]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{source}: key 'match': a list of rules such as {{gpu: 'RTX 4070', profile: gpu_8gb}}")
    rules = []
    for i, item in enumerate(raw):
        key = f"match[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{source}: key '{key}': a rule is a mapping such as {{gpu: RTX 4070, profile: gpu_8gb}}")
        unknown = sorted(str(k) for k in set(item) - {*MATCH_KINDS, "profile"})
        if unknown:
            raise ConfigError(f"{source}: unknown key '{key}.{unknown[0]}' (a rule has gpu or feature, and profile)")
        kinds = [k for k in MATCH_KINDS if k in item]
        if len(kinds) != 1:
            raise ConfigError(f"{source}: key '{key}': a rule matches on exactly one of gpu or feature, not {kinds}")
        value = item[kinds[0]]
        if not isinstance(value, str) or not value.strip() or "'" in value or "\n" in value:
            raise ConfigError(
                f"{source}: key '{key}.{kinds[0]}': a non-empty string without quotes or newlines, not {value!r}"
            )
        if "profile" not in item:
            raise ConfigError(f"{source}: missing key '{key}.profile'")
        profile = _known(item["profile"], f"{source}: key '{key}.profile'", profiles)
        rules.append(Rule(kinds[0], value.strip(), profile))
    return rules


def _selectors(raw: Any, source: str, profiles: dict[str, Any]) -> dict[str, dict[str, str]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: key 'node_selectors': a mapping of profile -> {{label: value}}")
    selectors: dict[str, dict[str, str]] = {}
    for name, labels in raw.items():
        key = f"node_selectors.{name}"
        _known(name, f"{source}: key '{key}'", profiles)
        labels = labels or {}
        if not isinstance(labels, dict):
            raise ConfigError(f"{source}: key '{key}': a mapping of node label -> value, not {labels!r}")
        for label, value in labels.items():
            if not isinstance(label, str) or not LABEL_KEY.match(label):
                raise ConfigError(f"{source}: key '{key}': {label!r} is not a Kubernetes label key")
            if not isinstance(value, str | int) or isinstance(value, bool) or not LABEL_VALUE.match(str(value)):
                raise ConfigError(f"{source}: key '{key}.{label}': {value!r} is not a Kubernetes label value")
        selectors[name] = {str(k): str(v) for k, v in labels.items()}
    return selectors


def load(path: Path, job: JobConfig) -> ProfileMap:
    """The profile map in ``path``, checked against ``job``; ConfigError names the file and the key."""
    raw = _read(path)
    source = str(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a mapping with keys {', '.join(KEYS)}, not {type(raw).__name__}")
    unknown = sorted(str(k) for k in set(raw) - set(KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown key '{unknown[0]}' (the keys are {', '.join(KEYS)})")
    if "profiles" in raw:
        profiles = _profiles(raw["profiles"], f"{source}: profiles", job)
    else:
        profiles = _profiles(lan_profiles(), f"{LAN_PROFILES.relative_to(REPO)}: memory_profile_profiles", job)
    default = _known(raw.get("default", "cpu"), f"{source}: key 'default'", profiles)
    return ProfileMap(
        source, profiles, _rules(raw.get("match"), source, profiles), default,
        _selectors(raw.get("node_selectors"), source, profiles),
    )  # fmt: skip


def profile_text(profile_map: ProfileMap, name: str) -> str:
    """A profile as the file every rank loads with ``--profile`` (train.config.load_profile)."""
    header = f"# Memory profile {name} from {profile_map.source}: rank-local knobs only (RankLocalConfig).\n"
    return header + yaml.safe_dump(profile_map.profiles[name], sort_keys=True)
