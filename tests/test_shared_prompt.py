"""Shared-prompt scoring and updates (`train.share_prompts`, rl/shared_prompt.py) against the unshared
computation: per-token log-probs and entropies, GRPO / GSPO / GSsPO losses and gradients with and
without KL, LoRA and full fine-tuning, micro- and mini-batches, and the plan's grouping; the same
with the responses packed (`train.pack_tokens`), rows holding several prompts' responses."""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1 import trajectory
from workflow_r1.model import lora, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.rl import learner as learner_lib
from workflow_r1.rl import losses, shared_prompt, train_state
from workflow_r1.rl.logprobs import token_logprobs

CFG = get_preset("tiny")


def grouped_batch(groups: int = 3, n: int = 4, t: int = 40, seed: int = 0) -> trajectory.TrainBatch:
    """groups x n right-padded rows: a prompt per group (lengths differ across groups), then each
    sample's turns (policy tokens) and observations; the last row is a DAPO padding row (a copy
    of its group's first row without policy tokens), old/ref log-probs are noise around -log V."""
    rng = np.random.RandomState(seed)
    b = groups * n
    tokens = np.full((b, t), CFG.pad_token_id, np.int32)
    input_mask = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    for g in range(groups):
        p = rng.randint(5, 16)
        prompt = rng.randint(2, CFG.vocab_size, p)
        for s in range(n):
            i = g * n + s
            end = rng.randint(p + 2, t + 1)
            tokens[i, :p], tokens[i, p:end] = prompt, rng.randint(2, CFG.vocab_size, end - p)
            input_mask[i, :end] = 1
            at = p
            while at < end:
                k = rng.randint(1, 6)
                loss_mask[i, at:min(at + k, end)] = 1
                at += k + rng.randint(1, 4)
    tokens[-1], input_mask[-1], loss_mask[-1] = tokens[-n], input_mask[-n], 0
    noise = lambda s: (-np.log(CFG.vocab_size) + s * rng.randn(b, t)).astype(np.float32)  # noqa: E731
    return trajectory.make_batch(tokens, loss_mask, rng.randn(b).astype(np.float32), input_mask=input_mask,
                                 old_logprobs=noise(0.4), ref_logprobs=noise(0.4), sampler_logprobs=noise(0.1))


def _micro_plan(batch, **kw) -> shared_prompt.SharePlan:
    plan = shared_prompt.make_plan(batch.tokens, batch.positions, batch.input_mask, batch.loss_mask,
                                   num_mini_batches=1, micro_batch_size=None, multiple=8, **kw)
    return jax.tree.map(lambda x: jnp.asarray(x[0, 0]), plan)


def _diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _update_diff(a, b, initial) -> float:
    """|(a - initial) - (b - initial)| / |b - initial| over every parameter (L2): how far two
    updates from `initial` differ, relative to the update."""
    sq = lambda xs, ys: sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))  # noqa: E731
                            for x, y in zip(jax.tree.leaves(xs), jax.tree.leaves(ys)))
    return (sq(a, b) / sq(b, initial)) ** 0.5


