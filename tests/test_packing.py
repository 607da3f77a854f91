"""Packed updates: segment-aware attention, segment-aware scoring, and packed == unpacked losses.

References: each episode run alone through the model (its own row, no packing), and the unpacked
train step of the same batch (pack_tokens=0) for each of the three loss granularities.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import learner as learner_lib
from workflow_r1.rl import packed
from workflow_r1.rl import train_state, train_step as ts
from workflow_r1.rl.logprobs import logprobs_from_hidden

CFG = get_preset("tiny")
LENGTHS = (9, 14, 5, 11)  # episodes packed into one row of 40 (39 real tokens, then a pad)


@pytest.fixture(scope="module")
def model():
    return qwen2.create(CFG, seed=3)


def _episodes(lengths=LENGTHS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.RandomState(seed)
    return [rng.randint(2, CFG.vocab_size, n).astype(np.int32) for n in lengths]


def _pack_row(eps: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """One packed row [1, width]: tokens and segment ids (1, 2, ...; 0 = padding)."""
    tokens = np.zeros((1, width), np.int32)
    seg = np.zeros((1, width), np.int32)
    at = 0
    for s, e in enumerate(eps, start=1):
        tokens[0, at:at + len(e)], seg[0, at:at + len(e)] = e, s
        at += len(e)
    return tokens, seg


def _logits(model, tokens, positions, segment_ids=None) -> np.ndarray:
    """model(...) logits [B, T, V], jitted (traced now: module-level block sizes apply)."""
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda st, t, p, s: nnx.merge(graphdef, st)(t, p, segment_ids=s)[0])
    return np.asarray(f(state, jnp.asarray(tokens), jnp.asarray(positions), segment_ids))


def _alone(model, e: np.ndarray) -> np.ndarray:
    return _logits(model, e[None], np.arange(len(e))[None])[0]


def _packed_logits(model, eps, *, segments: bool = True) -> list[np.ndarray]:
    tokens, seg = _pack_row(eps, sum(map(len, eps)) + 1)
    logits = _logits(model, tokens, qwen2.positions_from_segments(seg), jnp.asarray(seg) if segments else None)[0]
    out, at = [], 0
    for e in eps:
        out.append(logits[at:at + len(e)])
        at += len(e)
    return out


def _max_leak(model, eps, **kw) -> float:
    return max(float(np.max(np.abs(p - _alone(model, e)))) for p, e in zip(_packed_logits(model, eps, **kw), eps))


def test_positions_from_segments():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(qwen2.positions_from_segments(seg),
                                  [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("query_block,causal_block", [(None, None), (8, None), (None, 4)])
def test_packed_logits_equal_each_episode_alone(model, monkeypatch, query_block, causal_block):
    """No attention across episodes, positions restart: every episode's logits are its logits alone,
    also through the query-block and causal-block paths of `attend` (blocks cross episode borders)."""
    monkeypatch.setattr(qwen2, "CAUSAL_BLOCK", causal_block or 10 ** 6)
    for layer in model.layers:
        monkeypatch.setattr(layer.attn, "query_block", query_block)
    assert _max_leak(model, _episodes()) < 1e-5


def test_packed_logits_with_scanned_and_rematerialised_layers():
    eps = _episodes(seed=1)
    for kw in (dict(scan_layers=True), dict(remat=True)):
        m = qwen2.create(CFG, seed=3, **kw)
        assert _max_leak(m, eps) < 1e-5, kw


def test_the_leak_test_can_fail(model):
    """The same comparison without the segment mask is far off: the test above catches a leak.
    (Not restarting positions would pass it: RoPE scores depend on position differences only;
    `test_packed_positions_restart_per_episode` checks the positions themselves.)"""
    assert _max_leak(model, _episodes(), segments=False) > 1e-2


def test_segment_ids_refuse_a_cache(model):
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="without a KV cache"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), cache=cache,
              segment_ids=jnp.ones((1, 4), jnp.int32))


def test_scoring_never_predicts_an_episode_from_the_previous_one(model):
    """logp of a packed row == each episode's own logp; 0 at every episode's first token (even when
    asked to score every position), never the previous episode's last hidden state."""
    eps = _episodes(seed=2)
    tokens, seg = _pack_row(eps, sum(map(len, eps)) + 3)
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, tokens, positions, segment_ids, score_mask):
        m = nnx.merge(graphdef, state)
        h, _ = m.hidden_states(tokens, positions, segment_ids=segment_ids)
        return logprobs_from_hidden(h, m.unembed(), tokens, score_mask=score_mask, segment_ids=segment_ids,
                                    chunk_size=None)

    for score_mask in (None, jnp.ones(tokens.shape, jnp.int32)):
        lp, ent = score(state, jnp.asarray(tokens), qwen2.positions_from_segments(seg), jnp.asarray(seg), score_mask)
        lp, ent = np.asarray(lp[0]), np.asarray(ent[0])
        at = 0
        for e in eps:
            ref_lp, ref_ent = score(state, jnp.asarray(e[None]), jnp.arange(len(e))[None], None, None)
            np.testing.assert_allclose(lp[at:at + len(e)], np.asarray(ref_lp[0]), atol=1e-5)
            np.testing.assert_allclose(ent[at:at + len(e)], np.asarray(ref_ent[0]), atol=1e-5)
            assert lp[at] == 0 and ent[at] == 0
            at += len(e)
        assert np.all(lp[at:] == 0)  # padding is never scored


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------

