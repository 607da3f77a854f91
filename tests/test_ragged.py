"""Ragged engine steps (`rollout.max_tokens_per_step`, sampler/ragged.py, paged_kv.attend_tokens):
a token budget of many rows' tokens in one flat forward over the pages in place.

Reference: each episode alone in a one-row dense session (tests/rollout_reference.py); a ragged
rollout must give its episodes token for token (fp32, sampled and greedy), whatever the budget
(one token a step, a budget that cuts prompts into chunks), page size and page pool (preemptions).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
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
    # No pages reserved ahead: at their peak the pages in use are their tokens' pages, the empty
    # slots only the rest of each episode's last page.
    assert 0 <= stats.kv_slots_at_peak - stats.kv_tokens_at_peak < len(episodes) * page_size
    # A step computes at most the budget: every token written or generated took at least one step.
    written = stats.prefill_tokens + stats.generated_tokens
    assert stats.rounds >= written / budget


def test_a_turn_stopped_at_its_action_is_the_turn_a_sampler_ends_there(samplers, tok):  # noqa: F811
    """rollout.stop_at_action ends a turn where the environment's `turn_complete` says its action is
    whole. Here that is any token of `stop`, so the episodes are the one-row reference's with those
    among its end-of-turn ids."""
    stop = tuple(range(60, 72))

    class StopEnv(EchoEnv):
        def turn_complete(self, ids):
            return ids[-1] in stop

    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    ends_at_stop = Sampler(model, tok, cache_size=RolloutConfig(**CFG).cache_size, eos_ids=EOS_IDS + stop, impl="model")
    want = reference(ends_at_stop, EchoEnv(tok), seed=4)
    episodes, _ = _run(samplers[1], StopEnv(tok), seed=4, page_size=8, max_tokens_per_step=16, stop_at_action=True)
    _assert_same(episodes, want)
    stopped = sum(ep.response_ids[i] in stop for ep in want for i in range(len(ep.response_ids)) if ep.loss_mask[i])
    assert stopped > 0  # some turns did end at a stop token


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


def test_ragged_steps_on_the_fused_cpu_path_give_its_reference_episodes(tok, monkeypatch):  # noqa: F811
    """The fused CPU sampler (the default on one CPU) reads its own page layout in place. However many
    sequences a step holds, its page table has the rollout's row count (a power of two of the rows in
    flight): one compiled step per rollout, not one per count."""
    fused = Sampler(qwen2.create(get_preset("tiny-chat"), seed=0), tok, cache_size=RolloutConfig(**CFG).cache_size,
                    eos_ids=EOS_IDS, ragged=True)
    assert fused.impl == "fused_cpu"
    want = reference(fused, EchoEnv(tok), seed=3)
    real, seen = ragged._step, []

    def spy(impl, weights, kv, run, *rest, **kw):
        seen.append((run[0].shape[0], int(run[-1][0])))  # (table rows, sequences this step)
        return real(impl, weights, kv, run, *rest, **kw)

    monkeypatch.setattr(ragged, "_step", spy)
    episodes, stats = _run(fused, EchoEnv(tok), seed=3, page_size=8, max_tokens_per_step=7,
                           kv_cache_pages=RolloutConfig(**CFG, page_size=8).pages_per_row + 2)
    _assert_same(episodes, want)
    assert stats.preemptions > 0
    rows = len(want)  # every episode in flight at once (max_rows_in_flight 0), a power of two here
    assert {t for t, _ in seen} == {rows} and len({r for _, r in seen}) > 2, seen


def test_ragged_steps_are_refused_where_they_cannot_run(samplers, tok):  # noqa: F811
    with pytest.raises(ValueError, match="max_tokens_per_step=8 runs ragged steps on the pages in place") as e:
        RolloutConfig(max_tokens_per_step=8, paged_attention="view")
    assert "\n" not in str(e.value)
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    assert Sampler(model, tok, cache_size=64, impl="model", ragged=True, paged_attention="auto").paged_attention == "gather"
    viewed = Sampler(model, tok, cache_size=64, eos_ids=EOS_IDS, impl="model", paged_attention="view")
    engine = RolloutEngine(viewed, RolloutConfig(**CFG, max_tokens_per_step=8), EchoEnv(tok))
    with pytest.raises(SamplerError, match="reads its pages in place.*set rollout.paged_attention=gather"):
        engine.run(QUESTIONS[:1], n=1)


def _kernel_contract(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, num_kv_pages_per_block,
                     num_queries_per_block):
    """What `ragged_paged_attention` computes (jax's reference implementation of it, below), in
    traceable jnp: token j of sequence r (cu_q_lens[r] <= j < cu_q_lens[r + 1]) sits at position
    kv_lens[r] - (cu_q_lens[r + 1] - j) and attends to that sequence's positions up to its own."""
    assert 0 < num_kv_pages_per_block and 0 < num_queries_per_block <= q.shape[0]
    n, h, dhp = q.shape
    k2 = pages.shape[2]
    j = jnp.arange(n)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, j, side="right") - 1, 0, page_indices.shape[0] - 1)
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - j)
    dense = pages[page_indices[seq]].reshape(n, -1, k2, dhp)                    # [N, S, 2K, Dh']
    k = jnp.repeat(dense[:, :, 0::2], h // (k2 // 2), axis=2)
    v = jnp.repeat(dense[:, :, 1::2], h // (k2 // 2), axis=2)
    scores = jnp.einsum("nhd,nshd->nhs", q, k) * sm_scale
    mask = jnp.arange(dense.shape[1])[None, None, :] <= pos[:, None, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
    out = jnp.einsum("nhs,nshd->nhd", probs, v)
    return jnp.where((j < cu_q_lens[num_seqs[0]])[:, None, None], out, 0.0)


def _ragged_case(rng, dh, lanes):
    """Three sequences (one decode token, chunks of 5 and 20) in a run of 32, their pages, queries."""
    ps, n_pages, kh, g = 4, 24, 2, 2
    counts, kv_lens = np.array([1, 5, 20]), np.array([9, 12, 20])
    table = np.full((4, 8), n_pages, np.int32)
    ids = rng.permutation(n_pages)
    for r, length in enumerate(kv_lens):
        need = -(-length // ps)
        table[r, :need], ids = ids[:need], ids[need:]
    cu = np.concatenate([[0], np.cumsum(counts), [counts.sum()]]).astype(np.int32)
    rows = np.repeat(np.arange(3), counts)
    pos = np.concatenate([np.arange(length - c, length) for c, length in zip(counts, kv_lens)])
    n = 32
    rows, pos = np.pad(rows, (0, n - len(rows)), constant_values=2), np.pad(pos, (0, n - len(pos)))
    pages = rng.standard_normal((n_pages + 1, ps, 2 * kh, lanes)).astype(np.float32)
    pages[..., dh:] = 0.0
    q = rng.standard_normal((n, kh * g, dh)).astype(np.float32)
    return (jnp.asarray(x) for x in (q, pages, table, rows, pos, np.pad(kv_lens, (0, 1)).astype(np.int32), cu,
                                     np.array([3], np.int32))), int(counts.sum())


def test_the_ragged_kernel_path_calls_the_kernel_as_its_contract_says(monkeypatch):
    """paged_kv's kernel path for a ragged run (head-dim padding to 128 lanes, the run with its
    kv_lens and cu_q_lens) with the kernel replaced by a jnp implementation of its contract: equal
    to the gather path on the real tokens. The contract itself equals jax's reference
    implementation of the kernel. (The kernel needs a TPU.)"""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    dh = 16
    (q, pages, table, rows, pos, kv_lens, cu, num_seqs), real = _ragged_case(np.random.default_rng(5), dh, 128)
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, 128 - dh)))
    args = (pages, kv_lens, table, cu, num_seqs)
    want = rpa.ref_ragged_paged_attention(qp, *args, sm_scale=dh ** -0.5)
    got = _kernel_contract(qp, *args, sm_scale=dh ** -0.5, num_kv_pages_per_block=1, num_queries_per_block=8)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=1e-5)

    monkeypatch.setattr(module, "ragged_paged_attention", _kernel_contract)
    ragged = (kv_lens, cu, num_seqs)
    layer = paged_kv.LayerPages(pages=pages, table=table, attention="kernel", rows=rows, ragged=ragged)
    got = jax.jit(lambda q: paged_kv.attend_tokens(q, layer, pos, dh, jnp.float32))(q)
    gather = layer.replace(pages=pages[..., :dh], attention="gather")
    want = jax.jit(lambda q: paged_kv.attend_tokens(q, gather, pos, dh, jnp.float32))(q)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], atol=2e-5)


