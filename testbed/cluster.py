"""The test cluster ("testbed"): a few real hosts on this machine, reachable over real SSH.

Each host is a network namespace joined to a Linux bridge on the controller by a veth pair, and a
bubblewrap sandbox inside it with its own hostname, PID namespace, /etc (a copy with the host's
/etc/hostname and an /etc/hosts naming every host), /root, /tmp, /run and /opt/ugro, running its
own sshd. The rest of the root filesystem (this repository and its .venv included) is shared and
writable: a host is a sandbox for tests, not a security boundary.

    python -m testbed up --hosts 3 [--dir .testbed] [--subnet 10.213.7.0/24 | auto]
    python -m testbed down [--dir .testbed]

`up` writes <dir>/inventory.yml (group ugro_cluster), <dir>/ssh_config (`ssh -F <dir>/ssh_config tb1`)
and <dir>/state.json, the record of every namespace, link and process it made; `down` undoes
exactly what that record names and removes <dir>. Both need root. A testbed left by an interrupted
run (its processes gone, its bridge and namespaces still there) is taken down by the next `up` that
wants its subnet. From Python:

    from testbed import cluster
    bed = cluster.up(".testbed", hosts=3)
    ...
    cluster.down(bed.dir)

Why namespaces and bubblewrap rather than containers: a test host needs a network interface, a hostname, a PID
namespace and an sshd of its own, not an image, and these need no container engine on the machine. Why a PID
namespace per host: whatever a test starts on a host (torchrun, a detached job) dies with the host, so `down` never
has to look for processes by name.

This module is the one place the tests, the benchmarks and the command line take the test cluster from; each
concern lives in a module of its own:

- ``state``: the Testbed value and its record, state.json;
- ``system``: commands, tools and their packages, whether a link or namespace exists;
- ``subnets``: a free subnet, the outside network, dead testbeds reclaimed;
- ``links``: the bridge, each host's namespace and veth pair, non-member hosts;
- ``sandbox``: a host's private directories or own root, and the bubblewrap command that starts it;
- ``sshd``: each host's sshd configuration, and waiting for it to answer;
- ``services``: the apt proxy and the local apt repository that rootfs hosts install from;
- ``bringup`` (`up`), ``teardown`` (`down`), ``faults`` (a host's ranks killed, its cable pulled), ``cli``.
"""

from __future__ import annotations

from testbed.bringup import DEFAULT_IFNAMES, DEFAULT_SUBNET, UP_LOCK, up
from testbed.cli import main
from testbed.faults import host_processes, host_ranks, kill_processes, kill_ranks, set_link
from testbed.inventory import one_rank_per_host
from testbed.links import NON_MEMBER_BASE
from testbed.sandbox import SANDBOX_ENV
from testbed.services import APT_REPO_PORT
from testbed.sshd import SSH_PORT
from testbed.state import DEFAULT_DIR, STATE_FILE, Testbed, TestbedError, TestbedHost
from testbed.subnets import free_subnet, reclaim_dead
from testbed.system import PACKAGES, TOOLS, ensure_tools
from testbed.teardown import down

__all__ = [
    "APT_REPO_PORT",
    "DEFAULT_DIR",
    "DEFAULT_IFNAMES",
    "DEFAULT_SUBNET",
    "NON_MEMBER_BASE",
    "PACKAGES",
    "SANDBOX_ENV",
    "SSH_PORT",
    "STATE_FILE",
    "TOOLS",
    "UP_LOCK",
    "Testbed",
    "TestbedError",
    "TestbedHost",
    "down",
    "ensure_tools",
    "free_subnet",
    "host_processes",
    "host_ranks",
    "kill_processes",
    "kill_ranks",
    "main",
    "one_rank_per_host",
    "reclaim_dead",
    "set_link",
    "up",
]
