"""Masks end to end: our Sampler rolls out multi-turn episodes through the executor, `pack` builds
the batch, the train step scores it, and only the policy's own tokens reach the loss.

A random tiny model (preset "tiny-chat" over the byte-level tokenizer) never writes a well-formed
turn, so every turn gets the WarningOp observation until the turn cap: each episode interleaves
assistant turns (loss mask 1) with observations (mask 0). What is checked against what:
- the trainer's log-probs of the sampled tokens equal the sampler's (same params, temperature 1);
- the segment count per response equals the episodes' assistant turns;
- whatever the batch holds at mask-0 positions (old / ref / sampler log-probs, segment ids) leaves
  the loss and its gradient unchanged, for every granularity;
- a loss mask of 1 on the observations (the bug "the loss on every token") changes the loss.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workflow_r1.data.questions import Question
from workflow_r1.task.config import EnvConfig
from workflow_r1.executor import ExecutorClient, FakeBackend, start_in_thread
from workflow_r1.model import qwen2
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import losses
from workflow_r1.rl import scoring, train_state, train_step as ts
from workflow_r1.rl.advantages import grpo_advantages
from workflow_r1.rollout import RolloutConfig, RolloutEngine, pack, padded_length
from workflow_r1.envs.workflow import WorkflowEnvironment
from workflow_r1.sampler import Sampler

# Turns of at most 16 tokens, and room for three of them with the two ~260-token warnings between.
ROLLOUT = RolloutConfig(prompts_per_step=2, n=2, temperature=1.0, max_prompt_tokens=128, max_response_tokens=640,
                        max_turn_tokens=16, max_assistant_turns=3, pad_multiple=64)
TRAIN = train_state.TrainConfig(learning_rate=1e-3, num_mini_batches=1, kl_coef=0.01, tis_cap=2.0, entropy_coef=0.01,
                       logprob_chunk_size=None, temperature=ROLLOUT.temperature)


@dataclasses.dataclass(frozen=True)
class ShortPromptEnv(EnvConfig):
    """The question alone as the prompt: our real prompt is ~3,800 byte tokens, which only slows the test."""

    def messages(self, question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def rollout():
    """(episodes, packed host batch, train state) of one rollout of 2 questions x 2 samples."""
    tok = tokenizer_lib.byte_level()
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    state = train_state.create_train_state(model, TRAIN)
    sampler = Sampler(state.model(), tok, cache_size=ROLLOUT.cache_size)
    with start_in_thread(FakeBackend()) as handle, ExecutorClient(handle.url, timeout_s=30) as client:
        engine = RolloutEngine(sampler, ROLLOUT, WorkflowEnvironment.of(tok, client.execute_many_sync, ShortPromptEnv(), ROLLOUT))
        questions = [Question(id=f"q{i}", question=q, golden_answers=(a,), data_source="test")
                     for i, (q, a) in enumerate([("What is the capital of France?", "Paris"),
                                                 ("Who wrote Hamlet?", "Shakespeare")])]
        episodes, _ = engine.run(questions, seed=1)
    # A random policy's rewards are all equal (zero advantages, nothing to learn from): spread them so
    # that every response pushes on its tokens.
    rewards = np.array([e.reward for e in episodes], np.float32) + 0.25 * np.arange(len(episodes))
    adv = np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=ROLLOUT.n))
    batch = pack(episodes, adv, pad_id=tok.pad_token_id, length=padded_length(episodes, ROLLOUT.pad_multiple))
    return episodes, batch, state


def test_episodes_interleave_turns_and_observations(rollout):
    episodes, batch, _ = rollout
    assert len(episodes) == 4
    for i, e in enumerate(episodes):
        assert e.num_turns >= 2 and e.operator_rounds >= 1, (e.num_turns, e.finish_reason)
        p, r = len(e.prompt_ids), e.response_length
        mask = batch.loss_mask[i]
        # Mask 1 exactly on the sampled turns; the observations in between are mask 0.
        assert mask[:p].sum() == 0 and mask[p:p + r].sum() == e.generated_tokens < r
        assert mask[p + r:].sum() == 0
        seg = batch.segment_ids[i]
        assert sorted(set(seg[mask == 1])) == list(range(e.num_turns)) and (seg[mask == 0] == -1).all()


def test_train_step_scores_the_sampled_tokens_like_the_sampler(rollout):
    episodes, batch, state = rollout
    step = ts.make_train_step(TRAIN, donate=False)
    _, metrics = step(state, batch)
    m = {k: float(v[0]) for k, v in jax.device_get(metrics).items()}
    # The recomputed log-probs (old = current params: one update, none stored) match the sampler's.
    assert m["sampler_mismatch"] < 1e-4, m["sampler_mismatch"]
    assert m["segments_per_response"] == pytest.approx(np.mean([e.num_turns for e in episodes]), rel=1e-6)
    assert m["num_tokens"] == sum(e.generated_tokens for e in episodes)
    assert m["num_responses"] == len(episodes) and np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # The same through compute_logprobs, token by token.
    logp = np.asarray(scoring.compute_logprobs(state, batch, chunk_size=None))
    on = batch.loss_mask == 1
    np.testing.assert_allclose(logp[on], batch.sampler_logprobs[on], atol=1e-4)
    assert (logp[~on] == 0).all()


def _with_off_policy_arrays(batch, state, seed=0):
    """The batch with old / ref log-probs near the trainer's (ratios leave 1, the KL is nonzero)."""
    rng = np.random.default_rng(seed)
    logp = np.asarray(scoring.compute_logprobs(state, batch, chunk_size=None))
    on = batch.loss_mask == 1
    old = np.where(on, logp + rng.normal(0, 0.3, logp.shape), 0).astype(np.float32)
    ref = np.where(on, logp + rng.normal(0, 0.3, logp.shape), 0).astype(np.float32)
    return batch.replace(old_logprobs=old, ref_logprobs=ref)


