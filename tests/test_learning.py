"""End-to-end learning check: sample from the current policy, reward, GRPO advantages, train step.

A synthetic multi-turn "workflow" task. A prompt names one of two tasks; the policy then acts in
three turns of two tokens each, and the first token of turn k should be the operator that the task
prescribes for that turn. After each of the first two turns an observation (mask 0) follows: a
fixed marker for the turn and an echo of the operator the policy chose, as an executor's reply would.

    [BOS, TASK] [op_0, arg_0] [OBS_0, echo(op_0)] [op_1, arg_1] [OBS_1, echo(op_1)] [op_2, arg_2]
                 policy         observation         policy        observation         policy

reward = (1/3) Σ_k [op_k == TARGETS[task][k]]. A random policy over the 16-token vocabulary scores
about 1/16; the optimum is 1. Each loss (GRPO token, GSPO sequence, GSsPO sub-sequence) must lift the
mean reward from near chance to near 1, and the same run with the advantage sign flipped must not.
Rollouts come from a minimal jitted ancestral sampler over the same tiny model (temperature 1), so
the sampler's log-probs must also agree with the train step's recomputed ones (a shift check).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.rl import batch as batch_lib
from workflow_r1.rl import train_step as ts
from workflow_r1.rl.advantages import grpo_advantages

VOCAB = 16
BOS, OBS0, OBS1 = 4, 5, 6
TASKS = np.array([2, 3])
OPS = np.arange(8, 16)
TARGETS = np.array([[8, 9, 10], [11, 12, 13]])  # task -> operator per turn
# Token layout: kind 0 prompt, 1 policy, 2 fixed observation marker, 3 echo of the token at ECHO_SRC.
KIND = np.array([0, 0, 1, 1, 2, 3, 1, 1, 2, 3, 1, 1])
FIXED = np.array([BOS, 0, 0, 0, OBS0, 0, 0, 0, OBS1, 0, 0, 0])
ECHO_SRC = np.array([0, 0, 0, 0, 0, 2, 0, 0, 0, 6, 0, 0])
OP_POS = np.array([2, 6, 10])
T = len(KIND)
LOSS_MASK = (KIND == 1).astype(np.int32)

MODEL_CFG = get_preset("tiny").replace(vocab_size=VOCAB, num_layers=1)
N_PROMPTS, GROUP = 32, 8
STEPS = 50


def make_sampler(graphdef):
    """Jitted (params, key, task [B]) -> (tokens [B, T], sampler_logprobs [B, T]) from the policy."""
    kind, fixed, src = jnp.asarray(KIND), jnp.asarray(FIXED), jnp.asarray(ECHO_SRC)
    positions = jnp.arange(T, dtype=jnp.int32)

    @jax.jit
    def sample(params, key, task):
        model = nnx.merge(graphdef, params)
        b = task.shape[0]
        tokens = jnp.zeros((b, T), jnp.int32).at[:, 0].set(BOS).at[:, 1].set(task)
        pos = jnp.broadcast_to(positions, (b, T))

        def body(t, carry):
            tokens, lps, key = carry
            key, sub = jax.random.split(key)
            # Full recompute each step (no cache): tokens after t do not affect position t - 1.
            logits, _ = model(tokens, pos)
            logits_prev = jax.lax.dynamic_index_in_dim(logits, t - 1, axis=1, keepdims=False)  # [B, V]
            logprobs = jax.nn.log_softmax(logits_prev, axis=-1)
            sampled = jax.random.categorical(sub, logits_prev, axis=-1).astype(jnp.int32)
            echoed = jax.lax.dynamic_index_in_dim(tokens, src[t], axis=1, keepdims=False)
            new = jnp.where(kind[t] == 1, sampled, jnp.where(kind[t] == 3, echoed, fixed[t]))
            lp = jnp.where(kind[t] == 1, jnp.take_along_axis(logprobs, new[:, None], axis=-1)[:, 0], 0.0)
            return tokens.at[:, t].set(new), lps.at[:, t].set(lp), key

        tokens, lps, _ = jax.lax.fori_loop(2, T, body, (tokens, jnp.zeros((b, T), jnp.float32), key))
        return tokens, lps

    return sample


def rewards_of(tokens: np.ndarray, task_index: np.ndarray) -> np.ndarray:
    """[B] fraction of turns whose operator token is the task's target for that turn."""
    return (tokens[:, OP_POS] == TARGETS[task_index]).mean(axis=1).astype(np.float32)


