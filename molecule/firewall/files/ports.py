#!/usr/bin/env python3
"""Test helper of the firewall scenario (runs on the controller, inside a host's netns or not).

ports.py listen ADDRESS PORT... [--expect N] [--timeout S]
    listen on every port; exit after N accepted connections or S seconds.
ports.py connect ADDRESS PORT... [--source ADDR] [--retry S]
    connect to every port (from ADDR when given) and print {port: accepted|refused|timeout|error};
    --retry keeps retrying a refused port for S seconds (the listener may still be starting).
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time


def listen(address: str, ports: list[int], expect: int, timeout: float) -> int:
    sel = selectors.DefaultSelector()
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(16)
        sel.register(sock, selectors.EVENT_READ)
    accepted = 0
    deadline = time.monotonic() + timeout
    while accepted < expect and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            conn, _peer = key.fileobj.accept()  # type: ignore[union-attr]
            conn.close()
            accepted += 1
    print(json.dumps({"accepted": accepted}))
    return 0


def connect_once(address: str, port: int, source: str | None) -> str:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(3)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect((address, port))
        return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"
    finally:
        sock.close()


def connect(address: str, ports: list[int], source: str | None, retry: float) -> int:
    results = {}
    for port in ports:
        deadline = time.monotonic() + retry
        result = connect_once(address, port, source)
        while result == "refused" and time.monotonic() < deadline:
            time.sleep(0.2)
            result = connect_once(address, port, source)
        results[str(port)] = result
    print(json.dumps(results))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["listen", "connect"])
    parser.add_argument("address")
    parser.add_argument("ports", type=int, nargs="+")
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--source")
    parser.add_argument("--retry", type=float, default=0.0)
    args = parser.parse_args()
    if args.mode == "listen":
        return listen(args.address, args.ports, args.expect, args.timeout)
    return connect(args.address, args.ports, args.source, args.retry)


if __name__ == "__main__":
    sys.exit(main())
