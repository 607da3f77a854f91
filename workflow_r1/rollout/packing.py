"""Episodes -> the trajectory arrays of `workflow_r1.trajectory` (right-padded [B, T]).

Row b is `prompt_ids + response_ids` of episode b, then padding (token = pad id, input_mask 0,
loss_mask 0, segment -1). The padded length T is rounded up to a multiple of `length_multiple`
(`RolloutConfig.pad_multiple`: few distinct shapes, so few compilations of the train step, at
the cost of padding positions that are computed and then masked out); with several hosts every host
pads to the same T (the longest row of any host), as one global batch needs.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workflow_r1 import trajectory
from workflow_r1.rollout.episode import Episode


def padded_length(episodes: Sequence[Episode], length_multiple: int = 512, at_least: int = 0) -> int:
    """The T that holds every episode (prompt + response), rounded up to `length_multiple`."""
    longest = max([len(e.prompt_ids) + e.response_length for e in episodes] + [at_least, 1])
    return -(-longest // length_multiple) * length_multiple


def pack(episodes: Sequence[Episode], advantages: np.ndarray | None = None, *, pad_id: int,
         length: int) -> trajectory.TrainBatch:
    """A host `TrainBatch` of the episodes (B rows, T = `length` positions) with their rewards [B];
    advantages [B], or None for the learner to compute from the rewards (`Learner.prepare`)."""
    b = len(episodes)
    tokens = np.full((b, length), pad_id, np.int32)
    input_mask = np.zeros((b, length), np.int32)
    loss_mask = np.zeros((b, length), np.int32)
    segment_ids = np.full((b, length), -1, np.int32)
    logprobs = np.zeros((b, length), np.float32)
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), e.response_length
        if p + r > length:
            raise ValueError(f"episode {i} has {p + r} tokens; the batch length is {length}")
        tokens[i, :p] = e.prompt_ids
        tokens[i, p:p + r] = e.response_ids
        input_mask[i, :p + r] = 1
        loss_mask[i, p:p + r] = e.loss_mask
        segment_ids[i, p:p + r] = e.segment_ids
        logprobs[i, p:p + r] = e.logprobs
    return trajectory.make_batch(tokens, loss_mask, advantages, segment_ids=segment_ids, sampler_logprobs=logprobs,
                                 input_mask=input_mask, rewards=[e.reward for e in episodes])
