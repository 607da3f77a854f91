"""The rollout engine (rollout/paged.py), its page books (rollout/pages.py), its device pages
(sampler/paged.py) and the sampler calls it rests on.

The engine runs `EchoEnv` on the `tiny-chat` random model (tests/rollout_reference.py): episodes
whose turns end at different times, with tool calls, replies and observations. Its episodes must
equal the reference's (each episode alone in a one-row session, turn after turn), token for token,
whatever the page size, page budget (preemptions included), burst, rows in flight, executor
latencies, cache layout and row offset.
"""
from __future__ import annotations

import random
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout_reference import (CFG, QUESTIONS, EchoEnv, _assert_same, _run, any_sampler, reference,  # noqa: F401
                                     sampler, tok)
from workflow_r1.data.questions import Question
from workflow_r1.rollout import RolloutConfig, RolloutEngine
from workflow_r1.rollout.pages import OutOfPages, PagePool, page_hashes
from workflow_r1.sampler import paged, sampling


# ------------------------------------------------------------------------------ the page books

def test_pages_are_reference_counted_and_evicted_least_recently_used():
    pool = PagePool(4, page_size=2)
    a, b, c = pool.allocate(3)
    h = page_hashes([1, 2, 3, 4, 5, 6], 2)
    for page, key in zip((a, b, c), h):
        pool.register(page, key)
    pool.acquire([a])                      # a second sequence shares page a
    pool.release([a, b, c])
    assert pool.available == 3 and pool.in_use == 1 and list(pool.match(h)) == [a, b, c]
    pool.release([a])
    assert pool.available == 4
    pool.allocate(1)                       # the free page goes first: nothing evicted
    assert pool.evictions == 0 and pool.match(h) == [a, b, c]
    pool.allocate(2)                       # then the least recently released: b and c (a went last)
    assert pool.evictions == 2 and pool.match(h) == [a] and pool.registered == 1
    with pytest.raises(OutOfPages, match="2 pages asked for, 1 free or evictable of 4"):
        pool.allocate(2)


def test_a_shared_page_is_not_evicted_and_a_free_page_cannot_be_shared():
    pool = PagePool(2, page_size=2)
    (a,) = pool.allocate(1)
    pool.register(a, page_hashes([7, 8], 2)[0])
    pool.release([a])
    pool.acquire([a])                      # taken from the evictable list again
    assert pool.available == 1
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    pool.release([a])
    with pytest.raises(ValueError, match="released more often than held"):
        pool.release([a])
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="is free"):
        pool.acquire([b])


def test_prefix_hashes_chain_the_whole_prefix():
    """Hash i covers every token before the end of page i: a page with the same tokens after a
    different prefix is another page."""
    h1 = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(h1) == 3 and h1 == page_hashes([1, 2, 3, 4, 5, 6], 2)
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2, prior=h1[:2]) == page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    h2 = page_hashes([9, 2, 3, 4, 5, 6], 2)
    assert h2[0] != h1[0] and h2[1] != h1[1] and h2[2] != h1[2]


def test_two_pages_with_one_prefix_keep_the_first_registered():
    pool = PagePool(3, page_size=2)
    a, b = pool.allocate(2)
    key = page_hashes([1, 2], 2)[0]
    pool.promise([key], owner=5)
    assert pool.promised(key)
    pool.register(a, key)
    pool.register(b, key)                  # computed twice in one call: b stays private
    assert not pool.promised(key) and pool.match([key]) == [a]
    pool.release([a, b])
    assert pool.available == 3 and pool.registered == 1
    pool.promise([page_hashes([3, 4], 2)[0]], owner=6)
    pool.forget_promises(6)
    assert not pool.promised(page_hashes([3, 4], 2)[0])


# ------------------------------------------------------------------------------ device pages

def test_view_and_write_back_move_pages_exactly(any_sampler):
    """Pages -> a dense view -> pages elsewhere, in every cache layout (fused CPU, model, stacked)."""
    s = any_sampler
    kv = paged.new_pages(s, 6, page_size=4)
    rng = np.random.default_rng(0)
    kv = kv.replace(k=jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), kv.k),
                    v=jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), kv.v))
    table = np.array([[2, 0, 6], [5, 6, 6]], np.int32)     # 6 = the scratch page
    cache = paged.view(s, kv, table, np.array([9, 3]))
    assert cache.size == 12 and np.asarray(cache.end).tolist() == [9, 3]
    assert np.asarray(cache.valid).sum(axis=1).tolist() == [9, 3]
    first_k, dense_k = np.asarray(kv.k[0]), np.asarray(cache.k[0])   # layer 0 (a tuple's or a stack's)
    page2 = np.take(first_k, 2, axis=0)
    row0 = np.take(dense_k, 0, axis=0)
    np.testing.assert_array_equal(np.take(row0, np.arange(4), axis=kv.k_axis), page2)
    before = jax.tree_util.tree_map(np.asarray, (kv.k, kv.v))
    moved = paged.write_back(s, kv, cache, [(0, 1, 3), (1, 0, 4)])   # page 0 -> 3, page 5 -> 4
    after = jax.tree_util.tree_map(np.asarray, (moved.k, moved.v))
    for old, new in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        axis = 1 if kv.stacked else 0
        np.testing.assert_array_equal(np.take(new, 3, axis=axis), np.take(old, 0, axis=axis))
        np.testing.assert_array_equal(np.take(new, 4, axis=axis), np.take(old, 5, axis=axis))
        for p in (0, 1, 2, 5):
            np.testing.assert_array_equal(np.take(new, p, axis=axis), np.take(old, p, axis=axis))


