"""Checks before and after a run: the job file, preflight on every host, doctor on a failed run."""
