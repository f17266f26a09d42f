"""Unequal ranks, one global batch: how it is split (``planner``), each rank's rows (``sampler``), the
token-weighted step over unequal shares (``step``), and the plan of a running job (``batchplan``)."""
