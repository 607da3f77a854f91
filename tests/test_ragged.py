"""Ragged engine steps (`rollout.max_tokens_per_step`, sampler/ragged.py, paged_kv.attend_tokens):
a token budget of many rows' tokens in one flat forward over the pages in place.

Reference: each episode alone in a one-row dense session (tests/rollout_reference.py); a ragged
rollout must give its episodes token for token (fp32, sampled and greedy), whatever the budget
(one token a step, a budget that cuts prompts into chunks), page size and page pool (preemptions).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.rollout_reference import CFG, EOS_IDS, QUESTIONS, EchoEnv, _assert_same, _run, reference, tok  # noqa: F401
from workflow_r1.model import paged_kv, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.rollout import RolloutConfig, RolloutEngine
from workflow_r1.sampler import Sampler, SamplerError, ragged


@pytest.fixture(scope="module")
def samplers(tok):  # noqa: F811
    """(the dense one-row reference's sampler, a sampler on pages in place: "gather")."""
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    size = RolloutConfig(**CFG).cache_size
    return (Sampler(model, tok, cache_size=size, eos_ids=EOS_IDS, impl="model"),
            Sampler(model, tok, cache_size=size, eos_ids=EOS_IDS, paged_attention="gather"))


def test_the_plan_and_layout_put_decode_tokens_first():
    assert ragged.plan([5, 1, 40, 1, 30], 64) == [5, 1, 40, 1, 17]     # 2 decodes, then chunks in order
    assert ragged.plan([1, 1, 1], 2) == [1, 1, 0]
    first, n, block = ragged.layout(np.array([1, 20, 1, 3, 1]), block=16)
    assert first.tolist() == [0, 3, 1, 23, 2] and (n, block) == (32, 16)
    assert ragged.layout(np.array([1, 1, 1]), block=16, min_len=2)[1:] == (4, 4)


@pytest.mark.parametrize("greedy, page_size, budget, tight", [
    (False, 8, 7, True),     # chunks of a prompt over several steps, a pool that preempts
    (False, 16, 64, False),  # decode tokens and whole observations in one step
    (True, 8, 33, False),
])
def test_ragged_steps_give_the_reference_episodes(samplers, tok, greedy, page_size, budget, tight):  # noqa: F811
    dense, in_place = samplers
    want = reference(dense, EchoEnv(tok), seed=3, greedy=greedy)
    pages = RolloutConfig(**CFG, page_size=page_size).pages_per_row + 2 if tight else 0
    episodes, stats = _run(in_place, EchoEnv(tok), seed=3, greedy=greedy, page_size=page_size,
                           kv_cache_pages=pages, max_tokens_per_step=budget)
    _assert_same(episodes, want)
    assert stats.prefix_hit_tokens > 0 and (stats.preemptions > 0) == tight
    # A step computes at most the budget: every token written or generated took at least one step.
    written = stats.prefill_tokens + stats.generated_tokens
    assert stats.rounds >= written / budget


def test_ragged_steps_on_stacked_pages_give_the_reference_episodes(samplers, tok):  # noqa: F811
    """A model with scanned layers keeps its pages as one [L, ...] array."""
    model = qwen2.create(get_preset("tiny-chat"), seed=0, scan_layers=True)
    scanned = Sampler(model, tok, cache_size=samplers[0].cache_size, eos_ids=EOS_IDS, paged_attention="gather")
    want = reference(samplers[0], EchoEnv(tok), seed=4)
    episodes, _ = _run(scanned, EchoEnv(tok), seed=4, page_size=16, max_tokens_per_step=40)
    _assert_same(episodes, want)


def test_a_block_of_one_rows_chunk_and_a_block_of_many_rows_attend_alike():
    """attend_tokens' two branches (one row's pages gathered once, each token's row gathered) give
    the block attention's result for the same queries."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    ps, n_pages, k, g, dh = 4, 12, 2, 2, 8
    pages = jnp.asarray(rng.standard_normal((n_pages + 1, ps, 2 * k, dh)), jnp.float32)
    table = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11]], jnp.int32)
    blk = paged_kv.TOKEN_BLOCK
    q = jnp.asarray(rng.standard_normal((2 * blk, k * g, dh)), jnp.float32)
    # Block 0: row 0's tokens at positions 0..15 (a chunk); block 1: rows 0 and 1 alternating.
    rows = jnp.asarray([0] * blk + [0, 1] * (blk // 2), jnp.int32)
    pos = jnp.asarray(list(range(blk)) + [p for i in range(blk // 2) for p in (i, 2 * i + 1)], jnp.int32)
    layer = paged_kv.LayerPages(pages=pages, table=table, attention="gather", rows=rows)
    got = jax.jit(lambda q: paged_kv.attend_tokens(q, layer, pos, dh, jnp.float32))(q)
    block = paged_kv.LayerPages(pages=pages, table=table, attention="gather")
    for i in range(2 * blk):
        r, p = int(rows[i]), int(pos[i])
        want = paged_kv.attend(q[i][None, None], block.replace(table=table[r:r + 1]), jnp.asarray([p], jnp.int32),
                               dh, jnp.float32)
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want[0, 0]), rtol=1e-5, atol=1e-5)


def test_ragged_steps_on_the_fused_cpu_path_give_its_reference_episodes(tok):  # noqa: F811
    """The fused CPU sampler (the default on one CPU) reads its own page layout in place."""
    fused = Sampler(qwen2.create(get_preset("tiny-chat"), seed=0), tok, cache_size=RolloutConfig(**CFG).cache_size,
                    eos_ids=EOS_IDS, ragged=True)
    assert fused.impl == "fused_cpu"
    want = reference(fused, EchoEnv(tok), seed=3)
    episodes, stats = _run(fused, EchoEnv(tok), seed=3, page_size=8, max_tokens_per_step=7,
                           kv_cache_pages=RolloutConfig(**CFG, page_size=8).pages_per_row + 2)
    _assert_same(episodes, want)
    assert stats.preemptions > 0


def test_ragged_steps_are_refused_where_they_cannot_run(samplers, tok):  # noqa: F811
    with pytest.raises(ValueError, match="max_tokens_per_step=8 runs ragged steps in jnp") as e:
        RolloutConfig(max_tokens_per_step=8, paged_attention="kernel")
    assert "\n" not in str(e.value)
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    assert Sampler(model, tok, cache_size=64, impl="model", ragged=True, paged_attention="auto").paged_attention == "gather"
    viewed = Sampler(model, tok, cache_size=64, eos_ids=EOS_IDS, impl="model", paged_attention="view")
    engine = RolloutEngine(viewed, RolloutConfig(**CFG, max_tokens_per_step=8), EchoEnv(tok))
    with pytest.raises(SamplerError, match="set rollout.paged_attention=gather"):
        engine.run(QUESTIONS[:1], n=1)
