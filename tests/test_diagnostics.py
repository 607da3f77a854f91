"""Same-batch gradient diagnostics (`rl/diagnostics.py`, `train.grad_diagnostics_every`), on a tiny model:

- the cosines, norm ratios and norms of the three granularities' policy gradients against NumPy
  float64 on the flattened gradients, each gradient computed separately by the update's own
  gradient function with that granularity, on an off-policy batch (clipping active);
- the learner with diagnostics on applies exactly the update it applies with them off.
"""
from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import diagnostics
from workflow_r1.rl import learner as learner_lib
from workflow_r1.rl import losses
from workflow_r1.rl import scoring, train_state, train_step as ts

MODEL_CFG = get_preset("tiny").replace(vocab_size=64, num_layers=1)


def _batch(state: train_state.TrainState, rows: int = 8, length: int = 16, off_policy: float = 0.3) -> trajectory.TrainBatch:
    """Two assistant turns per row of unequal lengths; old log-probs = the model's own plus noise, so
    the three granularities' ratios (and clip decisions) differ."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, MODEL_CFG.vocab_size, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.int32)
    for b in range(rows):
        mask[b, 3:6 + b % 3] = 1
        mask[b, 10:13 + b % 4] = 1
    adv = rng.normal(size=rows).astype(np.float32)
    host = trajectory.make_batch(tokens, mask, adv)
    logp = np.asarray(scoring.compute_logprobs(state, trajectory.shard_batch(host, None), chunk_size=None))
    old = (logp + off_policy * rng.normal(size=logp.shape) * mask).astype(np.float32)
    return trajectory.shard_batch(host.replace(old_logprobs=old), None)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_diagnostics_match_numpy_on_the_separately_computed_gradients():
    cfg = train_state.TrainConfig(num_mini_batches=1, kl_coef=0.0, logprob_chunk_size=None, micro_batch_size=4)
    state = train_state.create_train_state(qwen2.create(MODEL_CFG, seed=0), cfg)
    batch = _batch(state)
    got = jax.device_get(diagnostics.make_grad_diagnostics(cfg)(state, batch))
    flat, clip = {}, {}
    for g in losses.GRANULARITIES:
        _, grads, m = ts.make_loss_and_grads(cfg.replace(granularity=g))(state, batch)
        flat[g], clip[g] = _flat(grads), float(m["clipfrac"])
    for a, b in itertools.combinations(losses.GRANULARITIES, 2):
        cos = flat[a] @ flat[b] / (np.linalg.norm(flat[a]) * np.linalg.norm(flat[b]))
        assert got[f"diag/cos_{a}_{b}"] == pytest.approx(cos, abs=1e-5), (a, b)
        ratio = np.linalg.norm(flat[a]) / np.linalg.norm(flat[b])
        assert got[f"diag/norm_ratio_{a}_{b}"] == pytest.approx(ratio, rel=1e-5), (a, b)
        assert cos < 0.9999, (a, b)  # the three really differ on this batch: the check can see a swap
    for g in losses.GRANULARITIES:
        assert got[f"diag/grad_norm_{g}"] == pytest.approx(np.linalg.norm(flat[g]), rel=1e-5)
        assert got[f"diag/clipfrac_{g}"] == pytest.approx(clip[g], abs=1e-6)
    assert len({round(clip[g], 6) for g in clip}) > 1 and max(clip.values()) > 0  # clipping differs
    assert set(got) == ({f"diag/{k}_{a}_{b}" for k in ("cos", "norm_ratio") for a, b in diagnostics.PAIRS}
                        | {f"diag/{k}_{g}" for k in ("grad_norm", "clipfrac") for g in losses.GRANULARITIES})


def test_a_zero_gradient_has_cosine_and_ratio_zero():
    g = {"token": {"w": np.zeros(3, np.float32)}, "sequence": {"w": np.ones(3, np.float32)}}
    out = jax.device_get(diagnostics.compare(g))
    assert out["diag/cos_token_sequence"] == 0 and out["diag/norm_ratio_token_sequence"] == 0
    assert out["diag/grad_norm_sequence"] == pytest.approx(np.sqrt(3))


def test_diagnostics_do_not_change_the_update():
    cfg = train_state.TrainConfig(num_mini_batches=2, kl_coef=0.01, learning_rate=1e-2, logprob_chunk_size=None)
    runs = {}
    for every in (0, 1):
        learner = learner_lib.Learner(qwen2.create(MODEL_CFG, seed=0), cfg.replace(grad_diagnostics_every=every))
        batch = _batch(learner.state).replace(old_logprobs=None)  # the trainer's batches carry none
        metrics = learner.update(batch, step=1)
        runs[every] = ([np.asarray(x) for x in jax.tree.leaves(learner.state.params)],
                       [np.asarray(x) for x in jax.tree.leaves(learner.state.opt_state)], metrics)
    (p_off, o_off, m_off), (p_on, o_on, m_on) = runs[0], runs[1]
    assert all(np.array_equal(a, b) for a, b in zip(p_off, p_on))
    assert all(np.array_equal(a, b) for a, b in zip(o_off, o_on))
    assert not any(k.startswith("diag/") for k in m_off)
    assert m_on["diag/grad_norm_token"] > 0 and -1 <= m_on["diag/cos_token_subsequence"] <= 1
    assert m_on["train/loss"] == m_off["train/loss"]
