"""Train step: chunked log-probs, exact gradient accumulation, the mini-batch loop, sharding.

References are computed another way: NumPy float64 log-softmax of the model's full logits, and a
plain Python loop of full-softmax losses with a separately built optax AdamW.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from workflow_r1 import sharding
from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import losses
from workflow_r1.rl import scoring, train_state, train_step as ts
from workflow_r1.rl.logprobs import logprobs_from_hidden

CFG = get_preset("tiny")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(_leaves(a), _leaves(b)))


def random_batch(b: int = 16, t: int = 20, seed: int = 0, *, with_old: bool = True, with_ref: bool = True,
                 left_pad: bool = True) -> trajectory.TrainBatch:
    """A multi-turn-shaped batch: prompt, 1-3 policy turns separated by observations, padding.

    Some rows are left-padded (input_mask 0 at the start), the last row has no policy token at all,
    and old/ref log-probs are random perturbations so that ratios leave the clip range.
    """
    rng = np.random.RandomState(seed)
    tokens = rng.randint(2, CFG.vocab_size, (b, t)).astype(np.int32)
    input_mask = np.ones((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    for i in range(b):
        start = rng.randint(0, 4) if (left_pad and i % 3 == 0) else 0
        input_mask[i, :start] = 0
        tokens[i, :start] = CFG.pad_token_id
        pos = start + 3  # prompt
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 5)
            loss_mask[i, pos:pos + n] = 1
            pos += n + rng.randint(1, 3)  # observation
            if pos >= t:
                break
    loss_mask[-1] = 0
    loss_mask *= input_mask
    adv = rng.randn(b).astype(np.float32)
    old = ref = None
    # Old/ref log-probs: something near the policy's (about -log V) with noise.
    if with_old:
        old = (-np.log(CFG.vocab_size) + 0.4 * rng.randn(b, t)).astype(np.float32)
    if with_ref:
        ref = (-np.log(CFG.vocab_size) + 0.4 * rng.randn(b, t)).astype(np.float32)
    sampler = (-np.log(CFG.vocab_size) + 0.1 * rng.randn(b, t)).astype(np.float32)
    return trajectory.make_batch(tokens, loss_mask, adv, input_mask=input_mask, sampler_logprobs=sampler,
                         old_logprobs=old, ref_logprobs=ref)


def reference_logprobs(model, batch, temperature=1.0) -> tuple[np.ndarray, np.ndarray]:
    """float64 NumPy log-softmax and entropy of the model's full [B, T, V] logits / temperature, shifted by one."""
    logits, _ = model(jnp.asarray(batch.tokens), jnp.asarray(batch.positions), input_mask=jnp.asarray(batch.input_mask))
    z = np.asarray(logits, np.float64)[:, :-1] / temperature                     # predicts t = 1..T-1
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    logsm = z - lse[..., None]
    target = np.take_along_axis(logsm, batch.tokens[:, 1:, None].astype(np.int64), -1)[..., 0]
    ent = -(np.exp(logsm) * logsm).sum(-1)
    pad = np.zeros((z.shape[0], 1))
    return np.concatenate([pad, target], 1), np.concatenate([pad, ent], 1)


# ------------------------------------------------------------------------------------------------
# Log-probs
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return qwen2.create(CFG, seed=1)


