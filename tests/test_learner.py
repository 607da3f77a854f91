"""The learner and the trainer's glue around it, in seconds and without a rollout:

- the advantages `train.advantage` selects (grpo, dr_grpo, rloo) against NumPy loops, on rewards
  that differ inside each group (equal rewards would give 0 whatever the grouping);
- the learner's batch (`rollout.pack`, then `Learner.prepare`): the episodes' rewards, their
  advantages over the run's groups of n, and the token / mask / position layout, against a
  hand-built reference;
- the KL reference: the initial policy exactly (its log-probs equal the initial model's, and the KL
  of the first update of one mini-batch is at the float32 noise floor), stored in bf16 only where
  that is exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import advantages as advantages_lib
from workflow_r1.rl import dynamic_sampling
from workflow_r1.rl import learner as learner_lib
from workflow_r1.rl import scoring, shared_prompt, train_state, train_step as ts

N = 4
# Three groups of four with spread inside each (and one constant group, whose advantages are 0).
REWARDS = np.array([1.0, 0.0, 0.5, -1.0, 2.0, 2.0, 2.0, 2.0, 0.25, -0.5, 1.5, 0.0], np.float32)


def numpy_advantages(rewards: np.ndarray, n: int, kind: str) -> np.ndarray:
    out = np.zeros(len(rewards))
    for g in range(len(rewards) // n):
        r = rewards[g * n:(g + 1) * n].astype(np.float64)
        for i in range(n):
            if kind == "grpo":
                out[g * n + i] = (r[i] - r.mean()) / (r.std(ddof=1) + 1e-6)
            elif kind == "dr_grpo":
                out[g * n + i] = r[i] - r.mean()
            else:  # rloo: the mean of the other n - 1 rewards of the group as the baseline
                out[g * n + i] = r[i] - (r.sum() - r[i]) / (n - 1)
    return out


@pytest.mark.parametrize("kind", advantages_lib.KINDS)
def test_advantages_match_numpy(kind):
    got = advantages_lib.estimate(REWARDS, N, kind)
    assert got.dtype == np.float32 and got.shape == REWARDS.shape
    np.testing.assert_allclose(got, numpy_advantages(REWARDS, N, kind), rtol=1e-5, atol=1e-6)
    assert np.all(got[4:8] == 0)  # a group of equal rewards carries no signal


def test_advantage_kinds_differ_and_a_wrong_one_is_one_line():
    grpo, dr, rloo = (advantages_lib.estimate(REWARDS, N, k) for k in ("grpo", "dr_grpo", "rloo"))
    assert not np.allclose(grpo, dr) and not np.allclose(dr, rloo)
    np.testing.assert_allclose(rloo, dr * N / (N - 1), rtol=1e-5, atol=1e-6)  # RLOO = n/(n-1) (R - mean)
    with pytest.raises(ValueError, match="train.advantage='ppo' unknown; use one of"):
        advantages_lib.estimate(REWARDS, N, "ppo")
    with pytest.raises(ValueError, match="TrainConfig.advantage='ppo' unknown"):
        train_state.TrainConfig(advantage="ppo")


def _episode(group, sample, prompt, turns, reward):
    from workflow_r1.rollout.episode import Episode, Turn

    ep = Episode(question=None, group=group, sample=sample, messages=[], prompt_ids=list(prompt))
    for i, (toks, obs) in enumerate(turns):
        ep.add_turn(toks, np.full(len(toks), -0.5 - i, np.float32), Turn(text="", action="tool", operator="x"))
        if obs:
            ep.add_observation(obs, "<info></info>")
    ep.reward = reward
    return ep


def test_training_batch_groups_and_layout():
    from workflow_r1.rollout import pack

    rng = np.random.default_rng(0)
    episodes = []
    for b, r in enumerate(REWARDS):
        prompt = rng.integers(10, 50, 3 + b % 2)
        turns = [(list(rng.integers(50, 90, 2 + b % 3)), list(rng.integers(90, 99, 2))),
                 (list(rng.integers(50, 90, 1)), None)]
        episodes.append(_episode(b // N, b % N, prompt, turns, float(r)))
    length = 16
    host = pack(episodes, pad_id=0, length=length)
    np.testing.assert_array_equal(host.rewards, REWARDS)
    assert host.advantages is None  # the learner's to compute
    learner = learner_lib.Learner(qwen2.create(MODEL_CFG, seed=0), train_state.TrainConfig(kl_coef=0.0))
    batch, metrics = learner.prepare(host, learner.select(host.rewards, group_size=N, wanted=len(REWARDS) // N))
    assert batch.rewards is None and metrics == {}  # no filter: every group, no filter metrics
    np.testing.assert_allclose(batch.advantages, numpy_advantages(REWARDS, N, "grpo"), rtol=1e-5, atol=1e-6)
    batch = jax.device_get(batch)
    for b, ep in enumerate(episodes):  # right padding: prompt, response, then pads carrying no loss
        p, n = len(ep.prompt_ids), ep.response_length
        want_tokens = np.zeros(length, np.int32)
        want_tokens[:p + n] = ep.prompt_ids + ep.response_ids
        want_loss = np.zeros(length, np.int32)
        want_loss[p:p + n] = ep.loss_mask
        np.testing.assert_array_equal(batch.tokens[b], want_tokens)
        np.testing.assert_array_equal(batch.loss_mask[b], want_loss)
        np.testing.assert_array_equal(batch.input_mask[b], (np.arange(length) < p + n).astype(np.int32))
        np.testing.assert_array_equal(batch.positions[b][:p + n], np.arange(p + n))
        want_lp = np.zeros(length, np.float32)
        want_lp[p:p + n] = ep.logprobs
        np.testing.assert_array_equal(batch.sampler_logprobs[b], want_lp)
        seg = np.full(length, -1)
        seg[p:p + n] = ep.segment_ids
        np.testing.assert_array_equal(batch.segment_ids[b], seg)
        assert sorted(set(seg[want_loss == 1])) == [0, 1]  # one segment per assistant turn


MODEL_CFG = get_preset("tiny").replace(vocab_size=64, num_layers=1)


def _batch(rows: int = 8, length: int = 12) -> trajectory.TrainBatch:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.int32)
    mask[:, 4:] = 1
    return trajectory.shard_batch(trajectory.make_batch(tokens, mask, rng.normal(size=rows).astype(np.float32)), None)


def test_kl_reference_is_the_initial_policy():
    model = qwen2.create(MODEL_CFG, seed=0)  # random fp32 weights: not exact in bf16
    cfg = train_state.TrainConfig(kl_coef=0.1, num_mini_batches=1, learning_rate=1e-2, logprob_chunk_size=None)
    initial = [np.array(x) for x in jax.tree.leaves(nnx.state(model))]  # host copies: the update donates
    batch = _batch()
    want = np.asarray(scoring.compute_logprobs(model, batch, chunk_size=None))
    learner = learner_lib.Learner(model, cfg)
    ref = np.asarray(learner.reference_logprobs(batch))
    np.testing.assert_allclose(ref, want, atol=1e-6)
    metrics = learner.update(batch)
    # The first (and only) mini-batch is scored with the initial weights: KL to the reference is noise.
    assert 0 <= metrics["train/kl_ref"] < 1e-7, metrics["train/kl_ref"]
    # The update moved the policy; the reference did not move with it.
    assert not np.allclose(np.asarray(scoring.compute_logprobs(learner.state, batch, chunk_size=None)), want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(learner.reference_logprobs(batch)), want, atol=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(initial, jax.tree.leaves(learner.ref_state.params)))
    learner.release_reference()
    assert learner.ref_state is None


def test_reference_copy_stores_bf16_only_where_exact():
    exact = jnp.asarray(np.array([1.0, 0.5, -2.0, 3.0], np.float32))  # bf16 holds these exactly
    inexact = jnp.asarray(np.array([1.0, 1.0 + 2 ** -12, 0.1], np.float32))
    out = learner_lib.reference_copy({"a": exact, "b": inexact})
    assert out["a"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["a"], np.float32), np.asarray(exact))
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(inexact))
    assert learner_lib.Learner(qwen2.create(MODEL_CFG, seed=0), train_state.TrainConfig(kl_coef=0.0)).ref_state is None


# Dynamic sampling (train.filter_groups): 5 groups of 4; groups 1 and 3 have equal rewards.
FILTER_REWARDS = np.array([1.0, 0.0, 0.5, -1.0, 2.0, 2.0, 2.0, 2.0, 0.25, -0.5, 1.5, 0.0,
                           -1.5, -1.5, -1.5, -1.5, 1.0, 1.0, 1.0, 0.0], np.float32)


def _row_tagged_batch(rewards: np.ndarray, length: int = 12) -> trajectory.TrainBatch:
    """A host batch whose row b starts with token b (rows identifiable after filtering); policy tokens
    from position 4, two turns each; the rewards' grpo advantages."""
    rows = len(rewards)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (rows, length)).astype(np.int32)
    tokens[:, 0] = np.arange(rows)
    mask = np.zeros((rows, length), np.int32)
    mask[:, 4:7] = 1
    mask[:, 9:] = 1
    return trajectory.make_batch(tokens, mask, advantages_lib.estimate(rewards, N),
                                sampler_logprobs=rng.normal(size=(rows, length)).astype(np.float32) * mask)


