"""A synthetic operator task that a tiny policy learns on a laptop CPU within minutes: the
workflow protocol in miniature, for comparing the policy losses (GRPO / GSPO / GSsPO) quickly.

An episode (token ids; after the answer every position is a pad with loss mask 0):

    [BOS, q] [think_0, act_0] [OBS, info_0] [think_1, act_1] [OBS, info_1] [think_2, act_2]
     prompt   policy           observation   policy           observation   policy

The question token q is one of 4 kinds; each kind has one operator that answers it correctly
(TARGET_OPERATOR[kind]). Each turn is a free "thought" token and an action:
  - act = an operator token: a call. The observation carries that operator's answer: RIGHT from
    the kind's operator, WRONG from any other;
  - act = ANSWER: the episode ends, answering with the last operator answer it observed (the way a
    policy restates an operator's result in `<answer>`); no answer observed yet = an empty answer;
  - any other token is a malformed turn (the WarningOp of the real protocol): [OBS, NOTHING].
Three turns at most. The reward is the workflow reward's table (env/reward.py): format 0 when every
turn is well formed and the episode answered, else -0.5; outcome 1 (RIGHT), 0 (WRONG) or -1 (no or
empty answer). The optimum (reward 1, EM 1, one call) is: call the kind's operator, then answer.
A random policy scores about -1.4 (it rarely answers).

Rollouts are sampled at temperature 1 by a jitted sampler over the same tiny Qwen2 the trainer
uses; the update is the trainer's own (`rl.train_step`, `rl.advantages.grpo_advantages`), with the
loss, clip range and optimiser of the `train` config section given, so the ablation compares
exactly the code paths of training.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workflow_r1.env.reward import FORMAT_PENALTY
from workflow_r1.model import qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.rl import batch as batch_lib
from workflow_r1.rl import train_step as ts
from workflow_r1.rl.advantages import grpo_advantages

PAD, BOS, OBS, ANSWER, NOTHING, RIGHT, WRONG = 0, 1, 2, 3, 4, 5, 6
KINDS = np.arange(7, 11)         # question tokens
OPERATORS = np.arange(11, 15)    # operator tokens
VOCAB = 16                       # 15 (and every token above) only makes a turn malformed
TARGET_OPERATOR = np.array([13, 11, 14, 12])  # kind -> the operator that answers it correctly
TURNS = 3
LENGTH = 2 + TURNS * 2 + (TURNS - 1) * 2     # 12 tokens


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Budgets of one ablation run on the operator task.

    steps: training steps; questions x group episodes each (groups of the same question adjacent).
    eval_questions: questions of the final greedy evaluation (the same set for every loss of a seed).
    """

    steps: int = 80
    questions: int = 32
    group: int = 8
    eval_questions: int = 512


def model_config(num_layers: int = 2) -> qwen2.Qwen2Config:
    """The `tiny` model preset over this task's 24-token vocabulary."""
    return get_preset("tiny").replace(vocab_size=VOCAB, num_layers=num_layers, eos_token_ids=(), pad_token_id=PAD)


@functools.partial(jax.jit, static_argnums=0)
def _rollout(graphdef, params, key, kind, greedy):
    """(tokens [B, T], sampler log-probs [B, T], loss mask [B, T], answer [B] (RIGHT, WRONG or
    NOTHING = empty; -1 = never answered), malformed [B] bool, calls [B]) of one batch of episodes.
    Recomputes the whole prefix for every sampled token (12 positions: cheaper to compile than a
    KV cache for a model this small)."""
    model = nnx.merge(graphdef, params)
    b = kind.shape[0]
    tokens = jnp.zeros((b, LENGTH), jnp.int32).at[:, 0].set(BOS).at[:, 1].set(jnp.asarray(KINDS)[kind])
    logprobs = jnp.zeros((b, LENGTH), jnp.float32)
    mask = jnp.zeros((b, LENGTH), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (b, LENGTH))
    done = jnp.zeros(b, bool)
    malformed = jnp.zeros(b, bool)
    calls = jnp.zeros(b, jnp.int32)
    answer = jnp.full(b, -1, jnp.int32)
    last_info = jnp.full(b, NOTHING, jnp.int32)  # the last operator answer observed
    target = jnp.asarray(TARGET_OPERATOR)[kind]
    operators = jnp.asarray(OPERATORS)
    for turn in range(TURNS):
        at = 2 + 4 * turn
        live = ~done
        for p in (at, at + 1):
            logits, _ = model(tokens, positions)
            logits = logits[:, p - 1].astype(jnp.float32)
            key, sub = jax.random.split(key)
            # `greedy` is traced (one compilation serves training and evaluation).
            tok = jnp.where(greedy, jnp.argmax(logits, -1), jax.random.categorical(sub, logits, -1))
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[:, None], -1)[:, 0]
            tokens = tokens.at[:, p].set(jnp.where(live, tok, PAD))
            logprobs = logprobs.at[:, p].set(jnp.where(live, lp, 0.0))
            mask = mask.at[:, p].set(live.astype(jnp.int32))
        act = tokens[:, at + 1]
        answered = live & (act == ANSWER)
        called = live & jnp.any(act[:, None] == operators, -1)
        malformed |= live & ~answered & ~called
        calls += called
        answer = jnp.where(answered, last_info, answer)
        done |= answered
        info = jnp.where(called, jnp.where(act == target, RIGHT, WRONG), NOTHING)
        last_info = jnp.where(called, info, last_info)
        if turn < TURNS - 1:
            tokens = tokens.at[:, at + 2].set(jnp.where(done, PAD, OBS)).at[:, at + 3].set(jnp.where(done, PAD, info))
    return tokens, logprobs, mask, answer, malformed, calls


