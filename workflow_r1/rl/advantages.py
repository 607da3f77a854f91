"""Group-relative outcome advantages: GRPO (mean/std normalised) and RLOO (leave-one-out baseline).

A batch holds B responses; the G responses sampled for the same prompt form a group. Groups are
given either as `group_size` n (groups laid out adjacently: B = prompts × n, rows [k·n, (k+1)·n) are
prompt k) or as explicit `group_ids` [B] (any integers, any order). All functions return one
advantage per response, [B] float32 (float64 under x64), with no gradient meaning (rewards are data).

Size-1 groups (docs/paper.md, Our choices). verl's `compute_grpo_outcome_advantage` sets mean 0 and std 1 for a group
of one, so that response gets R / (1 + eps): the raw, un-baselined reward, *not* 0 (subtracting a
mean of 0 does not remove R). verl's RLOO does the same (R unchanged). A group-relative baseline
does not exist for a single sample, so by default we return 0 (no learning signal from a prompt
sampled once); `singleton="verl"` reproduces verl's R / (1 + eps) (GRPO) or R (RLOO, or GRPO
without std normalisation).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Singleton = Literal["zero", "verl"]


def _dense_groups(rewards: Array, group_ids: Array | None, group_size: int | None) -> tuple[Array, int]:
    """Dense group index [B] int32 in [0, num_groups) and the static number of group slots."""
    b = rewards.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids ([B] ints) or group_size (int, adjacent layout)")
    if group_size is not None:
        if group_size < 1 or b % group_size:
            raise ValueError(f"batch of {b} responses is not a whole number of groups of size {group_size}")
        return jnp.arange(b, dtype=jnp.int32) // group_size, b // group_size
    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != (b,):
        raise ValueError(f"group_ids must be [B]=({b},), got {group_ids.shape}")
    # Relabel arbitrary ids to 0..k-1 with a static size so this stays jit-able.
    _, inverse = jnp.unique(group_ids, return_inverse=True, size=b, fill_value=0)
    return inverse.reshape(b).astype(jnp.int32), b


def _group_stats(rewards: Array, dense: Array, num_groups: int, valid: Array) -> tuple[Array, Array, Array]:
    """Per-response group count n_g, group sum Σ R and unbiased std, each [B] (valid rows only)."""
    vf = valid.astype(rewards.dtype)
    r = rewards * vf
    count = jax.ops.segment_sum(vf, dense, num_segments=num_groups)[dense]
    total = jax.ops.segment_sum(r, dense, num_segments=num_groups)[dense]
    mean = total / jnp.maximum(count, 1)
    # Two-pass variance: Σ (R - mean)^2 / (n - 1), the torch.std (unbiased) convention of verl.
    sq = jax.ops.segment_sum(((rewards - mean) * vf) ** 2, dense, num_segments=num_groups)[dense]
    std = jnp.sqrt(sq / jnp.maximum(count - 1, 1))
    return count, total, std


def _prepare(rewards: Array, valid: Array | None) -> tuple[Array, Array]:
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B], got shape {rewards.shape}")
    rewards = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
    valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid).astype(bool)
    # Padded rows may hold anything (NaN included); they must not touch their group's statistics.
    return jnp.where(valid, rewards, 0), valid


def grpo_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    std_normalize: bool = True,
    valid: Array | None = None,
    singleton: Singleton = "zero",
) -> Array:
    """GRPO advantage Â_i = (R_i − mean_g R) / (std_g R + eps), std unbiased (n − 1) (docs/paper.md, Objectives).

    Args:
      rewards: [B] outcome reward per response.
      group_ids: [B] int group (prompt) id per response, any values and order; or None with
        `group_size`.
      group_size: n, for groups laid out adjacently (B = prompts × n). Static.
      eps: added to the std (verl 1e-6).
      std_normalize: False -> Â_i = R_i − mean_g R (verl norm_adv_by_std_in_grpo=False / Dr. GRPO).
      valid: [B] bool, False for padding rows: they are left out of every group statistic and get 0.
      singleton: advantage of a response alone in its group (counting valid rows): "zero" (default)
        -> 0; "verl" -> R / (1 + eps) (R if not std-normalised), verl's mean 0 / std 1 convention.

    Returns:
      [B] advantages; 0 for invalid rows. Equal rewards in a group give exactly 0.
    """
    if singleton not in ("zero", "verl"):
        raise ValueError(f"singleton={singleton!r} unknown; use 'zero' or 'verl'")
    rewards, valid = _prepare(rewards, valid)
    dense, num_groups = _dense_groups(rewards, group_ids, group_size)
    count, total, std = _group_stats(rewards, dense, num_groups, valid)
    mean = total / jnp.maximum(count, 1)
    centred = rewards - mean
    adv = centred / (std + eps) if std_normalize else centred
    alone = rewards / (1.0 + eps) if std_normalize else rewards
    adv = jnp.where(count > 1, adv, alone if singleton == "verl" else 0.0)
    return jnp.where(valid, adv, 0.0)


def rloo_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    group_size: int | None = None,
    valid: Array | None = None,
    singleton: Singleton = "zero",
) -> Array:
    """RLOO advantage Â_i = R_i − mean_{j ≠ i, j in g} R_j (leave-one-out baseline), no std scaling.

    Equals n/(n−1) · (R_i − mean_g R) for a group of n ≥ 2.

    Args:
      rewards, group_ids, group_size, valid: as in `grpo_advantages`.
      singleton: "zero" (default) -> 0 for a response alone in its group; "verl" -> R.

    Returns:
      [B] advantages; 0 for invalid rows.
    """
    if singleton not in ("zero", "verl"):
        raise ValueError(f"singleton={singleton!r} unknown; use 'zero' or 'verl'")
    rewards, valid = _prepare(rewards, valid)
    dense, num_groups = _dense_groups(rewards, group_ids, group_size)
    count, total, _ = _group_stats(rewards, dense, num_groups, valid)
    baseline = (total - rewards) / jnp.maximum(count - 1, 1)
    adv = jnp.where(count > 1, rewards - baseline, rewards if singleton == "verl" else 0.0)
    return jnp.where(valid, adv, 0.0)


# The advantage estimators a run can choose (`train.advantage`): name -> (rewards [B], group_size) -> [B].
ESTIMATORS: dict[str, Callable[..., Array]] = {
    "grpo": grpo_advantages,                                               # (R - mean_g) / (std_g + eps)
    "rloo": rloo_advantages,                                               # R - mean of the others
    "dr_grpo": functools.partial(grpo_advantages, std_normalize=False),    # Dr. GRPO: R - mean_g
}
KINDS = tuple(ESTIMATORS)


def estimate(rewards: np.ndarray, group_size: int, kind: str = "grpo") -> np.ndarray:
    """[B] float32 advantages of [B] rewards in adjacent groups of `group_size`, by the estimator
    `kind` of `ESTIMATORS` (docs/paper.md, Objectives). A group of one response gets 0 under every kind."""
    if kind not in ESTIMATORS:
        raise ValueError(f"train.advantage={kind!r} unknown; use one of {KINDS}")
    r = jnp.asarray(np.asarray(rewards, np.float32))
    return np.asarray(ESTIMATORS[kind](r, group_size=group_size), np.float32)