def test_filter_groups_drops_the_groups_of_equal_rewards():
    keep = dynamic_sampling.varied_groups(FILTER_REWARDS, N)
    np.testing.assert_array_equal(keep, [True, False, True, False, True])
    assert keep.mean() == 0.6  # train/kept_group_fraction
    host = _row_tagged_batch(FILTER_REWARDS)
    out = dynamic_sampling.select_groups(host, keep, N)
    kept_rows = [b for b in range(len(FILTER_REWARDS)) if keep[b // N]]
    np.testing.assert_array_equal(out.tokens[:, 0], kept_rows)  # the dropped groups' rows are absent
    for name in ("tokens", "loss_mask", "segment_ids", "positions", "input_mask", "sampler_logprobs", "advantages"):
        np.testing.assert_array_equal(getattr(out, name), getattr(host, name)[kept_rows], err_msg=name)
    # Padded to a shape the step accepts: inert rows, no policy token, no advantage.
    padded = dynamic_sampling.select_groups(host, keep, N, rows=16)
    assert padded.tokens.shape == (16, 12)
    np.testing.assert_array_equal(padded.tokens[:12, 0], kept_rows)
    assert not padded.loss_mask[12:].any() and not padded.advantages[12:].any()
    assert (padded.segment_ids[12:] == -1).all() and not padded.sampler_logprobs[12:].any()
    with pytest.raises(ValueError, match="do not split into groups of rollout.n=3"):
        dynamic_sampling.varied_groups(FILTER_REWARDS, 3)


def _splits(rows: int, cfg: train_state.TrainConfig, devices: int) -> bool:
    """The run config's rule: rows split into mini-batches of whole micro-batches over the devices."""
    mini = rows // cfg.num_mini_batches
    micro = min(cfg.micro_batch_size or mini, mini)
    return rows % cfg.num_mini_batches == 0 and mini % micro == 0 and micro % devices == 0


@pytest.mark.parametrize("mini,micro,devices,procs", [(2, 4, 4, 1), (2, 8, 2, 1), (4, None, 2, 1), (2, 32, 8, 1),
                                                      (2, 4, 4, 2)])
def test_filtered_row_counts_split_into_the_configured_batches(mini, micro, devices, procs):
    cfg = train_state.TrainConfig(num_mini_batches=mini, micro_batch_size=micro)
    full = 64 // procs  # rows per host
    sizes = [dynamic_sampling.filtered_rows(k, full, cfg, devices, procs) for k in range(full + 1)]
    assert sizes[0] == 0
    assert all(k <= s <= full and _splits(s * procs, cfg, devices) for k, s in enumerate(sizes) if k), sizes
    assert len(set(sizes)) <= 8  # few shapes: few compilations
    assert sizes[full // 4] < full  # a quarter of the rows kept: a smaller batch


def test_filtered_update_is_the_kept_rows_update_without_their_dilution():
    """The padded filtered batch gives the gradient of its kept rows alone (the padding rows are inert)
    without the dilution of the unfiltered batch, whose constant groups' zero advantages count in its
    normalizer (20 responses) and nowhere else: g_all = g_filtered x 12 / 20."""
    cfg = train_state.TrainConfig(num_mini_batches=1, kl_coef=0.0, logprob_chunk_size=None, granularity="token")
    state = train_state.create_train_state(qwen2.create(MODEL_CFG, seed=0), cfg)
    grads = ts.make_loss_and_grads(cfg)
    host = _row_tagged_batch(FILTER_REWARDS)
    keep = dynamic_sampling.varied_groups(FILTER_REWARDS, N)
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)  # noqa: E731
    _, g_all, m_all = grads(state, trajectory.shard_batch(host, None))
    _, g_kept, m_kept = grads(state, trajectory.shard_batch(dynamic_sampling.select_groups(host, keep, N, rows=16), None))
    assert float(m_kept["num_responses"]) == 12 and float(m_all["num_responses"]) == 20
    tol = 1e-5 * np.abs(flat(g_kept)).max()
    np.testing.assert_allclose(flat(g_all), flat(g_kept) * 12 / 20, rtol=1e-4, atol=tol)
    assert np.abs(flat(g_kept)).max() > 1e-4


def test_keep_shape_pads_to_the_full_batch_and_skips_padding_micro_batches(monkeypatch):
    """train.filter_keep_shape: the kept groups padded to the whole batch (one shape whatever is kept);
    the learner's reordering gives the padding micro-batches of their own, whose passes are skipped,
    and the gradient is the one of the kept rows alone."""
    cfg = train_state.TrainConfig(num_mini_batches=1, micro_batch_size=N, kl_coef=0.0, logprob_chunk_size=None,
                                  granularity="token", filter_groups=True, filter_keep_shape=True)
    rows = len(FILTER_REWARDS)
    assert {dynamic_sampling.filtered_rows(k, rows, cfg) for k in range(1, rows + 1)} == {rows}
    keep = dynamic_sampling.varied_groups(FILTER_REWARDS, N)  # 3 of 5 groups
    padded = dynamic_sampling.select_groups(_row_tagged_batch(FILTER_REWARDS), keep, N, rows=rows)
    order = shared_prompt.micro_batch_order(np.arange(rows), 1, rows // N)  # as the learner reorders
    host = jax.tree.map(lambda x: np.asarray(x)[order], padded)
    passes = []
    original = ts._micro_loss

    def counted(*args, **kw):
        jax.debug.callback(lambda: passes.append(1))
        return original(*args, **kw)

    monkeypatch.setattr(ts, "_micro_loss", counted)
    state = train_state.create_train_state(qwen2.create(MODEL_CFG, seed=0), cfg)
    _, g_full, m_full = jax.block_until_ready(ts.make_loss_and_grads(cfg)(state, trajectory.shard_batch(host, None)))
    assert len(passes) == 3  # 5 micro-batches, the 2 of padding skipped
    kept = jax.tree.map(lambda x: np.asarray(x)[:12], padded)
    _, g_kept, _ = ts.make_loss_and_grads(cfg)(state, trajectory.shard_batch(kept, None))
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).astype(np.float64)  # noqa: E731
    assert float(m_full["num_responses"]) == 12
    np.testing.assert_allclose(flat(g_full), flat(g_kept), rtol=1e-5, atol=1e-6 * np.abs(flat(g_kept)).max())