def _garbage_off_policy(batch, seed=1):
    """Every mask-0 position (prompt, observations, padding) of old / ref / sampler log-probs and
    segment ids replaced by arbitrary values."""
    rng = np.random.default_rng(seed)
    off = batch.loss_mask == 0

    def junk(x):
        return np.where(off, rng.uniform(-30, 5, x.shape), x).astype(np.float32)

    seg = np.where(off, rng.integers(0, 4, batch.segment_ids.shape), batch.segment_ids).astype(np.int32)
    return batch.replace(old_logprobs=junk(batch.old_logprobs), ref_logprobs=junk(batch.ref_logprobs),
                         sampler_logprobs=junk(batch.sampler_logprobs), segment_ids=seg)


@functools.cache
def _loss_and_grads_fn(granularity):
    return ts.make_loss_and_grads(TRAIN.replace(granularity=granularity))  # one compilation per granularity


def _loss_and_grads(granularity, state, batch):
    loss, grads, _ = _loss_and_grads_fn(granularity)(state, batch)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]


@pytest.mark.parametrize("granularity", losses.GRANULARITIES)
def test_only_policy_tokens_reach_the_loss(rollout, granularity):
    episodes, batch, state = rollout
    base = _with_off_policy_arrays(batch, state)
    loss, grads = _loss_and_grads(granularity, state, base)
    assert np.isfinite(loss) and any(np.abs(g).max() > 0 for g in grads)
    # Anything at mask-0 positions: the same loss and gradient, to the bit.
    loss2, grads2 = _loss_and_grads(granularity, state, _garbage_off_policy(base))
    assert loss2 == loss
    for g, g2 in zip(grads, grads2):
        np.testing.assert_array_equal(g2, g)
    # The loss on every response token (observations too, segments from that mask as `make_batch`
    # derives them) is another loss: a test that would catch that bug.
    everything = base.input_mask.copy()
    for i, e in enumerate(episodes):
        everything[i, :len(e.prompt_ids)] = 0
    assert (everything != base.loss_mask).any()
    wrong = base.replace(loss_mask=everything,
                         segment_ids=np.asarray(trajectory.segment_ids_from_mask(jnp.asarray(everything))))
    loss3, _ = _loss_and_grads(granularity, state, wrong)
    assert abs(loss3 - loss) > 1e-3 * max(1.0, abs(loss)), (loss, loss3)


def test_turn_segments_make_gsspo_differ_from_gspo(rollout):
    """With the turns as segments, GSsPO is not GSPO on multi-turn responses (it is when a response
    is one segment, which is what a loss mask over the observations would give)."""
    _, batch, state = rollout
    base = _with_off_policy_arrays(batch, state)
    sub, _ = _loss_and_grads("subsequence", state, base)
    seq, _ = _loss_and_grads("sequence", state, base)
    assert abs(sub - seq) > 1e-4, (sub, seq)