# ------------------------------------------------------------------------------ the engine

@pytest.mark.parametrize("greedy", [False])  # greedy engine runs: tests/test_ragged.py, evaluation
def test_episodes_do_not_depend_on_pages_budgets_or_latencies(sampler, tok, greedy):
    """The reference's episodes for page sizes 8/16/32, bursts 4 to 128, a page budget that forces
    preemptions, 1 to all rows in flight, and shuffled executor latencies."""
    want = reference(sampler, EchoEnv(tok), greedy=greedy)
    assert sum(t.observation is not None and t.operator == "Echo" for e in want for t in e.turns) >= 4
    assert len({e.response_length for e in want}) > 1  # the turns really end at different times
    pages_per_row = RolloutConfig(**CFG, page_size=16).pages_per_row
    preempted = 0
    for ps, pages, burst, rows, salt in [(16, 0, 128, 0, 0), (8, 0, 4, 2, 1), (16, pages_per_row, 16, 0, 2),
                                         (32, 0, 7, 1, 3)]:
        rng = random.Random(salt)
        delays = {}
        env = EchoEnv(tok, latency=lambda call: delays.setdefault(call, rng.choice([0.0, 0.002, 0.02])))
        episodes, stats = _run(sampler, env, greedy=greedy, page_size=ps, kv_cache_pages=pages,
                               decode_burst=burst, max_rows_in_flight=rows)
        _assert_same(episodes, want)
        preempted += stats.preemptions
    assert preempted > 0   # the smallest budget really ran out of pages


def test_other_layouts_and_a_row_offset_match_the_reference(any_sampler, tok):
    """The model paths (their caches keep slots on another axis) and row_offset != 0 (a later host's
    rows draw with their global row ids)."""
    want = reference(any_sampler, EchoEnv(tok), seed=3, row_offset=8)
    episodes, _ = RolloutEngine(any_sampler, RolloutConfig(**CFG, page_size=8), EchoEnv(tok)).run(
        QUESTIONS, seed=3, row_offset=8)
    _assert_same(episodes, want)
    assert [e.group for e in episodes] == [2] * CFG["n"] + [3] * CFG["n"]


