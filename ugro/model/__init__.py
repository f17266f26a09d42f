"""The base model: converting a registry wheel's model once, and merging a run's adapter into it."""
