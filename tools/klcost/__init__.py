"""The KL cost research tool behind `python -m tools.kl_memory` (see tools/kl_memory.py)."""
