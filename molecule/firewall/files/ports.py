#!/usr/bin/env python3
"""Test helper of the firewall scenarios (runs on the controller, inside a host's netns or not, or on a test host).

ports.py listen ADDRESS PORT... [--expect N] [--timeout S]
    listen on every port; exit after N accepted connections or S seconds. ADDRESS "::" listens dual-stack
    (IPv4 and IPv6, as torch's c10d stores do).
ports.py connect ADDRESS PORT... [--source ADDR] [--retry S]
    connect to every port (from ADDR when given) and print {port: accepted|refused|timeout|error};
    --retry keeps retrying a refused port for S seconds (the listener may still be starting). ADDRESS may be
    IPv6, link-local with its interface ("fe80::1%eth0").
ports.py accounts USER,... ADDRESS,... PORT,...
    as root: for each local account, a child process that runs as that account (its uid, gid and groups)
    connects to every address and port; prints {user: {"ADDRESS PORT": accepted|refused|timeout|error}}.
ports.py free ADDRESS LOW HIGH
    print the first port of LOW..HIGH that ADDRESS can listen on.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import selectors
import socket
import sys
import time


def _listening_socket(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack, as the stores listen
    sock.bind((address, port))
    sock.listen(16)
    return sock


def listen(address: str, ports: list[int], expect: int, timeout: float) -> int:
    sel = selectors.DefaultSelector()
    for port in ports:
        sel.register(_listening_socket(address, port), selectors.EVENT_READ)
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
    try:
        family, _, _, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        return f"error: {exc}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(3)
    try:
        if source:
            sock.bind((source, 0))
        sock.connect(target)
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


def _as_account(user: str, addresses: list[str], ports: list[int]) -> dict[str, str]:
    """Connect from a child process that runs as ``user``, the way any program of that account would."""
    entry = pwd.getpwnam(user)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the account, connect, report through the pipe
        try:
            os.close(read_fd)
            os.initgroups(user, entry.pw_gid)
            os.setresgid(entry.pw_gid, entry.pw_gid, entry.pw_gid)
            os.setresuid(entry.pw_uid, entry.pw_uid, entry.pw_uid)
            found = {f"{a} {p}": connect_once(a, p, None) for a in addresses for p in ports}
            os.write(write_fd, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    return dict(json.loads(data)) if data else {"error": f"the child of {user} reported nothing"}


def accounts(users: list[str], addresses: list[str], ports: list[int]) -> int:
    print(json.dumps({user: _as_account(user, addresses, ports) for user in users}))
    return 0


def free(address: str, low: int, high: int) -> int:
    for port in range(low, high + 1):
        try:
            _listening_socket(address, port).close()
        except OSError:
            continue
        print(port)
        return 0
    print(f"no free port in {low}-{high} on {address}", file=sys.stderr)
    return 1


def _split(value: str) -> list[str]:
    return [part for part in value.split(",") if part]


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("listen", "connect"):
        one = sub.add_parser(mode)
        one.add_argument("address")
        one.add_argument("ports", type=int, nargs="+")
        one.add_argument("--expect", type=int, default=1)
        one.add_argument("--timeout", type=float, default=30.0)
        one.add_argument("--source")
        one.add_argument("--retry", type=float, default=0.0)
    many = sub.add_parser("accounts")
    many.add_argument("users", type=_split)
    many.add_argument("addresses", type=_split)
    many.add_argument("ports", type=lambda value: [int(p) for p in _split(value)])
    first = sub.add_parser("free")
    first.add_argument("address")
    first.add_argument("low", type=int)
    first.add_argument("high", type=int)
    args = parser.parse_args()
    if args.mode == "listen":
        return listen(args.address, args.ports, args.expect, args.timeout)
    if args.mode == "connect":
        return connect(args.address, args.ports, args.source, args.retry)
    if args.mode == "accounts":
        return accounts(args.users, args.addresses, args.ports)
    return free(args.address, args.low, args.high)


if __name__ == "__main__":
    sys.exit(main())
