"""ugro's rank code: what every rank runs under torchrun, and the only Python a node receives."""
