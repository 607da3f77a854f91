"""The rollout: questions through the policy's sampler and the operator executor, into trajectories.

`RolloutEngine.run` produces `Episode`s (tokens, masks, segment ids, sampler log-probs, the decoded
conversation, reward); `packing.pack` turns them into the `rl.batch.TrainBatch` the update consumes.
`pack` and `padded_length` are imported on first use, so a program that only rolls out (rlmopt's
policy-prompt task) does not import the training side (`workflow_r1.rl`).
"""
import importlib
from typing import Any

from workflow_r1.rollout.engine import RolloutConfig, RolloutEngine, RolloutStats
from workflow_r1.rollout.episode import FINISH_REASONS, Episode, Turn
from workflow_r1.rollout.stats import by_source, combine, episode_metrics

__all__ = ["Episode", "FINISH_REASONS", "RolloutConfig", "RolloutEngine", "RolloutStats", "Turn",
           "by_source", "combine", "episode_metrics", "pack", "padded_length"]


def __getattr__(name: str) -> Any:
    if name in ("pack", "padded_length"):  # packing imports workflow_r1.rl (the TrainBatch)
        return getattr(importlib.import_module("workflow_r1.rollout.packing"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
