"""Benchmarks run on the controller or the test cluster; never synced to nodes."""