def test_first_fit_decreasing():
    assert packed.first_fit_decreasing([5, 9, 0, 3, 7, 2], 10) == [[1], [4, 3], [0, 5]]
    with pytest.raises(ValueError, match="pack_tokens=10; raise it"):
        packed.first_fit_decreasing([11], 10)


def test_spans_drop_padding_and_the_tail_after_the_last_policy_token():
    input_mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    loss_mask = np.array([[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 1, 0, 0, 0], [0] * 8])
    spans = packed.episode_spans(input_mask, loss_mask)
    assert [s.tolist() for s in spans] == [[2, 3, 4], [0, 1, 2, 3, 4], []]


def test_packed_positions_restart_per_episode():
    """The packed rows the model sees: each episode's tokens in order, its positions from 0."""
    batch = varied_batch()
    plan = ts.make_plan(batch, BASE.replace(pack_tokens=40, micro_batch_size=1))
    one = jax.tree.map(lambda x: jnp.asarray(x[0]), plan)
    tokens, positions, loss_mask = packed.model_inputs(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                                                       jnp.asarray(batch.loss_mask), one)
    np.testing.assert_array_equal(positions, qwen2.positions_from_segments(one.segment))
    spans = packed.episode_spans(batch.input_mask, batch.loss_mask)
    seen = 0
    for r in range(plan.rows):
        for s in range(1, int(one.segment[r].max()) + 1):
            at = np.flatnonzero(np.asarray(one.segment[r]) == s)
            e = int(one.row[r, at[0]])
            np.testing.assert_array_equal(np.asarray(tokens[r, at]), batch.tokens[e, spans[e]])
            np.testing.assert_array_equal(np.asarray(loss_mask[r, at]), batch.loss_mask[e, spans[e]])
            seen += 1
    assert seen == sum(len(s) > 0 for s in spans) == batch.shape[0] - 1


# ------------------------------------------------------------------------------------------------
# Packed loss and gradients == unpacked
# ------------------------------------------------------------------------------------------------

