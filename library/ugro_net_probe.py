#!/usr/bin/python
"""Ansible module: a real TCP listener and connector between the hosts of a cluster, and their clock offset."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: ugro_net_probe
short_description: Check with real sockets that the hosts of a cluster reach each other
description:
  - Binds every port of O(listen) on O(address) and accepts up to its O(listen[].peers) connections, answering
    each with this host's clock; meanwhile connects to every target of O(connect), each with a timeout of
    O(connect_timeout_s), and measures the target's clock against this host's.
  - Run it on every host of the cluster in the same task, all hosts at once, since the listeners of one host
    are the targets of the others. A refused connection is retried until shortly before O(listen_timeout_s), since a
    peer may not listen yet; a dropped one times out.
  - A port that cannot be bound and a connection that fails are results, not failures; the module fails only
    on bad arguments, naming the argument and the fix.
  - Name resolution and the interface holding the address are host facts (M(ugro_host_facts)).
  - Standard library only; never changes anything.
options:
  address:
    description: This host's cluster address; every listener binds it.
    type: str
    required: true
  listen:
    description: The ports to listen on.
    type: list
    elements: dict
    default: []
    suboptions:
      label:
        description: Name of the listener in the result (for example C(rendezvous)).
        type: str
        required: true
      port:
        description: TCP port (1-65535).
        type: int
        required: true
      peers:
        description: Connections to accept before the listener closes (or O(listen_timeout_s) passes).
        type: int
        required: true
  connect:
    description: The listeners of other hosts (or this one) to connect to, all at once.
    type: list
    elements: dict
    default: []
    suboptions:
      host:
        description: Inventory name of the target, copied into the result.
        type: str
        required: true
      label:
        description: Label of the target's listener, copied into the result.
        type: str
        required: true
      address:
        description: Address to connect to.
        type: str
        required: true
      port:
        description: TCP port (1-65535).
        type: int
        required: true
  connect_timeout_s:
    description: Seconds per connection attempt.
    type: float
    default: 3
  listen_timeout_s:
    description: Seconds a listener waits for its peers; refused connections are retried until shortly before.
    type: float
    default: 10
author: ugro
"""

EXAMPLES = r"""
- name: Listen on the rendezvous port and connect to it from every host.
  ugro_net_probe:
    address: "{{ ugro_cluster_address }}"
    listen: "{{ [{'label': 'rendezvous', 'port': 29500, 'peers': ansible_play_hosts | length}]
      if inventory_hostname == 'tb1' else [] }}"
    connect:
      - {host: tb1, label: rendezvous, address: 10.213.7.11, port: 29500}
  register: net
"""

RETURN = r"""
listen:
  description: Per label of O(listen), the port bound (null when it could not be), the address of every
    peer that connected, and why the port could not be bound (null when it was).
  type: dict
  returned: always
  sample: {ephemeral: {port: 45678, peers: [10.213.7.12, 10.213.7.13], error: null}}
connect:
  description: Per target of O(connect), in order, the target's fields plus C(ok), C(error) (null when ok),
    C(rtt_s) (when ok) and C(offset_s), the target's clock minus this host's in seconds (when ok).
  type: list
  elements: dict
  returned: always
  sample: [{host: tb1, label: rendezvous, address: 10.213.7.11, port: 29500, ok: true, error: null,
            rtt_s: 0.0004, offset_s: -0.0001}]
"""

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC: dict[str, Any] = {
    "address": {"type": "str", "required": True},
    "listen": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {
            "label": {"type": "str", "required": True},
            "port": {"type": "int", "required": True},
            "peers": {"type": "int", "required": True},
        },
    },
    "connect": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {
            "host": {"type": "str", "required": True},
            "label": {"type": "str", "required": True},
            "address": {"type": "str", "required": True},
            "port": {"type": "int", "required": True},
        },
    },
    "connect_timeout_s": {"type": "float", "default": 3.0},
    "listen_timeout_s": {"type": "float", "default": 10.0},
}


def _in_threads(work: Callable[[Any], Any], items: list[Any], timeout_s: float) -> list[Any]:
    """``work(item)`` for every item at once, in daemon threads (a hung one never keeps the module alive);
    None for an item still running after ``timeout_s``."""
    results: list[Any] = [None] * len(items)

    def run(index: int) -> None:
        results[index] = work(items[index])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return results