def test_plan_groups_rows_by_prompt():
    batch = grouped_batch()
    plan = shared_prompt.make_plan(batch.tokens, batch.positions, batch.input_mask, batch.loss_mask,
                                   num_mini_batches=1, micro_batch_size=6, multiple=8)
    # Two strided micro-batches (rows 0, 2, 4, ... and 1, 3, 5, ...): each holds two rows of each group.
    assert plan.row_prompt.shape == (1, 2, 6, 1) and plan.prompt_row.shape == (1, 2, 3)
    np.testing.assert_array_equal(plan.row_prompt[0, 0, :, 0], [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(plan.row_prompt[0, 1, :5, 0], [0, 0, 1, 1, 2])
    assert plan.resp_segment[0, 1, 5].sum() == 0  # the padding row: nothing to score
    first_policy = np.argmax(batch.loss_mask, axis=1)
    np.testing.assert_array_equal(plan.resp_col[0, 0, :, 0], first_policy[0::2])
    np.testing.assert_array_equal(plan.resp_row[0, 0, :, 0], np.arange(6))
    stats = shared_prompt.plan_stats(plan, batch.tokens.shape)
    pp, rr = plan.prompt_mask.shape[-1], plan.resp_segment.shape[-1]
    ends, starts = batch.input_mask.sum(1)[:-1], first_policy[:-1]
    assert pp == -(-starts.max() // 8) * 8 and rr == min(40, -(-(ends - starts).max() // 8) * 8)
    assert stats["share_prompt_slots"] == 3 and stats["share_token_fraction"] == (3 * pp + 6 * rr) / (6 * 40)


def test_logprobs_equal_unshared():
    """Per-token log-probs and entropies of one micro-batch at a sampling temperature."""
    batch = grouped_batch()
    model = qwen2.create(CFG, seed=1)
    args = tuple(jnp.asarray(x) for x in (batch.tokens, batch.positions))
    plan = _micro_plan(batch)
    shared = jax.jit(lambda s: shared_prompt.token_logprobs(model, *args, plan, score_mask=s, temperature=0.7))
    unshared = jax.jit(lambda s: token_logprobs(model, *args, jnp.asarray(batch.input_mask), score_mask=s,
                                                temperature=0.7))
    # Shared scoring covers the responses (from each row's first policy token); prompts come out 0.
    row_start = np.asarray(plan.resp_col)[:, 0]
    resp = (np.arange(batch.tokens.shape[1])[None] >= row_start[:, None]) & (batch.input_mask > 0)
    resp[-1] = False
    for score_mask in (batch.loss_mask, batch.input_mask):  # policy tokens; every token
        lp, ent = shared(jnp.asarray(score_mask))
        ref_lp, ref_ent = (np.where(resp, x, 0.0) for x in unshared(jnp.asarray(score_mask)))
        assert np.count_nonzero(ref_lp) > 60
        assert _diff(lp, ref_lp) < 3e-6 and _diff(ent, ref_ent) < 3e-6


def _state(use_lora: bool, cfg: train_state.TrainConfig, **model_kw) -> train_state.TrainState:
    model = qwen2.create(CFG, seed=2, **model_kw)
    if use_lora:
        model = lora.attach(model, 4, 8.0, tuple(lora.TARGETS), seed=3)
        # Fresh adapters have B = 0 (no gradient reaches A); random ones exercise both factors.
        params = nnx.state(model, nnx.LoRAParam)
        keys = iter(jax.random.split(jax.random.PRNGKey(4), len(jax.tree.leaves(params))))
        nnx.update(model, jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), params))
    return train_state.create_train_state(model, cfg)


@pytest.mark.parametrize("use_lora", [False, True])
def test_losses_and_gradients_equal_unshared(use_lora):
    """GRPO (token), GSPO (sequence) and GSsPO (subsequence), each with and without KL and with an
    entropy bonus: the loss and its gradient w.r.t. the trained parameters (LoRA adapters: on a
    model with scanned, rematerialised layers; full: every parameter of an unrolled one).

    Each path's (log-prob, entropy) -> parameters VJP is compiled once and pulled back from every
    loss's cotangents: the chain rule of the whole differentiated function, six losses for the
    price of one backward program (the train step's own threading is the next test's)."""
    batch = jax.tree.map(jnp.asarray, grouped_batch(seed=5))
    state = _state(use_lora, train_state.TrainConfig(), remat=use_lora, scan_layers=use_lora)
    plan = _micro_plan(batch)

    def scored(params, shared):
        model = train_state.merge_model(state.graphdef, params, state.frozen)
        if shared:
            return shared_prompt.token_logprobs(model, batch.tokens, batch.positions, plan, score_mask=batch.loss_mask,
                                                entropy_grad=True)
        return token_logprobs(model, batch.tokens, batch.positions, batch.input_mask, score_mask=batch.loss_mask,
                              entropy_grad=True)

    paths = [jax.vjp(jax.jit(lambda p, s=s: scored(p, s)), state.params) for s in (False, True)]
    scale = 0.0
    for granularity in losses.GRANULARITIES:
        for kl in (0.0, 0.1):
            def loss(lp, ent):
                return losses.policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                          segment_ids=batch.segment_ids, granularity=granularity,
                                          ref_logprobs=batch.ref_logprobs, kl_coef=kl, entropy=ent,
                                          entropy_coef=0.01)[0]
            value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            (l0, ct0), (l1, ct1) = (value_and_grad(*out) for out, _ in paths)
            g0, g1 = paths[0][1](ct0)[0], paths[1][1](ct1)[0]
            scale = max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(g0))
            assert abs(float(l1) - float(l0)) < 1e-6, (granularity, kl)
            assert _diff(g1, g0) < 1e-5 * scale and scale > 1e-3, (granularity, kl, _diff(g1, g0), scale)