def varied_batch(b: int = 8, t: int = 32, seed: int = 0) -> trajectory.TrainBatch:
    """Episodes of very different lengths (6 .. 32 real tokens, right-padded, a few left-padded),
    1-3 policy turns each, one episode without policy tokens, old/ref log-probs off-policy."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(2, CFG.vocab_size, (b, t)).astype(np.int32)
    input_mask = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    lengths = rng.permutation(np.linspace(6, t, b).astype(int))
    for i, n in enumerate(lengths):
        start = 2 if i % 4 == 1 else 0  # left padding
        input_mask[i, start:n] = 1
        pos = start + 3
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(1, 5)
            loss_mask[i, pos:min(pos + k, n)] = 1
            pos += k + rng.randint(1, 3)
            if pos >= n:
                break
    loss_mask[b // 2] = 0
    loss_mask *= input_mask
    tokens = np.where(input_mask > 0, tokens, CFG.pad_token_id)
    noise = lambda s: (-np.log(CFG.vocab_size) + s * rng.randn(b, t)).astype(np.float32)  # noqa: E731
    return trajectory.make_batch(tokens, loss_mask, rng.randn(b).astype(np.float32), input_mask=input_mask,
                                sampler_logprobs=noise(0.1), old_logprobs=noise(0.4), ref_logprobs=noise(0.4))


BASE = train_state.TrainConfig(learning_rate=1e-3, num_mini_batches=1, micro_batch_size=4, kl_coef=0.01,
                      entropy_coef=0.01, logprob_chunk_size=8)


def _rel(a, b) -> float:
    num = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))
    return num / max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b))


@pytest.mark.parametrize("granularity", ["token", "sequence", "subsequence"])
def test_packed_loss_and_gradients_equal_unpacked(granularity):
    batch = trajectory.shard_batch(varied_batch(), None)
    model = qwen2.create(CFG, seed=4)
    cfg = BASE.replace(granularity=granularity)
    pcfg = cfg.replace(pack_tokens=40, micro_batch_size=1)
    plan = ts.make_plan(batch, pcfg)
    assert 1 < plan.rows < 8 and packed.plan_stats(plan)["pack_fill"] > 0.5  # several episodes per row
    state = train_state.create_train_state(model, cfg)
    loss, grads, metrics = ts.make_loss_and_grads(cfg)(state, batch)
    p_loss, p_grads, p_metrics = ts.make_loss_and_grads(pcfg)(state, batch)
    assert abs(float(loss)) > 1e-3
    np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-5, atol=1e-7)
    assert _rel(p_grads, grads) < 1e-5
    for key in ("pg_loss", "clipfrac", "ratio_mean", "ratio_min", "ratio_max", "kl_ref", "entropy", "approx_kl",
                "segment_length", "segments_per_response", "num_responses", "num_units", "num_tokens"):
        np.testing.assert_allclose(float(p_metrics[key]), float(metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key)


def test_packed_train_step_with_mini_batches_equals_unpacked():
    """Two mini-batches, old log-probs recomputed (packed too), through the Learner."""
    batch = trajectory.shard_batch(varied_batch(seed=1).replace(old_logprobs=None, ref_logprobs=None), None)
    # Adam moves each weight by about lr whatever its gradient's size once the gradient is far above
    # eps, so a rounding difference in a near-zero gradient would show at O(lr); eps = 1e-6 keeps such
    # weights (their gradients are rounding noise) from moving, and the comparison is of real updates.
    cfg = BASE.replace(num_mini_batches=2, micro_batch_size=None, kl_coef=0.0, granularity="subsequence",
                       adam_eps=1e-6)
    runs = {}
    for pack in (0, 48):
        learner = learner_lib.Learner(qwen2.create(CFG, seed=5), cfg.replace(pack_tokens=pack))
        metrics = learner.update(batch)
        runs[pack] = (jax.tree.map(np.asarray, learner.state.params), metrics)
    (params, m0), (p_params, m1) = runs[0], runs[48]
    assert m1["train/pack_rows"] < 4 and "train/pack_rows" not in m0
    np.testing.assert_allclose(m1["train/loss"], m0["train/loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m1["train/ratio_max"], m0["train/ratio_max"], rtol=1e-5)
    assert m0["train/ratio_max"] > 1 + 1e-4  # the second update saw recomputed old log-probs
    init = jax.tree.map(np.asarray, nnx.state(qwen2.create(CFG, seed=5)))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(init)))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(p_params), jax.tree.leaves(params)))
    assert moved > 1e-4 and diff < 0.01 * cfg.learning_rate


def test_pack_tokens_must_hold_the_longest_episode():
    batch = varied_batch()
    with pytest.raises(ValueError, match="raise it"):
        ts.make_plan(batch, BASE.replace(pack_tokens=16))
    with pytest.raises(ValueError, match=r"^train.pack_tokens must be in \[0, 1048576\] \(0: no packing\), got -1$"):
        dataclasses.replace(BASE, pack_tokens=-1)
