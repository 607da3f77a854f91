"""Baseline optimizers run over the same harness, splits and record as rlmopt (docs/rlmopt.md)."""
