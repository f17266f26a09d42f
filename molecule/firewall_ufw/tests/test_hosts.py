"""Role firewall (ufw) on tb1: ufw enabled, SSH allowed, the ports allowed to the subnet and refused elsewhere.

Connections from inside and outside the subnet are verify.yml's (molecule/conftest.py runs it last).
"""

from __future__ import annotations

import re
from typing import Any

testinfra_hosts = ["ansible://tb1"]


def test_ufw_is_active_with_ssh_and_the_cluster_ports(host: Any) -> None:
    assert host.package("ufw").is_installed
    status = host.check_output("ufw status")
    subnet = re.escape(host.ansible.get_variables()["testbed_subnet"])
    assert "Status: active" in status
    assert re.search(r"(?m)^22/tcp\s+ALLOW\s+Anywhere\s*$", status), status
    for port in ("29500", "9840", "32768:60999"):
        assert re.search(rf"(?m)^{port}/tcp\s+ALLOW\s+{subnet}\s*$", status), status
        assert re.search(rf"(?m)^{port}/tcp\s+REJECT\s+Anywhere\s*$", status), status
