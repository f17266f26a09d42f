"""The test cluster on one machine, for the tests, Molecule and `make testbed-up` (never installed, never synced).

- ``testbed.cluster``: hosts tb1..tbN (network namespaces, bubblewrap, sshd): ``python -m testbed up|down``; the one
  module the tests and benchmarks import, gathering the names of the modules below by concern:
  ``testbed.state`` (the Testbed value, state.json), ``testbed.system`` (commands and tools), ``testbed.subnets``
  (a free subnet, dead testbeds reclaimed), ``testbed.links`` (bridge, namespaces, veths), ``testbed.sandbox`` (a
  host's private directories or own root, its bubblewrap command), ``testbed.sshd``, ``testbed.services`` (the apt
  proxy and repository on the bridge), ``testbed.bringup`` (``up``), ``testbed.teardown`` (``down``),
  ``testbed.faults`` (a host's ranks killed, its cable pulled), ``testbed.cli``, ``testbed.procs`` (the hosts'
  processes: still running, stopped) and ``testbed.inventory`` (their inventory);
- ``testbed.rootfs``: the cached Debian roots of the rootfs hosts: ``python -m testbed.rootfs build [12] [13]``;
- ``testbed.aptrepo``: the dummy NVIDIA apt repository: ``python -m testbed.aptrepo build DIR``, with
  ``testbed.standins`` (what its driver and kernel packages do on a test host);
- ``testbed.net``: a free TCP port, for the tests and the benchmarks;
- ``testbed.exporters``: each host's node exporter started or stopped as `make provision` does it;
- ``testbed.planted``: a running job planted on one host's runs/ without a cluster (exporter tests and bench).

Run from the repository root (``python -m`` finds the package there), as the Makefile and Molecule do.
"""
