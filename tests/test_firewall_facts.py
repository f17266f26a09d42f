"""The `firewall` subset of ugro_host_facts: what preflight's firewall row reads of the live rules, IPv6 included.

The parsers are fed listings of the real formats: `nft -j list table inet ugro` (nftables 1.0.6, a table as role
firewall writes it, with its output chain and rules a host's admin might add) and `ufw status verbose` (ufw 0.36),
whose IPv6 rules follow its IPv4 ones. Molecule's firewall scenarios read the live rules of the test hosts the same
way (molecule/firewall*/tests/test_hosts.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def facts_module() -> ModuleType:
    """library/ugro_host_facts.py imported as Ansible runs it: its module_utils are ugro/module_utils'."""
    saved = dict(sys.modules)
    try:
        for name in ("ugro_checkpoints", "ugro_codetree", "ugro_jobstate", "ugro_kernel"):
            sys.modules[f"ansible.module_utils.{name}"] = importlib.import_module(f"ugro.module_utils.{name}")
        spec = importlib.util.spec_from_file_location("ugro_host_facts_under_test", REPO / "library/ugro_host_facts.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name in set(sys.modules) - set(saved):
            if name.startswith("ansible.module_utils.ugro_"):
                del sys.modules[name]


PORTS = {"set": [29500, {"range": [32768, 60999]}]}
MEMBERS = ["10.0.0.11", "10.0.0.12"]


def _match(protocol: str, field: str, right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": {"payload": {"protocol": protocol, "field": field}}, "right": right}}


def _rule(chain: str, *expr: dict[str, Any]) -> dict[str, Any]:
    return {"rule": {"family": "inet", "table": "ugro", "chain": chain, "expr": list(expr)}}


NFT_LISTING: dict[str, Any] = {
    "nftables": [
        {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
        {"table": {"family": "inet", "name": "ugro"}},
        {"set": {"name": "cluster_sources", "table": "ugro", "type": "ipv4_addr", "elem": [{"range": MEMBERS}]}},
        {"set": {"name": "members", "table": "ugro", "type": "ipv4_addr", "elem": [{"range": MEMBERS}]}},
        {"chain": {"table": "ugro", "name": "input", "type": "filter", "hook": "input", "prio": -10}},
        {"chain": {"table": "ugro", "name": "output", "type": "filter", "hook": "output", "prio": -10}},
        _rule("input", {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}},
              {"accept": None}),
        _rule("input", _match("tcp", "dport", 22), {"accept": None}),
        _rule("input", _match("ip", "saddr", "@cluster_sources"), _match("tcp", "dport", PORTS), {"accept": None}),
        # What a host's admin might add: an IPv6 network, and IPv6 from anywhere (meta nfproto).
        _rule("input", _match("ip6", "saddr", {"prefix": {"addr": "fd00::", "len": 8}}), _match("tcp", "dport", 29500),
              {"accept": None}),
        _rule("input", {"match": {"op": "==", "left": {"meta": {"key": "nfproto"}}, "right": "ipv6"}},
              _match("tcp", "dport", {"range": [32768, 60999]}), {"accept": None}),
        _rule("input", _match("tcp", "dport", PORTS), {"reject": {"type": "tcp reset"}}),
        # The output chain: which local accounts may connect out. Not who reaches the ports from outside.
        _rule("output", _match("tcp", "dport", PORTS),
              {"match": {"op": "!=", "left": {"meta": {"key": "skuid"}}, "right": {"set": [0, 1000]}}},
              {"match": {"op": "==", "left": {"fib": {"result": "type", "flags": ["daddr"]}}, "right": "local"}},
              {"reject": {"type": "tcp reset"}}),
        _rule("output", _match("tcp", "dport", 29500), {"accept": None}),
    ]
}  # fmt: skip


def test_nft_rules_reads_the_input_chain_with_each_rules_address_family(facts_module: ModuleType) -> None:
    assert facts_module.nft_rules(NFT_LISTING) == [
        {"action": "accept", "sources": None, "ports": [[22, 22]], "family": None},
        {"action": "accept", "sources": ["10.0.0.11/32", "10.0.0.12/32"], "ports": [[29500, 29500], [32768, 60999]],
         "family": "ipv4"},
        {"action": "accept", "sources": ["fd00::/8"], "ports": [[29500, 29500]], "family": "ipv6"},
        {"action": "accept", "sources": None, "ports": [[32768, 60999]], "family": "ipv6"},
        {"action": "reject", "sources": None, "ports": [[29500, 29500], [32768, 60999]], "family": None},
    ]  # fmt: skip


UFW_STATUS = """\
Status: active
Logging: on (low)
Default: deny (incoming), allow (outgoing), deny (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
29500/tcp                  ALLOW IN    10.0.0.11
32768:60999/tcp            ALLOW IN    10.0.0.11
22/tcp                     ALLOW IN    Anywhere
29500/tcp                  REJECT IN   Anywhere
32768:60999/tcp            REJECT IN   Anywhere
22/tcp (v6)                ALLOW IN    Anywhere (v6)
29500/tcp                  ALLOW IN    2001:db8::/32
29500/tcp (v6)             REJECT IN   Anywhere (v6)
32768:60999/tcp (v6)       ALLOW IN    Anywhere (v6)
5353/udp (v6)              ALLOW IN    Anywhere (v6)
"""


def test_ufw_rules_reads_the_ipv6_rules_after_the_ipv4_ones(facts_module: ModuleType) -> None:
    found = facts_module.ufw_rules(UFW_STATUS)
    assert (found["active"], found["default_incoming"]) == (True, "deny")
    assert [(r["action"], r["sources"], r["ports"], r["family"]) for r in found["rules"]] == [
        ("accept", ["10.0.0.11/32"], [[29500, 29500]], "ipv4"),
        ("accept", ["10.0.0.11/32"], [[32768, 60999]], "ipv4"),
        ("accept", None, [[22, 22]], "ipv4"),
        ("reject", None, [[29500, 29500]], "ipv4"),
        ("reject", None, [[32768, 60999]], "ipv4"),
        ("accept", None, [[22, 22]], "ipv6"),
        ("accept", ["2001:db8::/32"], [[29500, 29500]], "ipv6"),
        ("reject", None, [[29500, 29500]], "ipv6"),
        ("accept", None, [[32768, 60999]], "ipv6"),
    ]


def test_ufw_ipv6_reads_ufws_ipv6_setting(facts_module: ModuleType, tmp_path: Path) -> None:
    defaults = tmp_path / "ufw"
    defaults.write_text('# /etc/default/ufw\n#IPV6=yes\nIPV6=no\nDEFAULT_INPUT_POLICY="DROP"\n')
    assert facts_module.ufw_ipv6(defaults) is False
    defaults.write_text('IPV6="yes"\n')
    assert facts_module.ufw_ipv6(defaults) is True
    assert facts_module.ufw_ipv6(tmp_path / "missing") is None
