"""Packed updates: several episodes per row of the model's input, so short episodes stop paying
for the longest one's padding (`TrainConfig.pack_tokens`).

Shapes: B episodes (rows of the `TrainBatch`), T its padded length, M mini-batches, b = B / M
episodes per mini-batch, R packed rows per mini-batch, P = pack_tokens positions per packed row.

The batch keeps its episode layout [B, T] (the trajectory contract is unchanged); packing is a
gather plan, built on the host from the masks:

- An episode's packed span is its real tokens (input_mask 1) up to its last policy token (loss_mask
  1). Nothing after that token can change a scored log-prob (attention is causal), and padding is
  never attended, so dropping both leaves every policy token's log-prob as it was.
- Mini-batch i holds the same episodes as without packing (rows i, i + M, ...: `_split_rows`), so
  the objective of every optimizer update is unchanged. Its episodes go first-fit-decreasing into
  rows of P tokens; every mini-batch gets the same R rows (empty ones are all padding), a multiple
  of the packed rows per micro-batch (`TrainConfig.micro_batch_size`; None: all R at once).
- Each packed token carries its episode's segment id in the row (1, 2, ...; 0 = padding) and its
  episode's own RoPE position, so attention stays inside the episode and positions restart at 0.

In the step, the model scores the packed rows [R, P] and the log-probs are scattered back to the
episode layout [b, T], where `losses.policy_loss` runs as before on each micro-batch's episodes
(the others masked out): the per-token, per-sequence and per-sub-sequence aggregates see exactly
the arrays they see unpacked. This module imports nothing but NumPy and JAX (no rollout code).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@flax.struct.dataclass
class PackPlan:
    """Where each packed token comes from. All [M, R, P] int32 (NumPy on the host):

    row:     the episode's row within its mini-batch (0 .. b - 1); 0 on padding.
    col:     the token's position in the episode's row of the batch (0 .. T - 1); 0 on padding.
    segment: 1, 2, ... for the episodes of a packed row in order, 0 on padding.
    """

    row: Any
    col: Any
    segment: Any

    @property
    def rows(self) -> int:
        """R, packed rows per mini-batch."""
        return int(self.segment.shape[1])


def episode_spans(input_mask: np.ndarray, loss_mask: np.ndarray) -> list[np.ndarray]:
    """[B, T] masks -> per episode the columns it keeps when packed: real tokens up to its last
    policy token (empty for an episode without policy tokens: it adds nothing to the loss)."""
    spans = []
    for real, policy in zip(np.asarray(input_mask).astype(bool), np.asarray(loss_mask).astype(bool)):
        hits = np.flatnonzero(policy & real)
        spans.append(np.flatnonzero(real[:hits[-1] + 1]) if hits.size else np.zeros(0, np.int64))
    return spans


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices, each in placement order) of total length <= capacity, by
    first-fit decreasing (ties by index, so the plan is deterministic). Empty items are skipped."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        if n == 0:
            continue
        if n > capacity:
            raise ValueError(f"an episode of {n} tokens does not fit train.pack_tokens={capacity}; raise it")
        for k, r in enumerate(room):
            if n <= r:
                bins[k].append(i)
                room[k] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def make_plan(input_mask: Any, loss_mask: Any, *, num_mini_batches: int, pack_tokens: int,
              rows_per_micro: int | None) -> PackPlan:
    """The host-side plan of a [B, T] batch (see the module docstring).

    rows_per_micro: packed rows per micro-batch (R is rounded up to a multiple); None: one
    micro-batch of all R rows.
    """
    input_mask, loss_mask = np.asarray(input_mask), np.asarray(loss_mask)
    b_all = input_mask.shape[0]
    m = num_mini_batches
    if b_all % m:
        raise ValueError(f"a batch of {b_all} rows does not split into {m} mini-batches "
                         "(TrainConfig.num_mini_batches); make the rollout batch a multiple of it")
    spans = episode_spans(input_mask, loss_mask)
    per_mini = []
    for i in range(m):
        rows = list(range(i, b_all, m))  # the strided mini-batch of `scoring.split_rows`
        bins = first_fit_decreasing([len(spans[r]) for r in rows], pack_tokens)
        per_mini.append([[(j, spans[rows[j]]) for j in bin_] for bin_ in bins])
    r = max([len(x) for x in per_mini] + [1])
    if rows_per_micro:
        r = -(-r // rows_per_micro) * rows_per_micro
    row = np.zeros((m, r, pack_tokens), np.int32)
    col = np.zeros((m, r, pack_tokens), np.int32)
    segment = np.zeros((m, r, pack_tokens), np.int32)
    for i, bins in enumerate(per_mini):
        for k, bin_ in enumerate(bins):
            at = 0
            for s, (j, cols) in enumerate(bin_, start=1):
                n = len(cols)
                row[i, k, at:at + n], col[i, k, at:at + n], segment[i, k, at:at + n] = j, cols, s
                at += n
    return PackPlan(row=row, col=col, segment=segment)


def plan_stats(plan: PackPlan) -> dict[str, float]:
    """Host metrics of a plan: packed rows per mini-batch and the fraction of packed positions that
    hold a real token (1.0 = no padding left)."""
    seg = np.asarray(plan.segment)
    return {"pack_rows": float(seg.shape[1]), "pack_fill": float((seg > 0).mean())}


def gather(x: Array, plan_row: Array, plan_col: Array, segment: Array) -> Array:
    """Episode-layout x [b, T] -> packed [R, P] (0 on padding)."""
    return jnp.where(segment > 0, x[plan_row, plan_col], 0).astype(x.dtype)


def model_inputs(tokens: Array, positions: Array, loss_mask: Array,
                 plan: PackPlan) -> tuple[Array, Array, Array]:
    """A mini-batch's tokens, positions, loss_mask [b, T] -> the packed rows [R, P] of `plan`.

    The positions are each episode's own (its first real token at 0), so they restart at every
    episode of a row. With RoPE, attention scores depend only on position differences, so
    restarting changes no exact logit; it keeps the angles, hence their rounding, those of the
    unpacked rows (in bf16 large angles lose digits).
    """
    take = lambda x: gather(x, plan.row, plan.col, plan.segment)  # noqa: E731
    return take(tokens), take(positions), take(loss_mask)


def scatter(packed: Array, plan_row: Array, plan_col: Array, segment: Array, shape: tuple[int, int]) -> Array:
    """Packed values [R, P] -> episode layout [b, T]; positions no packed token maps to get 0.
    Every real (row, col) appears at most once in a plan, so the sum is a placement."""
    vals = jnp.where(segment > 0, packed, 0)
    return jnp.zeros(shape, packed.dtype).at[plan_row, plan_col].add(vals)


def episodes_in(plan_row: Array, segment: Array, rows: int) -> Array:
    """[b] bool: the episodes of the mini-batch that a (micro-batch) plan [R, P] holds."""
    return jnp.zeros((rows,), bool).at[plan_row].max(segment > 0)


__all__ = ["PackPlan", "episode_spans", "first_fit_decreasing", "make_plan", "plan_stats", "gather", "model_inputs", "scatter",
           "episodes_in"]
