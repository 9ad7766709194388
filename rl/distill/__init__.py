"""On-policy distillation from a frozen teacher over the full vocabulary (docs/distillation.md)."""
