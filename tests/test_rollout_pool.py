"""The slot-pool rollout engine (rollout/pool.py) and the sampler calls it rests on.

The policy is the `tiny-chat` preset's random model over the byte-level tokenizer. A random model
never writes a well-formed tool call, so the episodes run in `EchoEnv`, an environment whose
decisions depend only on the episode's own tokens: a turn whose first token is a multiple of 3 gets
a reply, any other turn an operator call (echoed back after a latency the test chooses), and the
fourth turn ends the episode. Many end-of-turn ids make turns of different lengths, so the slots
finish at different times and the pool really refills and overlaps.
"""
from __future__ import annotations

import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workflow_r1.data.questions import Question
from workflow_r1.task import reward
from workflow_r1.model import qwen2
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.model.config import get_preset
from workflow_r1.rollout import RolloutConfig, RolloutEngine
from workflow_r1.rollout.environment import Opening, Step
from workflow_r1.rollout.episode import Turn
from workflow_r1.sampler import Sampler, sampling

EOS_IDS = tuple(range(100, 120))  # ~6% of a random model's draws end the turn
CFG = dict(prompts_per_step=2, n=4, max_prompt_tokens=64, max_response_tokens=120, max_turn_tokens=24,
           max_assistant_turns=4)


class EchoEnv:
    """See the module docstring. `latency(call) -> seconds`; `fail`: calls whose content starts
    with it raise inside `execute`; `hook(episode, turn_ids)`: called by every `step`."""

    def __init__(self, tok, latency=lambda call: 0.0, fail=None, hook=None):
        self.tok, self.latency, self.fail, self.hook = tok, latency, fail, hook

    def open(self, question):
        return Opening([{"role": "user", "content": question.question}],
                       self.tok.encode(question.question, add_special_tokens=False))

    def step(self, episode, turn_ids):
        if self.hook is not None:
            self.hook(episode, turn_ids)
        text = self.tok.decode(list(turn_ids))
        if episode.num_turns + 1 >= 4:
            return Step(Turn(text, "answer", None), finish="answer")
        if turn_ids[0] % 3 == 0:
            return Step(Turn(text, "warning", "WarningOp"), reply=f"warn {len(turn_ids)}")
        return Step(Turn(text, "tool", "Echo"), call=("Echo", f"{episode.group}.{episode.sample}:{turn_ids[0]}"))

    def execute(self, calls):
        out = []
        for call in calls:
            time.sleep(self.latency(call))
            if self.fail is not None and call[1].startswith(self.fail):
                raise RuntimeError("the operator fell over")
            out.append((f"echo {call[1]}", None))
        return out

    def observe(self, episode, text):
        return self.tok.encode(text, add_special_tokens=False), text

    def score(self, episode):
        return reward.RewardBreakdown(0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.byte_level()


@pytest.fixture(scope="module")
def sampler(tok):
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    return Sampler(model, tok, cache_size=RolloutConfig(**CFG).cache_size, eos_ids=EOS_IDS)


@pytest.fixture(scope="module", params=["fused_cpu", "model", "model_scanned"])
def any_sampler(request, sampler, tok):
    """The fixture's sampler (the fused CPU path), one on the NNX model's own forward, and one on the
    model with scanned layers (its stacked [L, B, ...] cache keeps rows on axis 1)."""
    if request.param == "fused_cpu":
        return sampler
    model = qwen2.create(get_preset("tiny-chat"), seed=0, scan_layers=request.param == "model_scanned")
    return Sampler(model, tok, cache_size=sampler.cache_size, eos_ids=EOS_IDS, impl="model")


QUESTIONS = [Question(id=f"q{i}", question=q, golden_answers=("x",), data_source="test")
             for i, q in enumerate(["What is the capital of France?", "Who wrote Hamlet?"])]


def _run(sampler, env, *, greedy=False, seed=5, questions=QUESTIONS, **cfg):
    engine = RolloutEngine(sampler, RolloutConfig(**{**CFG, **cfg}), env)
    return engine.run(questions, seed=seed, greedy=greedy)


# Two engines compute a row in batches of different shapes, so its logits agree only to float
# rounding; where the two best tokens tie to that precision, greedy decoding may take either. An
# episode may part from its reference at such a token only: a policy token whose log-prob is the same
# under both engines within NEAR_TIE (both picks were the maximum). Up to it the episodes are equal;
# after it they are different episodes. A sampled draw that parts is refused (its two tokens' log-probs
# differ), as is a parting anywhere else: at an observation, the prompt, or a token of a real gap.
NEAR_TIE = 1e-4


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.group, x.sample) == (y.group, y.sample) and x.prompt_ids == y.prompt_ids
        i = next((k for k, (s, t) in enumerate(zip(x.response_ids, y.response_ids)) if s != t), None)
        if i is None:
            assert (x.finish_reason, x.response_ids) == (y.finish_reason, y.response_ids)
            assert x.loss_mask == y.loss_mask and x.segment_ids == y.segment_ids
            assert [t.observation for t in x.turns] == [t.observation for t in y.turns]
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            continue
        gap = abs(x.logprobs[i] - y.logprobs[i])
        assert x.loss_mask[i] == y.loss_mask[i] == 1 and gap < NEAR_TIE, (
            f"episode {x.group}/{x.sample} parts at response token {i} ({x.response_ids[i]} != {y.response_ids[i]}, "
            f"loss mask {x.loss_mask[i]}/{y.loss_mask[i]}, log-probs {x.logprobs[i]:.6f} / {y.logprobs[i]:.6f}): "
            "not a near-tie of two policy tokens")
        assert x.loss_mask[:i] == y.loss_mask[:i] and x.segment_ids[:i] == y.segment_ids[:i]
        np.testing.assert_allclose(x.logprobs[:i], y.logprobs[:i], atol=1e-4)