def test_micro_batch_order_puts_a_group_in_one_micro_batch():
    """Two groups of 8, two mini-batches of two micro-batches of 4: split strided, every micro-batch
    holds rows of both groups; reordered, each holds one group's rows (of its own mini-batch)."""
    batch = grouped_batch(groups=2, n=8, seed=6)

    def slots(b):
        plan = shared_prompt.make_plan(b.tokens, b.positions, b.input_mask, b.loss_mask, num_mini_batches=2,
                                       micro_batch_size=4, multiple=8)
        return [len(set(row[mask.sum(1) > 0])) for row, mask in zip(plan.row_prompt.reshape(4, 4),
                                                                     plan.resp_segment.reshape(4, 4, -1))]

    assert slots(batch) == [2, 2, 2, 2]
    for first in (0, 16):  # this host's rows at the batch's start, or after another host's 16
        src = shared_prompt.micro_batch_order(first + np.arange(16), num_mini_batches=2, num_micro=2)
        assert sorted(src) == list(range(16)) and np.all(src % 2 == np.arange(16) % 2)  # mini-batches kept
        assert slots(jax.tree.map(lambda x: x[src], batch)) == [1, 1, 1, 1]
    # A host holding every second block of 4 rows (devices of several hosts interleaved).
    rows = np.concatenate([np.arange(0, 4), np.arange(8, 12), np.arange(16, 20), np.arange(24, 28)])
    src = shared_prompt.micro_batch_order(rows, num_mini_batches=2, num_micro=2)
    assert sorted(src) == list(range(16)) and np.all(rows[src] % 2 == rows % 2)