def test_ragged_steps_through_the_kernel_path_give_the_reference_episodes(monkeypatch, samplers, tok):  # noqa: F811
    """The engine on the kernel path (the run's table order, kv_lens and cu_q_lens as ragged.step
    builds them), the kernel replaced by its contract: the one-row reference's episodes."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module

    monkeypatch.setattr(module, "ragged_paged_attention", _kernel_contract)
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    kernel = Sampler(model, tok, cache_size=samplers[0].cache_size, eos_ids=EOS_IDS, paged_attention="gather")
    kernel.paged_attention = "kernel"   # what a TPU sampler holds (the pages padded to 128 lanes)
    want = reference(samplers[0], EchoEnv(tok), seed=6)
    episodes, _ = _run(kernel, EchoEnv(tok), seed=6, page_size=8, max_tokens_per_step=24)
    _assert_same(episodes, want)


@pytest.mark.parametrize("attention", ["gather", "kernel"])
def test_ragged_steps_on_a_tensor_parallel_sampler_give_the_reference_episodes(monkeypatch, samplers, tok,  # noqa: F811
                                                                                attention):
    """A sampler over 2 devices splitting the heads (rollout.tensor_parallel): the step runs under
    its mesh, the pages split over their KV heads, the kernel (its contract) in shard_map."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module

    from workflow_r1 import sharding
    heads = []   # the query heads each kernel call sees: half of them in shard_map over the heads

    def kernel(q, *args, **kw):
        heads.append(q.shape[1])
        return _kernel_contract(q, *args, **kw)

    monkeypatch.setattr(module, "ragged_paged_attention", kernel)
    mesh = sharding.tensor_mesh(jax.devices()[:2], 2)
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    split = Sampler(model, tok, cache_size=samplers[0].cache_size, eos_ids=EOS_IDS, mesh=mesh,
                    paged_attention="gather")
    split.paged_attention = attention   # "kernel": what a TPU sampler holds
    want = reference(samplers[0], EchoEnv(tok), seed=7)
    episodes, _ = _run(split, EchoEnv(tok), seed=7, page_size=8, max_tokens_per_step=24)
    _assert_same(episodes, want)
    assert set(heads) == ({get_preset("tiny-chat").num_heads // 2} if attention == "kernel" else set())