# ----------------------------------------------------------------------------------- the sampler

def test_paused_turn_resumes_with_the_same_draws(any_sampler):
    """generate_from(stop_after=1) + a resumed call with step_offset == one uninterrupted call."""
    sampler = any_sampler
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    kw = dict(temperature=1.0, seed=[3, 4, 5], row_ids=[7, 8, 9])
    full = sampler.generate_from(sampler.start(prompts), 30, rows=[0, 1, 2], **kw)
    session = sampler.start(prompts)
    first = sampler.generate_from(session, 30, rows=[0, 1, 2], stop_after=1, **kw)
    assert sum(r != "paused" for r in first.finish_reason) >= 1 and "paused" in first.finish_reason
    rest = [i for i, r in enumerate(first.finish_reason) if r == "paused"]
    done = [len(first.tokens[i]) for i in rest]
    second = sampler.generate_from(session, [30 - d for d in done], rows=rest, temperature=1.0,
                                   seed=[kw["seed"][i] for i in rest], row_ids=[kw["row_ids"][i] for i in rest],
                                   step_offset=done)
    for i in range(3):
        toks, lps = first.tokens[i], list(first.logprobs[i])
        if i in rest:
            j = rest.index(i)
            toks, lps = toks + second.tokens[j], lps + list(second.logprobs[j])
        assert toks == full.tokens[i]
        np.testing.assert_allclose(lps, full.logprobs[i], atol=1e-5)


def test_reset_and_fork_continue_like_a_fresh_row(any_sampler):
    """A pool row reset to a prompt, or forked from a prefilled row, generates what a fresh session does."""
    sampler = any_sampler
    prompt, other = [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36]
    ref = sampler.generate_from(sampler.start([prompt]), 12, temperature=1.0, seed=9, row_ids=[4])
    pool = sampler.start_pool(3)
    sampler.reset(pool, 0, other)
    sampler.generate_from(pool, 12, rows=[0], temperature=1.0, seed=1)   # the slot held something else
    sampler.reset(pool, 0, prompt)
    assert sampler.prefill(pool, [0]) == len(prompt) - 1
    sampler.fork(pool, 0, [1, 2])
    out = sampler.generate_from(pool, 12, rows=[0, 1, 2], temperature=1.0, seed=9, row_ids=[4, 4, 4])
    for toks, lps in zip(out.tokens, out.logprobs):
        assert toks == ref.tokens[0]
        np.testing.assert_allclose(lps, ref.logprobs[0], atol=1e-5)


# -------------------------------------------------------------------------------- the pool engine

