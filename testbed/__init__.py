"""The test cluster on one machine, for the tests, Molecule and `make testbed-up` (never installed, never synced).

- ``testbed.cluster``: hosts tb1..tbN (network namespaces, bubblewrap, sshd): ``python -m testbed up|down``, with
  ``testbed.procs`` (their processes: still running, stopped) and ``testbed.inventory`` (their inventory);
- ``testbed.rootfs``: the cached Debian roots of the rootfs hosts: ``python -m testbed.rootfs build [12] [13]``;
- ``testbed.aptrepo``: the dummy NVIDIA apt repository: ``python -m testbed.aptrepo build DIR``;
- ``testbed.net``: a free TCP port, for the tests and the benchmarks;
- ``testbed.exporters``: each host's node exporter started or stopped as `make provision` does it;
- ``testbed.planted``: a running job planted on one host's runs/ without a cluster (exporter tests and bench).

Run from the repository root (``python -m`` finds the package there), as the Makefile and Molecule do.
"""