def test_a_shared_prefix_is_computed_once(sampler, tok):
    """Two questions after a common 40-token preamble, 4 samples each, pages of 8 tokens: the first
    sample computes its prompt, the others of its group only what their full prompt pages do not
    cover, and the second group's first sample only what the preamble's pages do not cover."""
    preamble = "You answer in one word. Question follows: "
    assert len(tok.encode(preamble, add_special_tokens=False)) >= 40
    questions = [Question(id=f"p{i}", question=preamble + q, golden_answers=("x",), data_source="test")
                 for i, q in enumerate(["Capital of France?", "Author of Hamlet?"])]
    lengths = [len(tok.encode(q.question, add_special_tokens=False)) for q in questions]
    common = next(i for i, (a, b) in enumerate(zip(*[tok.encode(q.question, add_special_tokens=False)
                                                      for q in questions])) if a != b)
    ps, n = 8, CFG["n"]
    _, stats = _run(sampler, EchoEnv(tok), questions=questions, page_size=ps)
    own = [(length - 1) // ps * ps for length in lengths]     # a group's full prompt pages
    want = lengths[0] + (n - 1) * (lengths[0] - own[0]) + (lengths[1] - common // ps * ps) + \
        (n - 1) * (lengths[1] - own[1])
    assert stats.prefill_tokens == want and n * sum(lengths) > 2 * want
    assert stats.prefix_hit_tokens == (n - 1) * (own[0] + own[1]) + common // ps * ps
    assert stats.prefix_lookup_tokens == n * sum(length - 1 for length in lengths)


def test_memory_is_the_page_budget(sampler, tok):
    """The cache is kv_cache_pages (+ 1 scratch) pages of closed-form size, whatever the batch; what
    episodes hold at once stays within it."""
    c = sampler.cfg
    per_page = 16 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    for questions in (QUESTIONS[:1], QUESTIONS):
        _, stats = _run(sampler, EchoEnv(tok), questions=questions, page_size=16, kv_cache_pages=20)
        assert stats.kv_cache_bytes == 21 * per_page
        assert 0 < stats.kv_bytes_peak <= 20 * per_page


def test_the_working_cache_covers_padded_writes(sampler):
    """A row holding 500 of 1,023 tokens writes 512 then 11 tokens; the second chunk is padded to 16
    slots, so it reaches slot 1,028: past the 1,024 its tokens and one decoded token need (17 pages
    of 64, a power of two: 32, unless a longest row needs fewer)."""
    assert sampler.prefill_chunk == 512 and sampler.buckets is None
    one = lambda x: np.array([x])  # noqa: E731
    s = sampler
    assert s.cache_size < 1023   # the fixture's longest row is shorter: the view covers the write exactly
    assert paged.call_shape(s, 64, one(500), one(1023), one(1))[1] == 17 * 64
    assert paged.call_shape(s, 64, one(0), one(1000), one(24))[1] == 16 * 64
    # The cap: a power of two of pages, but never more than a longest row's (cache_size + 1 slots).
    assert paged.working_pages(17, cache_size=9472, page_size=64) == 32
    assert paged.working_pages(148, cache_size=9472, page_size=64) == 149
    assert paged.working_pages(3, cache_size=184, page_size=64) == 3


def test_a_page_budget_below_one_episode_is_refused():
    with pytest.raises(ValueError, match="cannot hold one longest episode .* raise it to at least 12"):
        RolloutConfig(**CFG, page_size=16, kv_cache_pages=11)


def test_waiting_for_the_executor_costs_nothing(sampler, tok):
    """A row waiting for its tool call is in no sampler call: every call's rows have a turn to
    generate, so the rows computed are never more than the rows generating."""
    calls = []
    real = sampler.generate_from

    def spy(session, *args, **kw):
        calls.append(len(kw["rows"]))
        return real(session, *args, **kw)

    env = EchoEnv(tok, latency=lambda call: 0.05)
    sampler.generate_from = spy
    try:
        episodes, _ = _run(sampler, env, page_size=16)
    finally:
        del sampler.generate_from
    b = len(episodes)
    assert max(calls) == b and min(calls) < b // 2   # calls ran while most rows waited on the executor


def test_a_call_in_flight_does_not_stop_the_others(sampler, tok):
    """Episode (0, 0)'s first call blocks until another episode ends its third turn: only an engine
    that keeps decoding the other rows while a call is out gets there (a round-by-round engine would
    wait the 20 s out)."""
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
    episodes, _ = _run(sampler, env, seed=11)
    assert "first" in seen, "episode (0, 0) made no call with this seed; pick another"
    assert seen["first"] is True
    assert all(e.finish_reason is not None for e in episodes)


def test_a_rollout_stopped_from_outside_does_not_wait_for_calls_in_flight(sampler, tok):
    """An exception out of the engine (the trainer's preemption stop, an environment error) while
    an executor call is out: run() raises at once, leaving the call (it may take up to the LLM's
    timeout) to end on its own thread, instead of awaiting it before the trainer can save."""
    started, release, returned = threading.Event(), threading.Event(), threading.Event()

    def latency(call):
        if not started.is_set():
            started.set()
            release.wait(timeout=120)
            returned.set()
        return 0.0

    def hook(episode, turn_ids):
        if started.is_set():
            raise KeyboardInterrupt("stopped from outside")

    try:
        with pytest.raises(KeyboardInterrupt, match="stopped from outside"):
            _run(sampler, EchoEnv(tok, latency=latency, hook=hook), seed=11)
        assert started.is_set() and not returned.is_set()   # the call was still out when run() raised
    finally:
        release.set()
    assert returned.wait(timeout=120)


def test_an_executor_fault_is_an_observation(sampler, tok):
    env = EchoEnv(tok, fail="0.")
    episodes, _ = _run(sampler, env, max_rows_in_flight=3)
    failed = [t for e in episodes if e.group == 0 for t in e.turns if t.operator == "Echo" and t.observation]
    assert failed and all(t.error_kind == "client_error" and "fell over" in t.observation for t in failed)
    assert all(t.error_kind is None for e in episodes if e.group == 1 for t in e.turns)
    assert all(e.finish_reason is not None for e in episodes)


# ------------------------------------------------------------------------------ the sampler

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


def test_step_keys_default_to_the_sessions_row_keys():
    """The per-row keys with one seed, ids o + r and one step are the session keys `row_keys` gives."""
    n, offset, step = 6, 10, 3
    old = sampling.row_keys(jax.random.PRNGKey(17), jnp.int32(step), n, offset)
    new = sampling.step_keys(jnp.full(n, 17, jnp.int32), jnp.arange(n, dtype=jnp.int32) + offset,
                             jnp.full(n, step, jnp.int32))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(old)), np.asarray(jax.random.key_data(new)))
