"""The rollout: questions through the policy's sampler and an environment, into trajectories.

`RolloutEngine.run` produces `Episode`s (tokens, masks, segment ids, sampler log-probs, the decoded
conversation, reward); `packing.pack` turns them into the `trajectory.TrainBatch` the learner
prepares and the update consumes.
"""
from workflow_r1.rollout.engine import RolloutConfig, RolloutEngine, RolloutStats
from workflow_r1.rollout.episode import FINISH_REASONS, Episode, Turn
from workflow_r1.rollout.packing import pack, padded_length
from workflow_r1.rollout.stats import by_source, combine, episode_metrics, step_metrics
from workflow_r1.rollout.versions import TurnVersions

__all__ = ["Episode", "FINISH_REASONS", "RolloutConfig", "RolloutEngine", "RolloutStats", "Turn",
           "TurnVersions", "by_source", "combine", "episode_metrics", "pack", "padded_length", "step_metrics"]