class Listeners:
    """Every requested port bound on ``address`` at construction; ``serve`` accepts the expected peers."""

    def __init__(self, address: str, wanted: list[dict[str, Any]]) -> None:
        self.result: dict[str, dict[str, Any]] = {}
        self.sockets: dict[str, tuple[socket.socket, int]] = {}
        for item in wanted:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, item["port"]))
                sock.listen(64)
            except OSError as exc:
                sock.close()
                error = f"cannot listen on {address}:{item['port']}: {exc.strerror or exc}"
                self.result[item["label"]] = {"port": None, "peers": [], "error": error}
                continue
            self.sockets[item["label"]] = (sock, item["peers"])
            self.result[item["label"]] = {"port": sock.getsockname()[1], "peers": [], "error": None}

    def serve(self, timeout_s: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s

        def accept(label: str) -> None:
            sock, expected = self.sockets[label]
            peers: list[str] = self.result[label]["peers"]
            with sock:
                while len(peers) < expected and time.monotonic() < deadline:
                    sock.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
                    try:
                        conn, peer = sock.accept()
                    except TimeoutError:
                        continue
                    with conn:
                        conn.settimeout(2)
                        with contextlib.suppress(OSError):
                            conn.sendall(struct.pack("!d", time.time()))
                    peers.append(str(peer[0]))

        _in_threads(accept, list(self.sockets), timeout_s + 1)
        return self.result


def attempt(address: str, port: int, timeout_s: float) -> dict[str, Any]:
    """One connection; reads the 8-byte clock the listener sends."""
    t0 = time.time()
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            data = b""
            while len(data) < 8:
                chunk = conn.recv(8 - len(data))
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return {"ok": False, "error": f"timed out after {timeout_s:g} s (packets dropped: a firewall?)"}
    except ConnectionRefusedError:
        return {"ok": False, "error": "connection refused (nothing listens, or a firewall rejects it)"}
    except OSError as exc:
        return {"ok": False, "error": str(exc.strerror or exc)}
    t1 = time.time()
    result: dict[str, Any] = {"ok": True, "error": None, "rtt_s": t1 - t0}
    if len(data) == 8:
        (remote,) = struct.unpack("!d", data)
        result["offset_s"] = remote - (t0 + t1) / 2  # the peer's clock minus ours
    return result


def connect(targets: list[dict[str, Any]], timeout_s: float, retry_s: float) -> list[dict[str, Any]]:
    """Every target at once; a refused connection is retried for ``retry_s`` (the peer may not listen yet)."""

    def one(target: dict[str, Any]) -> dict[str, Any]:
        retry_until = time.monotonic() + retry_s
        while True:
            result = attempt(target["address"], target["port"], timeout_s)
            if result["ok"] or "refused" not in str(result["error"]) or time.monotonic() >= retry_until:
                return result
            time.sleep(0.1)

    results = _in_threads(one, targets, retry_s + 2 * timeout_s + 1)
    hung = {"ok": False, "error": "no result (the connection attempt hung)"}
    return [{**target, **(result or hung)} for target, result in zip(targets, results, strict=True)]


def bad_arguments(params: dict[str, Any]) -> str | None:
    """Why the arguments cannot be probed, with the fix; None when they can."""
    for option in ("listen", "connect"):
        for item in params[option]:
            if not 1 <= item["port"] <= 65535:
                return f"{option}: port {item['port']} of '{item['label']}' is not a TCP port; give one in 1-65535"
    for item in params["listen"]:
        if item["peers"] < 0:
            return f"listen: '{item['label']}' expects {item['peers']} peers; give 0 or more"
    labels = [item["label"] for item in params["listen"]]
    if len(set(labels)) != len(labels):
        return f"listen: the labels {labels} repeat; give every listener its own label"
    for option in ("connect_timeout_s", "listen_timeout_s"):
        if params[option] <= 0:
            return f"{option} is {params[option]:g}; give a positive number of seconds"
    try:
        socket.inet_aton(params["address"])
    except OSError:
        return f"address '{params['address']}' is not an IPv4 address; give this host's cluster address"
    return None


def probe(params: dict[str, Any]) -> dict[str, Any]:
    """Listen and connect at once; returns the module's result."""
    timeout_s, listen_s = params["connect_timeout_s"], params["listen_timeout_s"]
    listeners = Listeners(params["address"], params["listen"])  # bound before anyone connects, even this host
    server = threading.Thread(target=listeners.serve, args=(listen_s,), daemon=True)
    server.start()
    # Peers start within a second or two of each other: a refused connection is retried meanwhile.
    connected = connect(params["connect"], timeout_s, max(0.0, listen_s - timeout_s - 1))
    server.join(listen_s + 2)
    return {"listen": listeners.result, "connect": connected}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    why = bad_arguments(module.params)
    if why:
        module.fail_json(msg=why)
    module.exit_json(changed=False, **probe(module.params))


if __name__ == "__main__":
    main()
