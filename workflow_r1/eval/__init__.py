"""Greedy evaluation of a policy on question files: EM per data source, format rate, operator use.

`evaluate` runs the same rollout engine as training (temperature 0, one sample per question), in
batches, each host on its slice of the questions, and returns the statistics of `rollout.stats`
per data source plus every episode. The trainer's periodic evaluation and
`python -m workflow_r1.evaluate` both call it; `baselines` gives the Direct / CoT engines,
`policy_source` the weights to evaluate, `report` the files an evaluation writes.
"""
from workflow_r1.eval.greedy import EvalConfig, EvalResult, evaluate

__all__ = ["EvalConfig", "EvalResult", "evaluate"]