def score(answer: np.ndarray, malformed: np.ndarray) -> dict[str, np.ndarray]:
    """Per-episode reward with its format and outcome terms (the workflow reward's table), and EM."""
    answered = answer >= 0
    em = answer == RIGHT
    fmt = np.where(answered & ~malformed, 0.0, FORMAT_PENALTY)
    outcome = np.where(em, 1.0, np.where(answer == WRONG, 0.0, -1.0))
    return {"reward": fmt + outcome, "format_ok": (fmt == 0.0).astype(np.float64), "em": em.astype(np.float64),
            "outcome": outcome}


def questions(rng: np.random.Generator, n: int) -> np.ndarray:
    """Question kinds [n], uniform."""
    return rng.integers(0, len(KINDS), n)


def evaluate(state: ts.TrainState, kind: np.ndarray) -> dict[str, float]:
    """Greedy episodes of the given questions: mean EM (with its standard error), reward, format, calls."""
    _, _, _, answer, malformed, calls = jax.device_get(
        _rollout(state.graphdef, state.params, jax.random.PRNGKey(0), jnp.asarray(kind), jnp.asarray(True)))
    s = score(answer, malformed)
    n = len(kind)
    return {"em": float(s["em"].mean()), "em_stderr": float(s["em"].std(ddof=1) / np.sqrt(n)),
            "reward": float(s["reward"].mean()), "format_ok": float(s["format_ok"].mean()),
            "calls": float(calls.mean()), "episodes": float(n)}


@functools.cache
def _train_step(train_cfg: ts.TrainConfig) -> Callable:
    """One jitted update per config: the seeds of a loss share its compilation."""
    return ts.make_train_step(train_cfg)


def train(train_cfg: ts.TrainConfig, seed: int, task: TaskConfig = TaskConfig(),
          log: Callable[[int, dict[str, float]], None] | None = None) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Trains a fresh tiny policy (initialised with `seed`) with `train_cfg`'s loss on the task.

    Returns (per-step rollout metrics: reward, em, format_ok, calls, loss, clip fraction, ...; the final
    greedy evaluation on `task.eval_questions` questions). The questions, the initial policy and the
    evaluation set depend only on `seed`, so runs of different losses with one seed are paired.
    """
    state = ts.create_train_state(qwen2.create(model_config(), seed=seed), train_cfg)
    step_fn = _train_step(train_cfg)
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    curve = []
    for step in range(task.steps):
        kind = np.repeat(questions(rng, task.questions), task.group)
        key, sub = jax.random.split(key)
        tokens, lps, mask, answer, malformed, calls = jax.device_get(
            _rollout(state.graphdef, state.params, sub, jnp.asarray(kind), jnp.asarray(False)))
        s = score(answer, malformed)
        adv = grpo_advantages(jnp.asarray(s["reward"], jnp.float32), group_size=task.group)
        batch = batch_lib.make_batch(tokens, mask, np.asarray(adv), sampler_logprobs=lps)
        state, metrics = step_fn(state, batch_lib.shard_batch(batch, None))
        row = {"reward": float(s["reward"].mean()), "em": float(s["em"].mean()),
               "format_ok": float(s["format_ok"].mean()), "calls": float(calls.mean())}
        row.update({f"train/{k}": float(np.mean(jax.device_get(metrics)[k])) for k in ("loss", "clipfrac")
                    if k in metrics})
        curve.append(row)
        if log is not None:
            log(step + 1, row)
    return curve, evaluate(state, questions(np.random.default_rng(10_000 + seed), task.eval_questions))