def run(granularity: str, *, sign: float = 1.0, steps: int = STEPS, seed: int = 0, lr: float = 3e-3,
        verbose: bool = True, check_sampler: bool = True, dtype=jnp.float32) -> list[float]:
    """Trains a fresh tiny policy (fp32 parameters, compute in `dtype`); returns the mean reward of
    each step's rollouts."""
    cfg = ts.TrainConfig(learning_rate=lr, weight_decay=0.0, granularity=granularity, num_mini_batches=2,
                         micro_batch_size=32, logprob_chunk_size=4, logprob_unchunked_max_mb=0, kl_coef=0.0)
    state = ts.create_train_state(qwen2.create(MODEL_CFG, seed=seed, dtype=dtype), cfg)
    sample = make_sampler(state.graphdef)
    step = ts.make_train_step(cfg)
    rng = np.random.RandomState(seed)
    key = jax.random.PRNGKey(seed)
    curve = []
    t0 = time.time()
    for i in range(steps):
        task_index = np.repeat(rng.randint(0, len(TASKS), N_PROMPTS), GROUP)  # groups adjacent
        key, sub = jax.random.split(key)
        tokens, sampler_lp = jax.device_get(sample(state.params, sub, jnp.asarray(TASKS[task_index])))
        rewards = rewards_of(tokens, task_index)
        adv = sign * np.asarray(grpo_advantages(jnp.asarray(rewards), group_size=GROUP))
        batch = batch_lib.make_batch(tokens, np.broadcast_to(LOSS_MASK, tokens.shape), adv, sampler_logprobs=sampler_lp)
        state, metrics = step(state, batch_lib.shard_batch(batch, None))
        curve.append(float(rewards.mean()))
        if i == 0 and check_sampler:
            # Sampler and trainer score the same tokens with the same params: the recomputed old
            # log-probs must match the sampler's on every policy token (checks the t-1 shift).
            mismatch = float(metrics["sampler_mismatch"][0])
            assert mismatch < 1e-4, f"sampler vs trainer log-prob mismatch {mismatch}"
        if verbose and (i % 10 == 0 or i == steps - 1):
            print(f"[{granularity} sign={sign:+.0f}] step {i:3d} reward {curve[-1]:.3f} "
                  f"loss {float(metrics['loss'][0]):+.4f} ({time.time() - t0:.1f}s)", flush=True)
    return curve


@pytest.mark.parametrize("granularity", ["token", "sequence", "subsequence"])
def test_policy_learns_multiturn_operator_task(granularity):
    curve = run(granularity)
    start, end = np.mean(curve[:2]), np.mean(curve[-3:])
    print(f"{granularity}: reward {start:.3f} -> {end:.3f} in {len(curve)} steps")
    assert start < 0.15, f"a random policy should score near 1/16, got {start:.3f}"
    assert end > 0.9, f"{granularity}: mean reward only reached {end:.3f} (curve {np.round(curve, 2)})"


def test_policy_learns_with_bf16_compute():
    """Mixed precision (bf16 matmuls, fp32 master weights; model/mixed.py) learns the task too."""
    curve = run("subsequence", dtype=jnp.bfloat16)
    start, end = np.mean(curve[:2]), np.mean(curve[-3:])
    print(f"subsequence, bf16 compute: reward {start:.3f} -> {end:.3f} in {len(curve)} steps")
    assert start < 0.15, f"a random policy should score near 1/16, got {start:.3f}"
    assert end > 0.9, f"bf16 compute: mean reward only reached {end:.3f} (curve {np.round(curve, 2)})"


def test_sign_flipped_advantages_do_not_learn():
    """The same run with -A must drive the reward down, not up: the gradient sign is right."""
    curve = run("subsequence", sign=-1.0, steps=20)
    assert np.mean(curve[-3:]) < 0.05, f"sign-flipped training still raised the reward: {np.round(curve, 2)}"