@pytest.mark.parametrize("chunk_size,logprob_policy_only", [(None, False), (4, False), (7, True), (64, True)])
def test_chunked_logprobs_equal_full_log_softmax(model, chunk_size, logprob_policy_only):
    batch = random_batch(6, 19, seed=2)
    ref_lp, ref_ent = reference_logprobs(model, batch)
    lp, ent = scoring.compute_logprobs(model, batch, chunk_size=chunk_size, with_entropy=True, micro_batch_size=3,
                                  logprob_policy_only=logprob_policy_only)
    lp, ent = np.asarray(lp), np.asarray(ent)
    real = batch.input_mask.astype(bool)
    real[:, 1:] &= batch.input_mask[:, :-1].astype(bool)  # scored from a real previous position
    if logprob_policy_only:  # only loss-mask tokens are scored; the rest are exactly 0
        assert np.all(lp[batch.loss_mask == 0] == 0) and np.all(ent[batch.loss_mask == 0] == 0)
        real &= batch.loss_mask.astype(bool)
        assert real.sum() > 20
    np.testing.assert_allclose(lp[real], ref_lp[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent[real], ref_ent[real], atol=2e-5, rtol=1e-5)
    assert np.all(lp[:, 0] == 0) and np.all(ent[:, 0] == 0)


def test_logprobs_at_the_rollout_temperature(model):
    """Scored at temperature T: log_softmax(logits / T), the distribution the sampler drew from."""
    batch = random_batch(4, 15, seed=5)
    ref_lp, ref_ent = reference_logprobs(model, batch, temperature=0.6)
    lp, ent = scoring.compute_logprobs(model, batch, chunk_size=4, with_entropy=True, temperature=0.6)
    real = batch.loss_mask.astype(bool) & batch.input_mask.astype(bool)
    real[:, 1:] &= batch.input_mask[:, :-1].astype(bool)
    np.testing.assert_allclose(np.asarray(lp)[real], ref_lp[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[real], ref_ent[real], atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(scoring.compute_logprobs(model, batch))[real] - ref_lp[real]).max() > 1e-3


@pytest.mark.parametrize("mode", ["recompute", "store"])
def test_chunked_logprob_gradients_equal_full_softmax(model, mode):
    """The custom VJP (recomputed or stored logits, compacted positions, entropy bonus) equals
    autodiff through the full log-softmax and entropy."""
    batch = random_batch(4, 17, seed=3)
    tokens, pos, mask = (jnp.asarray(x) for x in (batch.tokens, batch.positions, batch.input_mask))
    score = jnp.asarray(batch.loss_mask)
    rng = np.random.RandomState(0)
    w_lp, w_ent = (jnp.asarray(rng.randn(4, 17).astype(np.float32)) * score for _ in range(2))
    graphdef, params = nnx.split(model)
    budget = 0 if mode == "recompute" else 1 << 30

    def chunked(p):
        m = nnx.merge(graphdef, p)
        h, _ = m.hidden_states(tokens, pos, input_mask=mask)
        lp, ent = logprobs_from_hidden(h, m.unembed(), tokens, score_mask=score, chunk_size=3,
                                       unchunked_max_bytes=budget, entropy_grad=True)
        return jnp.sum(lp * w_lp + ent * w_ent)

    def full(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, pos, input_mask=mask)
        logsm = jax.nn.log_softmax(logits[:, :-1])
        lp = jnp.take_along_axis(logsm, tokens[:, 1:, None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
        return jnp.sum(lp * w_lp[:, 1:] + ent * w_ent[:, 1:])

    g1, g2 = jax.jit(jax.grad(chunked))(params), jax.jit(jax.grad(full))(params)
    scale = max(float(np.max(np.abs(x))) for x in _leaves(g2))
    assert scale > 1e-3
    assert _max_diff(g1, g2) < 1e-5 * max(scale, 1.0), (_max_diff(g1, g2), scale)


def _max_intermediate_with_last_dim(jaxpr, dim: int) -> int:
    """Largest size of any intermediate (all nested jaxprs included) whose last dimension is `dim`."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            if shape and shape[-1] == dim:
                best = max(best, int(np.prod(shape)))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    best = max(best, _max_intermediate_with_last_dim(inner, dim))
    return best


def test_train_loss_never_materialises_full_logits():
    """No [B, T, V] array in the forward or backward program when chunking; present without it."""
    cfg_m = CFG.replace(vocab_size=512)
    state = train_state.create_train_state(qwen2.create(cfg_m), train_state.TrainConfig(num_mini_batches=1))
    batch = jax.tree.map(jnp.asarray, random_batch(4, 40, seed=0))
    b, t = batch.tokens.shape
    v, d = cfg_m.vocab_size, cfg_m.hidden_size

    def biggest(chunk):
        cfg = train_state.TrainConfig(num_mini_batches=1, logprob_chunk_size=chunk, logprob_unchunked_max_mb=0)
        fn = lambda s, x: ts._loss_and_grads(s.params, s.graphdef, x, cfg)  # noqa: E731
        return _max_intermediate_with_last_dim(jax.make_jaxpr(fn)(state, batch).jaxpr, v)

    # The largest vocabulary-wide arrays may be the [D, V] head itself or one chunk's logits.
    assert biggest(8) <= max(d * v, b * 8 * v)
    assert biggest(None) >= b * (t - 1) * v  # the check can see full logits when they exist


# ------------------------------------------------------------------------------------------------
# Gradient accumulation, mini-batch loop, sharding
# ------------------------------------------------------------------------------------------------

STEP_CFG = train_state.TrainConfig(learning_rate=1e-3, warmup_steps=2, weight_decay=0.01, granularity="subsequence",
                          num_mini_batches=2, micro_batch_size=4, logprob_chunk_size=6, logprob_unchunked_max_mb=0,
                          kl_coef=0.05, clip_eps_low=0.2, clip_eps_high=0.28)


# Parameters after AdamW updates: the first update is about lr · g / (|g| + eps), so where a gradient
# element is near eps an ulp-level difference in g moves the result by a sizeable fraction of lr.
# 2% of lr still tells a correct step from any wrong one (which is off by O(lr) somewhere).
PARAM_ATOL = 0.02 * STEP_CFG.learning_rate


@pytest.fixture(scope="module")
def unsharded_run():
    """One unsharded run of `STEP_CFG` on a 16-row batch: the reference of the sharded run."""
    batch = random_batch(16, 20, seed=5)
    model = qwen2.create(CFG, seed=7)
    init_params = jax.tree.map(np.asarray, nnx.state(model))
    state = train_state.create_train_state(model, STEP_CFG)
    loss, grads, metrics = ts.make_loss_and_grads(STEP_CFG)(state, trajectory.shard_batch(batch, None))
    new_state, step_metrics = ts.make_train_step(STEP_CFG, donate=False)(state, trajectory.shard_batch(batch, None))
    return dict(batch=batch, init_params=init_params, state=state, loss=loss, grads=grads, metrics=metrics,
                new_state=new_state, step_metrics=step_metrics)


def test_micro_batch_accumulation_equals_one_big_batch(unsharded_run):
    """4 micro-batches (policy tokens only through the head) == 1 batch scoring every position."""
    r = unsharded_run
    whole = dataclasses.replace(STEP_CFG, micro_batch_size=None, logprob_policy_only=False)
    loss, grads, metrics = ts.make_loss_and_grads(whole)(r["state"], trajectory.shard_batch(r["batch"], None))
    assert abs(float(loss) - float(r["loss"])) < 1e-6
    assert _max_diff(grads, r["grads"]) < 1e-6
    scale = max(float(np.max(np.abs(g))) for g in _leaves(grads))
    assert scale > 1e-3  # the gradients are not trivially zero
    for key in ("pg_loss", "clipfrac", "ratio_mean", "ratio_min", "ratio_max", "kl_ref", "entropy",
                "segment_length", "segments_per_response", "num_responses", "num_tokens"):
        np.testing.assert_allclose(float(r["metrics"][key]), float(metrics[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    # The batch exercises clipping and an empty row.
    assert 0 < float(metrics["clipfrac"]) < 1 and float(metrics["num_responses"]) == 15


def test_max_staleness_applies_the_behaviour_weight(unsharded_run):
    """max_staleness > 0: the update's loss is `policy_loss` with the behaviour weight (cap
    behaviour_weight_cap) over full-softmax log-probs, accumulated over 4 micro-batches, and the
    per-unit and per-turn metrics combine to the whole batch's. max_staleness = 0 applies no weight."""
    r = unsharded_run
    cfg = STEP_CFG.replace(max_staleness=2, behaviour_weight_cap=1.2)
    b = r["batch"]
    loss, _, metrics = ts.make_loss_and_grads(cfg)(r["state"], trajectory.shard_batch(b, None))
    logp, ent = reference_logprobs(r["state"].model(), b)
    ref, ref_m = losses.policy_loss(
        jnp.asarray(logp, jnp.float32), b.old_logprobs, b.advantages, b.loss_mask, segment_ids=b.segment_ids,
        granularity=cfg.granularity, clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
        dual_clip_c=cfg.dual_clip_c, ref_logprobs=b.ref_logprobs, kl_coef=cfg.kl_coef,
        sampler_logprobs=b.sampler_logprobs, behaviour_cap=cfg.behaviour_weight_cap,
        entropy=jnp.asarray(ent, jnp.float32))
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5, atol=1e-6)
    for key in ("behaviour_weight_mean", "behaviour_capped_frac", "sampler_mismatch", "sampler_mismatch_sequence",
                "sampler_mismatch_subsequence", "pg_loss", "clipfrac", "segment_length"):
        np.testing.assert_allclose(float(metrics[key]), float(ref_m[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    assert 0 < float(metrics["behaviour_capped_frac"]) < 1
    assert abs(float(loss) - float(r["loss"])) > 1e-4
    assert "behaviour_weight_mean" not in r["metrics"] and "sampler_mismatch_subsequence" in r["metrics"]


def _reference_updates(init_params, graphdef, batch, cfg: train_state.TrainConfig):
    """Plain loop: full-softmax log-probs, one `policy_loss` per mini-batch, a separately built AdamW."""
    params = jax.tree.map(jnp.asarray, init_params)
    schedule = lambda count: cfg.learning_rate * jnp.minimum(1.0, (count + 1.0) / cfg.warmup_steps)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg.weight_decay))
    opt_state = tx.init(params)

    jb = jax.tree.map(jnp.asarray, batch)

    @jax.jit
    def loss_fn(p, rows):
        mb = jax.tree.map(lambda x: x[rows], jb)
        logits, _ = nnx.merge(graphdef, p)(mb.tokens, mb.positions, input_mask=mb.input_mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), mb.tokens[:, 1:, None], -1)[..., 0]
        logp = jnp.pad(logp, ((0, 0), (1, 0)))  # token t is predicted at t - 1; nothing predicts t = 0
        return losses.policy_loss(
            logp, mb.old_logprobs, mb.advantages, mb.loss_mask, segment_ids=mb.segment_ids,
            granularity=cfg.granularity, clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
            ref_logprobs=mb.ref_logprobs, kl_coef=cfg.kl_coef)[0]

    losses_out = []
    m = cfg.num_mini_batches
    for i in range(m):
        rows = jnp.arange(i, batch.tokens.shape[0], m)  # mini-batch i: rows i, i + m, ...
        loss, grads = jax.value_and_grad(loss_fn)(params, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses_out.append(float(loss))
    return params, losses_out


def test_mini_batch_loop_matches_plain_reference(unsharded_run):
    r = unsharded_run
    new_state, metrics = r["new_state"], r["step_metrics"]
    m = STEP_CFG.num_mini_batches
    assert int(new_state.step) == m
    counts = [int(x) for x in jax.tree.leaves(new_state.opt_state) if np.ndim(x) == 0]
    assert counts and all(c == m for c in counts)  # every optax counter saw m updates
    assert all(np.shape(v) == (m,) for v in metrics.values())
    np.testing.assert_allclose(np.asarray(metrics["learning_rate"]), [5e-4, 1e-3], rtol=1e-6)
    ref_params, ref_losses = _reference_updates(r["init_params"], r["state"].graphdef, r["batch"], STEP_CFG)
    np.testing.assert_allclose(np.asarray(metrics["loss"]), ref_losses, atol=1e-6)
    assert _max_diff(new_state.params, ref_params) < PARAM_ATOL
    assert _max_diff(new_state.params, r["init_params"]) > 1e-4  # the step moved the parameters


def test_old_logprobs_recomputed_when_absent(unsharded_run):
    """Without old log-probs the first update is exactly on-policy (all ratios 1)."""
    batch = dataclasses.replace(unsharded_run["batch"], old_logprobs=None)
    state = train_state.create_train_state(qwen2.create(CFG, seed=7), STEP_CFG)
    _, metrics = ts.make_train_step(STEP_CFG)(state, trajectory.shard_batch(batch, None))
    assert float(metrics["ratio_min"][0]) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics["ratio_max"][0]) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics["clipfrac"][0]) == 0.0
    assert abs(float(metrics["ratio_mean"][1]) - 1.0) > 1e-6  # the second update is off-policy


def test_sharded_step_equals_unsharded(unsharded_run):
    """data=2, fsdp=2, tensor=2 on 8 simulated devices, with remat: same loss, grads and params."""
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    r = unsharded_run
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg = STEP_CFG
    state = train_state.create_train_state(qwen2.create(CFG, seed=7, remat=True), cfg, mesh)
    q = state.params["layers"][0]["attn"]["q_kernel"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    mu = state.opt_state[1][0].mu["layers"][0]["attn"]["q_kernel"].get_value()
    assert mu.sharding.spec == q.sharding.spec  # AdamW moments sharded like their parameters
    batch = trajectory.shard_batch(r["batch"], mesh)
    assert batch.tokens.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)

    loss, grads, _ = ts.make_loss_and_grads(cfg, mesh)(state, batch)
    assert abs(float(loss) - float(r["loss"])) < 1e-6
    assert _max_diff(grads, r["grads"]) < 1e-6

    before = jax.tree.leaves(state.params)[0]
    new_state, step_metrics = ts.make_train_step(cfg, mesh)(state, batch)
    assert before.is_deleted()  # the old state was donated
    new_q = new_state.params["layers"][0]["attn"]["q_kernel"].get_value()
    assert new_q.sharding.is_equivalent_to(q.sharding, q.ndim) and len(new_q.sharding.device_set) == 8
    diffs = dict(loss=abs(float(loss) - float(r["loss"])), grads=_max_diff(grads, r["grads"]),
                 params=_max_diff(new_state.params, r["new_state"].params),
                 opt_state=_max_diff(new_state.opt_state, r["new_state"].opt_state))
    print("sharded vs unsharded max |diff|:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert diffs["opt_state"] < 1e-6
    assert diffs["params"] < PARAM_ATOL
    for key in ("loss", "grad_norm", "pg_loss", "clipfrac", "kl_ref"):
        np.testing.assert_allclose(np.asarray(step_metrics[key]), np.asarray(r["step_metrics"][key]),
                                   rtol=1e-5, atol=1e-6, err_msg=key)


# ------------------------------------------------------------------------------------------------
# Small pieces
# ------------------------------------------------------------------------------------------------

def test_make_batch_defaults_and_errors():
    tokens = np.array([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10]])
    mask = np.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0]])
    b = trajectory.make_batch(tokens, mask, [1.0, -1.0])
    np.testing.assert_array_equal(b.segment_ids, [[-1, -1, 0, 0, -1, -1], [-1, 0, -1, 1, 1, -1]])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 3, 4, 5]] * 2)
    b = trajectory.make_batch(tokens, mask, [1.0, -1.0], input_mask=[[0, 1, 1, 1, 1, 1], [1] * 6])
    np.testing.assert_array_equal(b.positions[0], [0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="loss_mask must have shape"):
        trajectory.make_batch(tokens, mask[:, :3], [1.0, -1.0])
    with pytest.raises(ValueError, match="granularity"):
        train_state.TrainConfig(granularity="turn")


def test_learning_rate_warmup():
    cfg = train_state.TrainConfig(learning_rate=1e-6, warmup_steps=4)
    np.testing.assert_allclose([float(train_state.learning_rate_at(cfg, s)) for s in range(6)],
                               [0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6, 1e-6], rtol=1e-6)
    assert float(train_state.learning_rate_at(cfg.replace(warmup_steps=0), 0)) == pytest.approx(1e-6)


def test_batch_not_divisible_is_a_clear_error(model):
    state = train_state.create_train_state(qwen2.create(CFG), train_state.TrainConfig(num_mini_batches=3))
    with pytest.raises(ValueError, match="does not split into 3 mini-batches"):
        ts.make_train_step(train_state.TrainConfig(num_mini_batches=3))(state, trajectory.shard_batch(random_batch(8, 10), None))


def test_maybe_initialize_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    for var in ("WORKFLOW_R1_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert sharding.maybe_initialize_distributed() is False and calls == []  # a laptop: nothing happens
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert sharding.maybe_initialize_distributed() is True
    assert calls == [{"num_processes": 4, "process_id": 2}]
    assert sharding.maybe_initialize_distributed(False) is False and len(calls) == 1


def test_train_state_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    cfg = train_state.TrainConfig()
    state = train_state.create_train_state(qwen2.create(CFG, seed=3), cfg)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()
    target = jax.eval_shape(lambda: train_state.create_train_state(qwen2.create(CFG, seed=0), cfg))
    back = ckpt.restore(tmp_path / "ckpt", target)
    assert _max_diff(back, state) == 0 and back.graphdef == state.graphdef
