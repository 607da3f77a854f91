"""Attention over the rollout engine's KV pages in place (model/paged_kv.py): the pages the TPU kernel
reads, the jnp attention over them, the decoder on a paged cache, and the engine on it.

References: the dense cache's own forward (`qwen2.KVCache`), jax's reference implementation of its
TPU kernel `ragged_paged_attention` (the kernel's contract: page layout, kv_lens, cu_q_lens), and
the rollout reference (each episode alone in a one-row dense session, tests/rollout_reference.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from tests.rollout_reference import CFG, EOS_IDS, EchoEnv, _assert_same, _run, reference, tok  # noqa: F401
from workflow_r1.model import paged_kv, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1.rollout import RolloutConfig
from workflow_r1.sampler import Sampler, paged

B, T, PS, P, N = 3, 5, 4, 6, 20  # rows, new tokens, page size, pages per row, pages
START = np.array([7, 0, 13], np.int32)


def _table(rng: np.random.Generator) -> np.ndarray:
    """Each row's pages: distinct random page ids, scratch (N) past what it needs."""
    ids = rng.permutation(N)
    table = np.full((B, P), N, np.int32)
    for b, need in enumerate(-(-(START + T) // PS)):
        table[b, :need] = ids[:need]
        ids = ids[need:]
    return table


@pytest.mark.parametrize("attention, dh", [("gather", 16), ("kernel", 64)])
def test_written_pages_are_the_kernels_layout_and_gather_attends_as_it(attention, dh):
    """Tokens written at each row's positions, then attended: jax's reference of the TPU kernel over
    the same pages (keys at even heads, values at odd, head dim padded to 128 on the kernel path)
    gives the gather path's output, and both equal attention over the row's dense K/V."""
    rng = np.random.default_rng(0)
    kh, g = 2, 3
    dhp = paged_kv.stored_head_dim(dh, attention)
    assert dhp == (128 if attention == "kernel" else dh)
    table = _table(rng)
    hist = START.max() + T
    k_all, v_all = (rng.standard_normal((B, hist, kh, dh)).astype(np.float32) for _ in range(2))
    pages = jnp.zeros((N + 1, PS, 2 * kh, dhp), jnp.float32)
    # The history as one padded write (past each row's START masked out), then the new block.
    hist_mask = np.arange(hist)[None, :] < START[:, None]
    pages = paged_kv.write(pages, jnp.asarray(k_all), jnp.asarray(v_all), jnp.asarray(table),
                           jnp.zeros(B, jnp.int32), jnp.asarray(hist_mask))
    new_k = np.stack([k_all[b, START[b]:START[b] + T] for b in range(B)])
    new_v = np.stack([v_all[b, START[b]:START[b] + T] for b in range(B)])
    pages = paged_kv.write(pages, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(table), jnp.asarray(START),
                           jnp.ones((B, T), bool))
    q = rng.standard_normal((B, T, kh * g, dh)).astype(np.float32)
    layer = paged_kv.LayerPages(pages=pages, table=jnp.asarray(table), attention="gather")
    got = np.asarray(paged_kv.attend(jnp.asarray(q), layer, jnp.asarray(START), dh, jnp.float32))

    qp = np.pad(q, ((0, 0),) * 3 + ((0, dhp - dh),)).reshape(B * T, kh * g, dhp)
    kernel_ref = rpa.ref_ragged_paged_attention(
        jnp.asarray(qp), pages, jnp.asarray(START + T), jnp.asarray(table),
        jnp.arange(B + 1, dtype=jnp.int32) * T, jnp.array([B], jnp.int32), sm_scale=dh ** -0.5)
    kernel_ref = np.asarray(kernel_ref).reshape(B, T, kh * g, dhp)
    np.testing.assert_allclose(got, kernel_ref[..., :dh], atol=2e-5)
    contract = _kernel_contract(jnp.asarray(qp), pages, jnp.asarray(START + T), jnp.asarray(table),
                                jnp.arange(B + 1, dtype=jnp.int32) * T, jnp.array([B], jnp.int32),
                                sm_scale=dh ** -0.5, num_kv_pages_per_block=1, num_queries_per_block=1)
    np.testing.assert_allclose(np.asarray(contract).reshape(kernel_ref.shape), kernel_ref, atol=2e-5)
    if dhp > dh:
        assert np.abs(kernel_ref[..., dh:]).max() == 0.0   # the padded lanes carry nothing

    for b in range(B):   # dense: query t of row b at position START[b] + t over positions <= its own
        for t in range(T):
            n = START[b] + t + 1
            for h in range(kh * g):
                s = k_all[b, :n, h // g] @ q[b, t, h] * dh ** -0.5
                w = np.exp(s - s.max())
                np.testing.assert_allclose(got[b, t, h], (w / w.sum()) @ v_all[b, :n, h // g], atol=2e-5)


def test_padding_writes_land_in_the_scratch_page_only():
    rng = np.random.default_rng(1)
    table = _table(rng)
    pages = jnp.zeros((N + 1, PS, 4, 8), jnp.float32)
    k = jnp.ones((B, T, 2, 8))
    mask = np.zeros((B, T), bool)
    mask[:, 0] = True
    out = np.asarray(paged_kv.write(pages, k, k, jnp.asarray(table), jnp.asarray(START), jnp.asarray(mask)))
    touched = {(int(p), int(s)) for p, s in zip(*np.nonzero(np.abs(out[:N]).sum((2, 3))))}
    assert touched == {(int(table[b, START[b] // PS]), int(START[b] % PS)) for b in range(B)}
    assert np.abs(out[N]).sum() > 0   # the padded tokens went somewhere: the scratch page


@pytest.mark.parametrize("scanned", [False, True])
def test_the_decoder_on_pages_equals_it_on_a_dense_cache(scanned):
    """Two right-padded chunks of different lengths per row, then decode steps with one row finished:
    the hidden states of every real token equal the dense cache's."""
    cfg = get_preset("tiny-chat")
    model = qwen2.create(cfg, seed=0, scan_layers=scanned)
    rng = np.random.default_rng(2)
    table = _table(rng)
    shape = (N + 1, PS, 2 * cfg.num_kv_heads, cfg.head_dim)
    kv = (jnp.zeros((cfg.num_layers,) + shape) if scanned else tuple(jnp.zeros(shape) for _ in range(cfg.num_layers)))
    pc = paged_kv.PagedKVCache(kv=kv, table=jnp.asarray(table), end=jnp.zeros(B, jnp.int32))
    dc = qwen2.KVCache.init(cfg, B, P * PS, stacked=scanned)
    for counts in ([3, 5, 2], [4, 1, 5], [1, 1, 0], [1, 0, 1]):
        t = max(counts)
        toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, t)), jnp.int32)
        mask = jnp.arange(t)[None, :] < jnp.asarray(counts)[:, None]
        pos = pc.end[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        h_p, pc = model.hidden_states(toks, pos, input_mask=mask, cache=pc)
        h_d, dc = model.hidden_states(toks, pos, input_mask=mask, cache=dc)
        np.testing.assert_allclose(np.asarray(h_p)[np.asarray(mask)], np.asarray(h_d)[np.asarray(mask)], atol=2e-5)
        pc = pc.replace(end=pc.end - t + jnp.asarray(counts, jnp.int32))
        dc = dc.replace(end=dc.end - t + jnp.asarray(counts, jnp.int32))


def test_the_engine_on_pages_in_place_gives_the_reference_episodes(tok):  # noqa: F811
    """The gather attention: no view, no copy back; pages of 8, a budget that preempts, sub-batched
    writes (loop's rows of a paged cache): each episode is the one-row dense reference's."""
    model = qwen2.create(get_preset("tiny-chat"), seed=0)
    size = RolloutConfig(**CFG).cache_size
    dense = Sampler(model, tok, cache_size=size, eos_ids=EOS_IDS, impl="model")
    in_place = Sampler(model, tok, cache_size=size, eos_ids=EOS_IDS, impl="model", paged_attention="gather")
    want = reference(dense, EchoEnv(tok), seed=3)
    pages = RolloutConfig(**CFG, page_size=8).pages_per_row
    episodes, stats = _run(in_place, EchoEnv(tok), seed=3, page_size=8, kv_cache_pages=pages + 2)
    _assert_same(episodes, want)
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0


def test_paged_attention_modes_fail_in_one_line_where_they_cannot_run():
    assert paged.attention_mode("auto", "model", backend="tpu") == "kernel"
    assert paged.attention_mode("auto", "model", backend="gpu") == "view"
    assert paged.attention_mode("auto", "fused_cpu", backend="cpu") == "view"
    assert paged.attention_mode("gather", "model", backend="cpu") == "gather"
    for mode, impl, backend, says in [("kernel", "model", "cpu", "TPU kernel"), ("gather", "fused_cpu", "cpu", "view"),
                                      ("flash", "model", "tpu", "unknown")]:
        with pytest.raises(ValueError, match=says) as e:
            paged.attention_mode(mode, impl, backend=backend)
        assert "\n" not in str(e.value) and "rollout.paged_attention" in str(e.value)
    with pytest.raises(ValueError, match=r"rollout.paged_attention must be one of .*got 'flash'"):
        RolloutConfig(paged_attention="flash")


def test_pages_split_over_a_tensor_parallel_samplers_heads_give_the_same_decoder():
    """On a (data 1, fsdp 1, tensor 2) mesh the pages are split over their KV heads (each device
    writes and reads its own heads' pages); the decoder on them equals it unsharded."""
    from workflow_r1 import sharding
    cfg = get_preset("tiny-chat")
    mesh = sharding.tensor_mesh(jax.devices()[:2], 2)
    assert paged_kv.head_axis(mesh, cfg.num_kv_heads) == "tensor" and paged_kv.head_axis(mesh, 3) is None
    spec = paged_kv.page_spec(mesh, cfg.num_kv_heads, stacked=False)
    model = qwen2.create(cfg, seed=0)
    rng = np.random.default_rng(3)
    table = jnp.asarray(_table(rng))
    shape = (N + 1, PS, 2 * cfg.num_kv_heads, cfg.head_dim)
    split = tuple(jax.device_put(jnp.zeros(shape), jax.sharding.NamedSharding(mesh, spec)) for _ in range(cfg.num_layers))
    assert split[0].addressable_shards[0].data.shape == (N + 1, PS, cfg.num_kv_heads, cfg.head_dim)

    @jax.jit
    def run(kv, toks, pos, mask, end):
        return model.hidden_states(toks, pos, input_mask=mask, cache=paged_kv.PagedKVCache(kv=kv, table=table, end=end))

    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    mask = jnp.arange(T)[None, :] < jnp.asarray([5, 2, 4])[:, None]
    pos = jnp.asarray(START)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    want, want_c = run(tuple(jnp.zeros(shape) for _ in range(cfg.num_layers)), toks, pos, mask, jnp.asarray(START))
    with sharding.use_mesh(mesh):
        got, got_c = run(split, toks, pos, mask, jnp.asarray(START))
    np.testing.assert_allclose(np.asarray(got)[np.asarray(mask)], np.asarray(want)[np.asarray(mask)], atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_c.kv[1]), np.asarray(want_c.kv[1]), atol=2e-5)
    assert got_c.kv[1].sharding.spec == spec


def _kernel_contract(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, num_kv_pages_per_block,
                     num_queries_per_block):
    """What `ragged_paged_attention` computes (as jax's reference implementation of it says), in
    traceable jnp, for equal query counts per sequence (how paged_kv calls it): q [S * t, H, Dh']."""
    s, (n, ps, k2, dhp) = page_indices.shape[0], pages.shape
    assert cu_q_lens.shape == (s + 1,) and num_seqs.shape == (1,) and 0 < num_kv_pages_per_block
    assert 0 < num_queries_per_block <= q.shape[0]
    t, h = q.shape[0] // s, q.shape[1]
    dense = pages[page_indices].reshape(s, -1, k2, dhp)
    k = jnp.repeat(dense[:, :, 0::2], h // (k2 // 2), axis=2)
    v = jnp.repeat(dense[:, :, 1::2], h // (k2 // 2), axis=2)
    scores = jnp.einsum("sqhd,skhd->shqk", q.reshape(s, t, h, dhp), k) * sm_scale
    qpos = kv_lens[:, None] - t + jnp.arange(t)[None, :]
    mask = jnp.arange(dense.shape[1])[None, None, :] <= qpos[:, :, None]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("shqk,skhd->sqhd", probs, v).reshape(q.shape)


@pytest.mark.parametrize("tensor", [0, 2])
def test_the_kernel_path_calls_the_kernel_as_its_contract_says(monkeypatch, tensor):
    """paged_kv's kernel path (head-dim padding, the flattened queries, kv_lens = start + T,
    cu_q_lens, and on a tensor-parallel mesh the shard_map over the pages' heads) with the kernel
    replaced by a jnp implementation of its contract: equal to the gather path. (The kernel itself
    needs a TPU; its contract is checked against jax's reference above.)"""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as module

    from workflow_r1 import sharding
    monkeypatch.setattr(module, "ragged_paged_attention", _kernel_contract)
    rng = np.random.default_rng(4)
    kh, g, dh = 2, 2, 16
    table = jnp.asarray(_table(rng))
    pages = jnp.asarray(rng.standard_normal((N + 1, PS, 2 * kh, dh)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, T, kh * g, dh)), jnp.float32)
    want = paged_kv.attend(q, paged_kv.LayerPages(pages=pages, table=table, attention="gather"),
                           jnp.asarray(START), dh, jnp.float32)
    padded = jnp.pad(pages, ((0, 0),) * 3 + ((0, 128 - dh),))
    mesh = sharding.tensor_mesh(jax.devices()[:2], 2) if tensor else None
    if mesh is not None:
        padded = jax.device_put(padded, jax.sharding.NamedSharding(mesh, paged_kv.page_spec(mesh, kh, False)))
    with sharding.use_mesh(mesh):
        got = jax.jit(lambda q, p: paged_kv.attend(q, paged_kv.LayerPages(pages=p, table=table, attention="kernel"),
                                                   jnp.asarray(START), dh, jnp.float32))(q, padded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
