"""The trajectory contract: the one data type that crosses from the rollout to the update.

Shapes: B responses (prompts x n samples, the rows of a group adjacent), T token positions.

The rollout engine produces these arrays with the episodes' `rewards`, the learner turns the
rewards into `advantages` (rl/learner.py, `Learner.prepare`), and the train step consumes them
(docs/design.md, The trajectory contract). Nothing downstream needs to know how a batch was made.
This module sits on the ground floor: it imports only `sharding`, so the rollout side depends on
it and not on the model or the loss.

- `TrainBatch`: the arrays, as a pytree (NumPy on the host, jax.Arrays once placed).
- `make_batch`: a host batch from the arrays a rollout has, filling every derivable field.
- `positions_from_mask`, `segment_ids_from_mask`: the two derivable fields' formulas.
- `shard_batch`: places a host batch on a mesh (rows over the data axes; multi-host assembles
  every process's rows into one global array).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from workflow_r1 import sharding

Array = jax.Array


def positions_from_mask(input_mask: Array) -> Array:
    """Left-padded mask [B, T] -> positions [B, T] (0 at each row's first real token; 0 on padding)."""
    m = jnp.asarray(input_mask).astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=1) - 1, 0)


def segment_ids_from_mask(mask: Array) -> Array:
    """Turn index of every policy token: maximal runs of mask-1 tokens, numbered 0, 1, ... per row.

    Args:
      mask: [B, T] int or bool, 1 on tokens the policy generated.

    Returns:
      [B, T] int32: 0 for the tokens of the first run of 1s in the row, 1 for the second run, ...;
      -1 where mask is 0. A row without 1s is all -1.
    """
    m = jnp.asarray(mask).astype(bool)
    # A run starts where the token is 1 and its left neighbour is 0 (or absent).
    prev = jnp.pad(m[:, :-1], ((0, 0), (1, 0)), constant_values=False)
    starts = m & ~prev
    seg = jnp.cumsum(starts.astype(jnp.int32), axis=-1, dtype=jnp.int32) - 1
    return jnp.where(m, seg, -1).astype(jnp.int32)


@flax.struct.dataclass
class TrainBatch:
    """A rollout batch ready for the update.

    tokens:           [B, T] int32, prompt + assistant turns + observations (any padding side).
    input_mask:       [B, T] int32, 1 on real tokens (attention mask), 0 on padding.
    positions:        [B, T] int32 RoPE positions.
    loss_mask:        [B, T] int32, 1 on policy-generated tokens (assistant turns and their end token).
    segment_ids:      [B, T] int32, assistant-turn index on mask-1 tokens, -1 elsewhere.
    sampler_logprobs: [B, T] float32, log-probs of the tokens under the sampler (0 elsewhere).
    advantages:       [B] float32, one per response, or None until the learner computes them
                      from `rewards` (`Learner.prepare`; the update needs them).
    old_logprobs:     [B, T] float32 or None (None: recomputed with the current params).
    ref_logprobs:     [B, T] float32 or None (None: no KL term).
    rewards:          [B] float32, the episodes' total rewards, or None (the update reads only
                      `advantages`; `Learner.prepare` drops them once it has).
    """

    tokens: Any
    input_mask: Any
    positions: Any
    loss_mask: Any
    segment_ids: Any
    sampler_logprobs: Any
    advantages: Any
    old_logprobs: Any = None
    ref_logprobs: Any = None
    rewards: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


def make_batch(tokens: Any, loss_mask: Any, advantages: Any, *, segment_ids: Any = None,
               sampler_logprobs: Any = None, input_mask: Any = None, positions: Any = None,
               old_logprobs: Any = None, ref_logprobs: Any = None, rewards: Any = None) -> TrainBatch:
    """Builds a host-side `TrainBatch` (NumPy arrays), filling the derivable fields.

    Args:
      tokens, loss_mask: [B, T]. advantages: [B], or None (the learner computes them from `rewards`).
      segment_ids: [B, T]; None -> maximal runs of mask-1 tokens (`segment_ids_from_mask`).
      sampler_logprobs: [B, T]; None -> zeros (no sampler-mismatch metric of any meaning).
      input_mask: [B, T]; None -> all ones, which is exact for right-padded rows (causal
        attention never lets a later pad token reach a real token; pads have loss_mask 0).
      positions: [B, T]; None -> `positions_from_mask(input_mask)` (0 on left padding).
      old_logprobs, ref_logprobs: [B, T] or None. rewards: [B] or None.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    b, t = tokens.shape

    def arr(name: str, x: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        x = np.asarray(x, dtype)
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
        return x

    loss_mask = arr("loss_mask", loss_mask, np.int32, (b, t))
    input_mask = np.ones((b, t), np.int32) if input_mask is None else arr("input_mask", input_mask, np.int32, (b, t))
    if positions is None:
        positions = np.asarray(positions_from_mask(input_mask))
    if segment_ids is None:
        segment_ids = np.asarray(segment_ids_from_mask(loss_mask))
    if sampler_logprobs is None:
        sampler_logprobs = np.zeros((b, t), np.float32)
    return TrainBatch(
        tokens=tokens, input_mask=input_mask, positions=arr("positions", positions, np.int32, (b, t)),
        loss_mask=loss_mask, segment_ids=arr("segment_ids", segment_ids, np.int32, (b, t)),
        sampler_logprobs=arr("sampler_logprobs", sampler_logprobs, np.float32, (b, t)),
        advantages=None if advantages is None else arr("advantages", advantages, np.float32, (b,)),
        old_logprobs=None if old_logprobs is None else arr("old_logprobs", old_logprobs, np.float32, (b, t)),
        ref_logprobs=None if ref_logprobs is None else arr("ref_logprobs", ref_logprobs, np.float32, (b, t)),
        rewards=None if rewards is None else arr("rewards", rewards, np.float32, (b,)))


def shard_batch(batch: TrainBatch, mesh: Mesh | None) -> TrainBatch:
    """Places a host batch on the mesh, rows over (data, fsdp); mesh None -> default device.

    Multi-host: every process passes its own rows (B / process_count of them); the result is one
    global array of B rows.
    """
    if mesh is None:
        return jax.tree.map(jnp.asarray, batch)

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        spec = sharding.batch_sharding(mesh, x.ndim)
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(spec, x)
        return jax.device_put(x, spec)

    return jax.tree.map(one, batch)


__all__ = ["TrainBatch", "make_batch", "positions_from_mask", "segment_ids_from_mask", "shard_batch"]
