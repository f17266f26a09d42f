"""``python -m testbed up|down``: the test cluster's command line (`make testbed-up`, `make testbed-down`, and
Molecule's create and destroy)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence

from testbed.bringup import DEFAULT_IFNAMES, DEFAULT_SUBNET, up
from testbed.state import DEFAULT_DIR, Testbed, TestbedError
from testbed.teardown import down


def _iter_summary(bed: Testbed) -> Iterator[str]:
    yield f"testbed up in {bed.dir}: bridge {bed.bridge} {bed.bridge_address}/{bed.subnet.split('/')[1]}"
    for h in bed.hosts:
        yield f"  {h.name:5} {h.address:15} {h.interface:8} netns {h.namespace}"
    yield f"inventory: {bed.inventory}"
    yield f"try:       ssh -F {bed.ssh_config} {bed.hosts[0].name} hostname"
    yield f"           ansible -i {bed.inventory} ugro_cluster -m ansible.builtin.ping"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testbed", description="The test cluster: hosts on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring the test hosts up")
    p_up.add_argument("--hosts", type=int, default=3, help="number of hosts tb1..tbN (default 3)")
    p_up.add_argument("--dir", default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_up.add_argument("--subnet", default=DEFAULT_SUBNET,
                      help=f"private IPv4 subnet, or auto: the first free 10.213.N.0/24 from N=100 "
                      f"(default {DEFAULT_SUBNET})")  # fmt: skip
    p_up.add_argument("--ifnames", default=",".join(DEFAULT_IFNAMES),
                      help="interface names the hosts get, in rotation (default %(default)s)")  # fmt: skip
    p_up.add_argument("--no-install", action="store_true", help="never apt-get install missing packages")
    p_up.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for the sshds (default 20)")
    p_up.add_argument(
        "--rootfs",
        action="store_true",
        help="give every host its own Debian root filesystem, an apt proxy and the local apt repo",
    )
    p_up.add_argument("--non-members", type=int, default=0,
                      help="bare hosts nm1..nmN on the bridge and subnet, not in the inventory")  # fmt: skip
    p_up.add_argument("--debian", default="12",
                      help="with --rootfs, the Debian release of each host, in rotation: 12 (Python 3.11), "
                      "13 (Python 3.13); e.g. 12,13 (default 12)")  # fmt: skip
    p_down = sub.add_parser("down", help="stop the test hosts and remove everything up made")
    p_down.add_argument("--dir", default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            started = time.monotonic()
            bed = up(args.dir, args.hosts, args.subnet, args.ifnames.split(","),
                     install=not args.no_install, timeout_s=args.timeout, rootfs=args.rootfs,
                     debian=args.debian.split(","), non_members=args.non_members)  # fmt: skip
            for line in _iter_summary(bed):
                print(line)
            print(f"({time.monotonic() - started:.1f} s)")
        else:
            started = time.monotonic()
            gone = down(args.dir)
            print(f"testbed in {args.dir} removed ({time.monotonic() - started:.1f} s)" if gone
                  else f"no testbed in {args.dir}")  # fmt: skip
    except TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