def test_learner_update_equal_unshared():
    """The learner's step with KL from its rollout batch: the rows reordered so that each group's
    samples share micro-batches, the reference log-probs scored shared, then two mini-batches of two
    micro-batches each, the old log-probs recomputed shared inside the step: equal to the unshared
    step on the rows in their order. The same with the responses packed (train.pack_tokens: two or
    more a row); the batch's last row is a DAPO padding row (no policy token)."""
    batch = grouped_batch(groups=2, n=8, seed=6).replace(old_logprobs=None, ref_logprobs=None)
    batch = batch.replace(rewards=batch.advantages, advantages=None)
    cfg = train_state.TrainConfig(num_mini_batches=2, micro_batch_size=4, kl_coef=0.1, learning_rate=1e-3)
    runs = []
    for share, pack in ((False, 0), (True, 0), (True, 40)):
        learner = learner_lib.Learner(qwen2.create(CFG, seed=2), cfg.replace(share_prompts=share, pack_tokens=pack))
        prepared, _ = learner.prepare(batch, learner.select(batch.rewards, group_size=8, wanted=2))
        runs.append((learner.update(prepared), learner.state.params))
    (m0, p0), *shared = runs
    initial = nnx.state(qwen2.create(CFG, seed=2))
    for m1, p1 in shared:
        for key in ("train/loss", "train/kl_ref", "train/ratio_mean"):
            assert abs(m1[key] - m0[key]) < 1e-6, key
        assert abs(m1["train/grad_norm"] - m0["train/grad_norm"]) < 1e-5 and m0["train/kl_ref"] > 1e-6
        # Each micro-batch holds 4 rows of one group (2 rows of each group, split strided).
        assert m1["train/share_prompt_slots"] == 1 and "train/share_prompt_slots" not in m0
        # AdamW's first steps move each parameter by about the learning rate (1e-3) whatever its
        # gradient's size, so an element whose gradients nearly cancel over the two updates turns
        # last-digit differences into percent ones (one embedding element moved 5.19e-4 and 5.34e-4
        # when the plan's padding changed). The updates as a whole agree to float rounding.
        assert _update_diff(p1, p0, initial) < 1e-3 and _diff(p0, initial) > 1e-3
    # Packed, a micro-batch's 4 responses take fewer positions in rows of 40 (= T) than in 4 rows of R.
    assert shared[1][0]["train/share_token_fraction"] < shared[0][0]["train/share_token_fraction"]
    assert "train/pack_fill" not in shared[1][0]  # no separate packing plan: the share plan packs


def _packed_plan(batch, pack_tokens: int = 64) -> shared_prompt.SharePlan:
    plan = shared_prompt.make_plan(batch.tokens, batch.positions, batch.input_mask, batch.loss_mask,
                                   num_mini_batches=1, micro_batch_size=None, multiple=8, pack_tokens=pack_tokens)
    return jax.tree.map(lambda x: jnp.asarray(x[0, 0]), plan)