def test_cache_memory_is_set_by_max_rows_in_flight(sampler, tok):
    """Pool: B = 4 x M allocates the bytes of B = M (closed form: M slots x the session's length x
    (fp32 K and V per layer + a valid flag) + an int32 end per slot); lock-step grows with B."""
    env = EchoEnv(tok)
    m = 2
    _, small = _run(sampler, env, questions=QUESTIONS[:1], n=m, engine="pool", max_rows_in_flight=m)
    _, big = _run(sampler, env, questions=QUESTIONS, n=4, engine="pool", max_rows_in_flight=m)
    c = sampler.cfg
    slots = -(-(sampler.cache_size + sampler.prefill_chunk) // 64) * 64
    per_slot_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4 + 1
    assert small.kv_cache_bytes == big.kv_cache_bytes == m * (slots * per_slot_token + 4)
    _, lock_small = _run(sampler, env, questions=QUESTIONS[:1], n=m)
    _, lock_big = _run(sampler, env, questions=QUESTIONS, n=4)
    assert lock_big.kv_cache_bytes > lock_small.kv_cache_bytes  # the lock-step cache holds every row


@pytest.mark.parametrize("greedy", [False, True])
def test_episodes_do_not_depend_on_the_schedule(sampler, tok, greedy):
    """Same episodes for M = B, B/4, 1, with shuffled executor latencies, and as the lock-step engine."""
    b = CFG["prompts_per_step"] * CFG["n"]
    lockstep, _ = _run(sampler, EchoEnv(tok), greedy=greedy)
    assert sum(t.observation is not None and t.operator == "Echo" for e in lockstep for t in e.turns) >= 4
    assert len({e.response_length for e in lockstep}) > 1  # the turns really end at different times
    for m, salt in [(b, 0), (b // 4, 1), (1, 2), (b // 4, 3)]:
        rng = random.Random(salt)
        delays = {}
        env = EchoEnv(tok, latency=lambda call: delays.setdefault(call, rng.choice([0.0, 0.002, 0.02])))
        episodes, stats = _run(sampler, env, greedy=greedy, engine="pool", max_rows_in_flight=m)
        _assert_same(episodes, lockstep)


def test_a_call_in_flight_does_not_stop_the_others(sampler, tok):
    """Episode (0, 0)'s first call blocks until another episode ends its third turn: only an engine
    that keeps decoding the other rows while a call is out gets there (lock-step would wait 20 s)."""
    others_went_on = threading.Event()
    seen = {}

    def hook(episode, turn_ids):
        if (episode.group, episode.sample) != (0, 0) and episode.num_turns + 1 >= 3:
            others_went_on.set()

    def latency(call):
        if call[1].startswith("0.0:") and "first" not in seen:
            seen["first"] = others_went_on.wait(timeout=20)
        return 0.0

    env = EchoEnv(tok, latency=latency, hook=hook)
    episodes, _ = _run(sampler, env, engine="pool", max_rows_in_flight=8, seed=11)
    assert "first" in seen, "episode (0, 0) made no call with this seed; pick another"
    assert seen["first"] is True
    assert all(e.finish_reason is not None for e in episodes)


def test_an_executor_fault_is_an_observation(sampler, tok):
    env = EchoEnv(tok, fail="0.")
    episodes, _ = _run(sampler, env, engine="pool", max_rows_in_flight=3)
    failed = [t for e in episodes if e.group == 0 for t in e.turns if t.operator == "Echo" and t.observation]
    assert failed and all(t.error_kind == "client_error" and "fell over" in t.observation for t in failed)
    assert all(t.error_kind is None for e in episodes if e.group == 1 for t in e.turns)
    assert all(e.finish_reason is not None for e in episodes)


def test_one_prefill_per_group(sampler, tok):
    """Lock-step writes every row's prompt; the pool a group's prompt once (+ its last token per sample)."""
    lengths = [len(tok.encode(q.question, add_special_tokens=False)) for q in QUESTIONS]
    n = CFG["n"]
    _, lock = _run(sampler, EchoEnv(tok))
    _, pool = _run(sampler, EchoEnv(tok), engine="pool", max_rows_in_flight=8)
    assert lock.prefill_tokens == n * sum(lengths)
    assert pool.prefill_tokens == sum(length - 1 + n for length in lengths)


def test_step_keys_default_to_the_sessions_row_keys():
    """The per-row keys with one seed, ids o + r and one step are the session keys `row_keys` gives."""
    n, offset, step = 6, 10, 3
    old = sampling.row_keys(jax.random.PRNGKey(17), jnp.int32(step), n, offset)
    new = sampling.step_keys(jnp.full(n, 17, jnp.int32), jnp.arange(n, dtype=jnp.int32) + offset,
                             jnp.full(n, step, jnp.int32))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(old)), np.asarray(jax.random.key_data(new)))
