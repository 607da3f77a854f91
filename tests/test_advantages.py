"""Tests for workflow_r1.rl.advantages against loop references (statistics module) and a torch re-derivation of verl."""
from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from workflow_r1.rl import advantages

# Jitted once per shape/option set: faster on CPU than eager op-by-op dispatch, and proves jit-ability.
grpo_advantages = jax.jit(advantages.grpo_advantages,
                          static_argnames=("group_size", "eps", "std_normalize", "singleton"))
rloo_advantages = jax.jit(advantages.rloo_advantages, static_argnames=("group_size", "singleton"))


def loop_grpo(rewards, groups, eps=1e-6, std_normalize=True) -> np.ndarray:
    """Per-group mean and unbiased std by the statistics module; size-1 groups -> 0."""
    out = np.zeros(len(rewards))
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = [float(rewards[i]) for i in idx]
        for i in idx:
            if len(idx) == 1:
                out[i] = 0.0
            elif std_normalize:
                out[i] = (rewards[i] - statistics.fmean(vals)) / (statistics.stdev(vals) + eps)
            else:
                out[i] = rewards[i] - statistics.fmean(vals)
    return out


def loop_rloo(rewards, groups) -> np.ndarray:
    out = np.zeros(len(rewards))
    for i, g in enumerate(groups):
        others = [float(rewards[j]) for j, x in enumerate(groups) if x == g and j != i]
        out[i] = rewards[i] - statistics.fmean(others) if others else 0.0
    return out


def torch_verl_grpo_outcome_advantage(scores: torch.Tensor, index: list, eps: float, norm_adv_by_std: bool):
    """verl compute_grpo_outcome_advantage (per-response scalar form), re-derived."""
    id2score: dict = {}
    for i in range(scores.shape[0]):
        id2score.setdefault(index[i], []).append(scores[i])
    id2mean, id2std = {}, {}
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0, dtype=scores.dtype), torch.tensor(1.0, dtype=scores.dtype)
        else:
            t = torch.stack(vals)
            id2mean[idx], id2std[idx] = torch.mean(t), torch.std(t)
    out = scores.clone()
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        out[i] = centred / (id2std[index[i]] + eps) if norm_adv_by_std else centred
    return out


def test_adjacent_groups_match_loop_reference():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24).astype(np.float32)
    rewards[8:16] = (rng.random(8) < 0.5).astype(np.float32)        # a binary-reward group
    groups = [i // 8 for i in range(24)]
    got = np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=8))
    np.testing.assert_allclose(got, loop_grpo(rewards, groups), rtol=1e-5, atol=1e-6)
    got = np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=8, std_normalize=False))
    np.testing.assert_allclose(got, loop_grpo(rewards, groups, std_normalize=False), rtol=1e-5, atol=1e-6)
    # Each group is centred and has unit unbiased std (up to eps).
    for k in range(3):
        np.testing.assert_allclose(got[8 * k:8 * k + 8].sum(), 0.0, atol=1e-5)


def test_explicit_group_ids_any_order_equal_adjacent_layout():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=20).astype(np.float32)
    adjacent = np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=4))
    perm = rng.permutation(20)
    ids = np.array([1000, -7, 42, 3, 99])[np.arange(20) // 4]            # arbitrary id values
    got = np.asarray(grpo_advantages(jnp.asarray(rewards[perm]), jnp.asarray(ids[perm])))
    np.testing.assert_allclose(got, adjacent[perm], rtol=1e-6, atol=1e-7)
    got = np.asarray(rloo_advantages(jnp.asarray(rewards[perm]), jnp.asarray(ids[perm])))
    np.testing.assert_allclose(got, loop_rloo(rewards[perm], list(ids[perm])), rtol=1e-5, atol=1e-6)


def test_golden_verl_grpo_outcome_advantage_including_singletons():
    rng = np.random.default_rng(2)
    index = [0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 4]                            # groups 1 and 4 are singletons
    scores = rng.normal(size=len(index))
    refs = {}
    for norm in (True, False):
        ref = refs[norm] = torch_verl_grpo_outcome_advantage(torch.tensor(scores), index, 1e-6, norm).numpy()
        with jax.enable_x64(True):
            got = np.asarray(grpo_advantages(jnp.asarray(scores), jnp.asarray(index), std_normalize=norm,
                                             singleton="verl"))
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)
        # verl's "mean 0, std 1" gives a lone response R / (1 + eps), not 0 ...
        np.testing.assert_allclose(ref[3], scores[3] / (1 + 1e-6 if norm else 1), rtol=1e-12)
    # ... our default gives it 0 and leaves the other groups as verl has them.
    default = np.asarray(grpo_advantages(jnp.asarray(scores, jnp.float32), jnp.asarray(index)))
    assert default[3] == 0.0 and default[10] == 0.0
    np.testing.assert_allclose(np.delete(default, [3, 10]), np.delete(refs[True], [3, 10]), rtol=1e-5, atol=1e-6)


def test_equal_rewards_give_exactly_zero():
    rewards = jnp.asarray(np.repeat([1.0, 0.0, 0.37], 5), jnp.float32)
    for fn in (grpo_advantages, rloo_advantages):
        np.testing.assert_array_equal(np.asarray(fn(rewards, group_size=5)), 0.0)


def test_rloo_matches_leave_one_out_loop_and_scaled_grpo():
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=18).astype(np.float32)
    groups = [i // 6 for i in range(18)]
    got = np.asarray(rloo_advantages(jnp.asarray(rewards), group_size=6))
    np.testing.assert_allclose(got, loop_rloo(rewards, groups), rtol=1e-5, atol=1e-6)
    centred = np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=6, std_normalize=False))
    np.testing.assert_allclose(got, centred * 6 / 5, rtol=1e-5, atol=1e-6)
    ones = np.asarray(rloo_advantages(jnp.asarray([2.0, 3.0], jnp.float32), jnp.asarray([0, 1]), singleton="verl"))
    np.testing.assert_array_equal(ones, [2.0, 3.0])


def test_padding_rows_are_excluded_and_zero():
    rng = np.random.default_rng(4)
    rewards = rng.normal(size=12).astype(np.float32)
    valid = np.ones(12, bool)
    valid[[2, 9, 10]] = False
    dirty = rewards.copy()
    dirty[~valid] = np.nan
    groups = [i // 4 for i in range(12)]
    kept = [i for i in range(12) if valid[i]]
    for fn, loop in ((grpo_advantages, loop_grpo), (rloo_advantages, loop_rloo)):
        got = np.asarray(fn(jnp.asarray(dirty), group_size=4, valid=jnp.asarray(valid)))
        assert np.isfinite(got).all() and (got[~valid] == 0).all()
        expect = loop(rewards[kept], [groups[i] for i in kept])
        np.testing.assert_allclose(got[kept], expect, rtol=1e-5, atol=1e-6)


def test_eager_and_errors():
    rewards = jnp.arange(8, dtype=jnp.float32)
    # Eager (not jitted) use works too.
    eager = advantages.grpo_advantages(rewards, jnp.asarray([5, 5, 1, 1, 5, 5, 1, 1]))
    np.testing.assert_allclose(np.asarray(eager), loop_grpo(np.arange(8.0), [5, 5, 1, 1, 5, 5, 1, 1]), rtol=1e-5)
    with pytest.raises(ValueError, match="exactly one of group_ids"):
        grpo_advantages(rewards)
    with pytest.raises(ValueError, match="not a whole number of groups"):
        grpo_advantages(rewards, group_size=3)
    with pytest.raises(ValueError, match="singleton"):
        grpo_advantages(rewards, group_size=4, singleton="one")