def test_packed_plan_puts_responses_of_two_groups_in_one_row():
    """With pack_tokens, a micro-batch's responses share rows of pack_tokens positions; every
    response token is where its row and column say, its row's prompt slots are its group's, and
    a row holds responses of several groups (the case the per-token prompt index is for)."""
    batch = grouped_batch()
    plan = jax.tree.map(np.asarray, _packed_plan(batch))
    seg, rows, cols = plan.resp_segment, plan.resp_row, plan.resp_col
    assert seg.shape[1] == 64 and seg.shape[0] < 11  # 11 responses, fewer rows
    slot = np.take_along_axis(plan.row_prompt, plan.resp_prompt, axis=1)
    group = np.asarray(plan.prompt_row)[slot] // 4  # the group whose prompt each token continues
    first_policy = np.argmax(batch.loss_mask, axis=1)
    seen = np.zeros(batch.tokens.shape, bool)
    for q in range(seg.shape[0]):
        for s in range(1, seg[q].max() + 1):
            at = seg[q] == s
            (row,) = set(rows[q, at])
            np.testing.assert_array_equal(cols[q, at], np.arange(first_policy[row], batch.input_mask[row].sum()))
            assert set(group[q, at]) == {row // 4}
            seen[row, cols[q, at]] = True
    np.testing.assert_array_equal(seen, (np.arange(40)[None] >= first_policy[:, None]) & (batch.input_mask > 0)
                                  & (np.arange(12) < 11)[:, None])
    assert max(len(set(group[q, seg[q] > 0])) for q in range(seg.shape[0])) >= 2


def test_packed_logprobs_and_gradients_equal_unshared_unpacked():
    """Packed response rows (some holding several groups' responses), full fine-tuning of an
    unrolled model: per-token log-probs and entropies (policy tokens, then every response token),
    and the GRPO (token) and GSsPO (subsequence) losses with KL and an entropy bonus and their
    gradients, against each row scored alone and unshared."""
    batch = jax.tree.map(jnp.asarray, grouped_batch(seed=5))
    state = _state(False, train_state.TrainConfig())
    plan = _packed_plan(batch)
    assert int(jnp.max(plan.resp_segment)) > 1 and plan.row_prompt.shape[1] >= 2  # rows of several groups

    def scored(params, shared, score_mask):
        model = train_state.merge_model(state.graphdef, params, state.frozen)
        if shared:
            return shared_prompt.token_logprobs(model, batch.tokens, batch.positions, plan, score_mask=score_mask,
                                                entropy_grad=True, temperature=0.7)
        return token_logprobs(model, batch.tokens, batch.positions, batch.input_mask, score_mask=score_mask,
                              entropy_grad=True, temperature=0.7)

    row_start = np.argmax(np.asarray(batch.loss_mask), axis=1)
    resp = (np.arange(batch.tokens.shape[1])[None] >= row_start[:, None]) & (np.asarray(batch.input_mask) > 0)
    resp[-1] = False
    everything = jax.jit(lambda p, s: scored(p, s, batch.input_mask), static_argnums=1)
    (lp, ent), (ref_lp, ref_ent) = everything(state.params, True), everything(state.params, False)
    assert _diff(lp, np.where(resp, ref_lp, 0.0)) < 3e-6 and _diff(ent, np.where(resp, ref_ent, 0.0)) < 3e-6
    paths = [jax.vjp(jax.jit(lambda p, s=s: scored(p, s, batch.loss_mask)), state.params) for s in (False, True)]
    assert _diff(paths[1][0], paths[0][0]) < 3e-6
    for granularity in ("token", "subsequence"):
        def loss(lp, ent):
            return losses.policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                      segment_ids=batch.segment_ids, granularity=granularity,
                                      ref_logprobs=batch.ref_logprobs, kl_coef=0.1, entropy=ent, entropy_coef=0.01)[0]
        value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        (l0, ct0), (l1, ct1) = (value_and_grad(*out) for out, _ in paths)
        g0, g1 = paths[0][1](ct0)[0], paths[1][1](ct1)[0]
        scale = max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(g0))
        assert abs(float(l1) - float(l0)) < 1e-6, granularity
        assert _diff(g1, g0) < 1e-5 * scale and scale > 1e-3, (granularity, _diff(g1, g0), scale)


def test_a_response_longer_than_pack_tokens_is_refused():
    batch = grouped_batch()
    with pytest.raises(ValueError, match="does not fit train.pack_tokens=16"):
        _packed_plan(batch, pack_tokens=16)


def test_with_packing_micro_batches_still_count_rows():
    """Plain packing counts packed rows per micro-batch; shared and packed, micro-batches are of the
    batch's rows (packing lays out their responses), so the run's check asks them to divide."""
    from workflow_r1 import configlib, run_config

    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / "gsspo.py"

    def run(*extra):
        return run_config.Run.from_config(configlib.load(f"{config}:tiny", ["mesh.data=1", "mesh.fsdp=1", *extra]))

    assert run("train.pack_tokens=256", "train.micro_batch_size=3").train.pack_tokens == 256  # 8 rows
    with pytest.raises(configlib.ConfigError, match="mini-batches of whole train.micro_batch_size=3"):
        run("train.pack_tokens=1024", "train.micro_batch_size=3", "train.share_prompts=True")
    assert run("train.pack_tokens=1024", "train.micro_batch_size=4", "train.share_prompts=True").train.share_prompts
    # Shared, a packed row holds responses: one shorter than the response budget is refused when the
    # config is read (it used to fail at the first update, after a whole rollout).
    with pytest.raises(configlib.ConfigError) as e:
        run("train.pack_tokens=1023", "train.micro_batch_size=4", "train.share_prompts=True")
    assert str(e.value) == ("train.pack_tokens=1023 is below rollout.max_response_tokens=1024: with train.share_prompts a "
                            "packed row must hold the longest response; raise train.pack_tokens or lower "
                            "rollout.max_response_tokens")
