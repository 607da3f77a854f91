"""Greedy evaluation of a policy on question files: EM per data source, format rate, operator use.

`evaluate` runs the same rollout engine as training (temperature 0, one sample per question), in
batches, and returns the statistics of `rollout.stats` per data source plus every episode. The
trainer's periodic evaluation calls it; so will `python -m workflow_r1.evaluate`.
"""
from workflow_r1.eval.greedy import EvalConfig, EvalResult, evaluate

__all__ = ["EvalConfig", "EvalResult", "evaluate"]
