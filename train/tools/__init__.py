"""Diagnostics that run as ranks (under torchrun, or one rank alone) during a heavy preflight."""
