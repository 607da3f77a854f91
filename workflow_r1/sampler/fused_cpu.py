"""The sampler's fast forward for a single XLA:CPU device (impl "fused_cpu"): same math as the model.

The same parameters as `qwen2.Qwen2`, re-laid out once per `Sampler.update_params` (`weights`):
every projection stored [out, in] (HF's Linear layout), q/k/v and gate/up fused into one matrix
each, and matmuls that accumulate in fp32. XLA:CPU runs bf16 dots ~1.8x faster on [out, in]
weights with fp32 accumulation than on the model's [in, out] layout. Decode-sized GEMMs take the
weight as their lhs where that measured faster (`weight_as_lhs`), and the KV cache is head-major
fp32 with the keys transposed (`new_cache`). The math is the model's (norms, RoPE, attention
masks and cache writes are qwen2.py's own functions), and tests check both paths agree.

Shapes: B batch, T new tokens, S cache slots, D hidden, H query heads, K kv heads, G = H // K,
Dh head dim, M mlp width, V vocab; N = B * T activation rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1.model import lora, ops, qwen2
from workflow_r1.model.config import Qwen2Config

# The KV cache is head-major, so attention is two batched matmuls over (B, K) in the cache's own
# layout (the model's slot-major [B, S, K, Dh] makes XLA:CPU transpose the whole cache every step):
# values [B, K, S, Dh], keys transposed, [B, K, Dh, S], so that the scores are q [G, Dh] @ k [Dh, S]
# with no transpose of the result, per layer and decode step, and the prefill writes the keys in
# that layout at no extra cost. It is stored in
# fp32 whatever the compute dtype, holding values already rounded to that dtype (so the numbers
# are the model's): a bf16 buffer costs a whole-cache convert per step on XLA:CPU, whether
# scattered into directly or via uint16 bits (that bitcast is materialised as a copy before the
# attention matmul): 13 ms of a 230 ms step at batch 32. The price is twice the cache memory.
K_SLOT_AXIS, V_SLOT_AXIS = 3, 2
CACHE_DTYPE = jnp.float32


def new_cache(cfg: Qwen2Config, batch: int, size: int) -> qwen2.KVCache:
    """An empty fp32 cache: k [B, K, Dh, S] and v [B, K, S, Dh] per layer, valid [B, S], end [B]."""
    return qwen2.KVCache.init(cfg, batch, size, CACHE_DTYPE,
                              k_shape=(batch, cfg.num_kv_heads, cfg.head_dim, size),
                              v_shape=(batch, cfg.num_kv_heads, size, cfg.head_dim))


def min_rows(dtype: Any) -> int:
    """Fewest batch rows to run: bf16 dots with a single row take a slow XLA:CPU path (weights
    converted to fp32 per call), so a bf16 batch of one is padded to two."""
    return 2 if jnp.dtype(dtype) == jnp.bfloat16 else 1


def store_dtype(dtype: Any) -> Any:
    """How this path stores a 16-bit float table it gathers from: as uint16 bits.

    XLA:CPU runs a bf16 gather (or scatter) by converting the whole buffer to fp32 and back on
    every call; an integer buffer is read in place.
    """
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else dtype


def _weights_impl(params: Any, cfg: Qwen2Config, dtype: Any) -> dict[str, Any]:
    """Model nnx.State -> this path's weight tree (projections [out, in], q/k/v and gate/up fused).

    The model's layers may be unrolled or stacked (`scan_layers`): this path always runs its own
    per-layer loop, so a stacked state is sliced layer by layer here.
    """
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def val(x):
        return x[...] if hasattr(x, "get_value") else x

    stacked = "input_norm" in params["layers"]  # a stacked layer's subtree, not a list of layers
    layers = []
    for i in range(cfg.num_layers):
        lp = qwen2.layer_params(params["layers"], i, stacked)
        a, m = lp["attn"], lp["mlp"]
        qkv = jnp.concatenate([val(a["q_kernel"]).reshape(d, h * dh), val(a["k_kernel"]).reshape(d, k * dh),
                               val(a["v_kernel"]).reshape(d, k * dh)], axis=1)
        qkv_b = jnp.concatenate([val(a["q_bias"]).reshape(-1), val(a["k_bias"]).reshape(-1),
                                 val(a["v_bias"]).reshape(-1)])
        layers.append({
            "in_norm": val(lp["input_norm"]["scale"]).astype(dtype),
            "post_norm": val(lp["post_attn_norm"]["scale"]).astype(dtype),
            "qkv_w": qkv.T.astype(dtype),                                        # [(H + 2K) Dh, D]
            "qkv_b": qkv_b.astype(dtype),
            "o_w": val(a["o_kernel"]).reshape(h * dh, d).T.astype(dtype),          # [D, H Dh]
            "gu_w": jnp.concatenate([val(m["gate_kernel"]), val(m["up_kernel"])], axis=1).T.astype(dtype),  # [2M, D]
            "down_w": val(m["down_kernel"]).T.astype(dtype),                     # [D, M]
        })
    embed = val(params["embed"]).astype(dtype)                                   # [V, D]
    head = embed if cfg.tie_word_embeddings else val(params["lm_head"]).T.astype(dtype)  # [V, D]
    if store_dtype(dtype) == jnp.uint16:
        # A 16-bit float gather makes XLA:CPU convert the whole table to fp32 per call; gather bits.
        embed = jax.lax.bitcast_convert_type(embed, jnp.uint16)
    return {"embed": embed, "head": head, "final_norm": val(params["final_norm"]["scale"]).astype(dtype),
            "layers": layers}


weights = jax.jit(_weights_impl, static_argnums=(1, 2))


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def merged_weights(graphdef: Any, state: Any, cfg: Qwen2Config, dtype: Any) -> dict[str, Any]:
    """`weights` of a model with LoRA adapters (split as graphdef, state), its kernels merged
    (W + scale · A B) in the same program: no merged copy of the whole model is ever held (for the
    bundled 0.5B a sync peaked 2.7 GiB above its start with the merge as a program of its own)."""
    from flax import nnx

    return _weights_impl(nnx.split(lora.merge(nnx.merge(graphdef, state)))[1], cfg, dtype)


def weight_as_lhs(rows: int, w_shape: tuple[int, ...], dtype: Any) -> bool:
    """Whether `dense` computes x @ w.T as (w @ x.T).T for `rows` activation rows and a weight of
    shape w_shape = (out, in) (a static choice, by measurement).

    Measured on this project's 2-core CPU (AMD Zen 5, AVX-512 BF16; XLA:CPU's YNNPACK GEMMs),
    decode-step GEMMs of the 0.5B shapes, 24 distinct weights each (benchmarks/README.md): in
    bf16 the weight-as-lhs order wins for the down projection (long contraction, in > out) at
    every row count (6.2 vs 9.3 ms per step at 2 rows, 11.7 vs 13.6 at 24, 16.8 vs 38.7 at 64)
    and for every shape when rows is 32 or 64 (63 vs 74 ms per step at 32), but loses elsewhere
    (e.g. 73 vs 61 ms at 24 rows, 125 vs 97 at 40). In fp32 it wins through 32 rows (57 vs 90 ms
    at 8, 99 vs 138 at 32). Prefill-sized row counts always take the x @ w.T order.
    """
    if rows > 64:
        return False
    if jnp.dtype(dtype).itemsize >= 4:
        return rows <= 32
    out_features, in_features = w_shape
    return in_features > out_features or rows % 32 == 0


def dense(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x [N, in] @ w[out, in].T -> [N, out] with fp32 accumulation, result in out_dtype (default x's).

    Small N (decode) runs as (w @ x.T).T, see `weight_as_lhs`; the barrier keeps XLA's simplifier
    from folding the transpose back into the dot. Both operands stay row-major with the
    contraction on the minor axis: other layouts make XLA:CPU convert the weight to fp32 per call.
    """
    if weight_as_lhs(x.shape[0], w.shape, w.dtype):
        y = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        y = jax.lax.optimization_barrier(y).T
    else:
        y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _write_keys(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, K, Dh, S] <- new [B, T, K, Dh] (compute dtype, converted exactly) at per-row slot start [B]."""
    return ops.write_rows(buf, new.transpose(0, 2, 3, 1).astype(buf.dtype), start, axis=K_SLOT_AXIS)


def _write_values(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, K, S, Dh] <- new [B, T, K, Dh] (compute dtype, converted exactly) at per-row slot start [B]."""
    return ops.write_rows(buf, jnp.swapaxes(new, 1, 2).astype(buf.dtype), start, axis=V_SLOT_AXIS)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked attention: q [B, T, K, G, Dh] (compute dtype), fp32 cache keys k [B, K, Dh, S] and
    values v [B, K, S, Dh] holding compute-dtype values, mask [B, T, S] -> fp32 [B, T, K, G, Dh].

    The model's numbers: scores and softmax in fp32, probabilities rounded to the compute dtype for
    the weighted sum, which accumulates in fp32 (a product of two bf16 values is exact in fp32, so
    fp32 matmuls on bf16-valued operands are the model's bf16 matmuls with fp32 accumulation).
    """
    b, t, kh, g, dh = q.shape
    dt, f32 = q.dtype, jnp.float32
    # Queries as one [G T, Dh] matrix per (b, k): [G T, Dh] @ [Dh, S] keeps XLA:CPU on its plain
    # batched-GEMM path (the 5-D einsum at T = 1 makes it emit the [S, G] product and transpose it).
    qm = q.astype(f32).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, dh)
    scores = jnp.einsum("bkqd,bkds->bkqs", qm, k.astype(f32)).reshape(b, kh, g, t, -1) * (dh ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).astype(f32)
    # A plain [.., T, S] @ [S, Dh] batched matmul, transposed after (small): XLA:CPU's fast path.
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(f32))
    return out.transpose(0, 3, 1, 2, 4)


def hidden(cfg: Qwen2Config, dt: Any, w: dict[str, Any], tokens: jax.Array, positions: jax.Array,
           input_mask: jax.Array, cache: qwen2.KVCache) -> tuple[jax.Array, qwen2.KVCache]:
    """Same contract as `Qwen2.hidden_states` with a cache (see qwen2.py), on `weights(...)` in compute dtype dt.

    tokens, positions, input_mask [B, T] -> final-normed hidden [B, T, D] (dt) and the cache with
    the T slots written at each row's end (end += T). Activations are kept 2-D [B*T, D] between
    attentions: a size-1 T axis (decode) otherwise makes XLA:CPU insert layout copies inside the
    elementwise fusions.
    """
    b, t = tokens.shape
    h, kh, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = _embed(w, tokens.reshape(-1), dt)                                          # [B*T, D]
    start = cache.end
    query_slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    key_valid = ops.write_rows(cache.valid, input_mask.astype(bool), start)
    mask = ops.attention_mask(key_valid, query_slots)                             # [B, T, S]
    new_k, new_v = [], []
    for i, lw in enumerate(w["layers"]):
        q, k, v = _qkv(cfg, dt, lw, x, positions)
        new_k.append(_write_keys(cache.k[i], k, start))
        new_v.append(_write_values(cache.v[i], v, start))
        out = attend(q.reshape(b, t, kh, h // kh, dh), new_k[-1], new_v[-1], mask).astype(dt)
        x = _after_attention(cfg, dt, lw, x, out.reshape(b * t, h * dh))
    x = ops.rms_norm(x, w["final_norm"], cfg.rms_norm_eps).reshape(b, t, -1)
    return x, qwen2.KVCache(k=tuple(new_k), v=tuple(new_v), valid=key_valid, end=cache.end + t)


def _embed(w: dict[str, Any], tokens: jax.Array, dt: Any) -> jax.Array:
    """tokens [N] -> embeddings [N, D] in the compute dtype dt (gathered as bits, see _weights_impl)."""
    x = jnp.take(w["embed"], tokens, axis=0)
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, dt)
    return x.astype(dt)


def _qkv(cfg: Qwen2Config, dt: Any, lw: dict[str, Any], x: jax.Array, positions: jax.Array
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's queries, keys and values of x [B*T, D] at positions [B, T]: roped q [B, T, H, Dh],
    k and v [B, T, K, Dh], in dt. Projections are rounded to the compute dtype as in the model;
    RoPE then runs in fp32 (in bf16 XLA:CPU emulates every elementwise op with converts: ~50
    ms/layer for a B=32 prefill)."""
    (b, t), h, kh, dh = positions.shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = (dense(ops.rms_norm(x, lw["in_norm"], cfg.rms_norm_eps), lw["qkv_w"]) + lw["qkv_b"]).astype(jnp.float32)
    q = ops.rope(qkv[:, :h * dh].reshape(b, t, h, dh), positions, cfg.rope_theta).astype(dt)
    k = ops.rope(qkv[:, h * dh:(h + kh) * dh].reshape(b, t, kh, dh), positions, cfg.rope_theta).astype(dt)
    return q, k, qkv[:, (h + kh) * dh:].reshape(b, t, kh, dh).astype(dt)


def _after_attention(cfg: Qwen2Config, dt: Any, lw: dict[str, Any], x: jax.Array, out: jax.Array) -> jax.Array:
    """The rest of a layer: x [B*T, D] plus the output projection of the attention out [B*T, H Dh],
    then plus the MLP. gate/up are rounded to the compute dtype and silu(g) * u is evaluated in fp32
    and rounded once, as the model's `mixed.swiglu` does (bf16 elementwise math on XLA:CPU is a
    convert after every op: ~1 ms/layer)."""
    x = x + dense(out, lw["o_w"])
    gu = dense(ops.rms_norm(x, lw["post_norm"], cfg.rms_norm_eps), lw["gu_w"]).astype(jnp.float32)
    g, u = gu[:, :cfg.intermediate_size], gu[:, cfg.intermediate_size:]
    return x + dense((jax.nn.silu(g) * u).astype(dt), lw["down_w"])


def hidden_ragged(cfg: Qwen2Config, dt: Any, w: dict[str, Any], tokens: jax.Array, positions: jax.Array,
                  rows: jax.Array, mask: jax.Array, k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
                  table: jax.Array, block: int) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A ragged step on this path (sampler/ragged.py): tokens, positions, rows, mask [N] -> final-normed
    hidden [N, D] (dt) and the pages with each real token's K/V written at its position of row
    rows[i] of `table` [R, P] (padding to the scratch page, the last).

    Pages per layer in this path's cache layout (sampler/paged.py `new_pages`): keys [n, K, Dh, ps],
    values [n, K, ps, Dh], fp32. Attention as `paged_kv.attend_tokens`: blocks of `block` tokens
    under `lax.map`, one gather of the row's pages for a block of one row's tokens, one per token
    otherwise, each query over its row's slots up to its own position.
    """
    n = tokens.shape[0]
    h, kh, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g, ps = h // kh, k_pages[0].shape[-1]
    x = _embed(w, tokens, dt)                                                      # [N, D]
    page = jnp.where(mask, table[rows, jnp.minimum(positions // ps, table.shape[1] - 1)], k_pages[0].shape[0] - 1)
    slot = positions % ps

    def attend_block(q, kp, vp, rb, pb):
        """q [blk, K, G, Dh] of tokens of rows rb at positions pb [blk] -> fp32 [blk, H Dh]."""
        def gathered(table_rows):   # [r, K, Dh, S] keys, [r, K, S, Dh] values of these rows' pages
            kk = kp[table_rows].transpose(0, 2, 3, 1, 4)                         # [r, K, Dh, P, ps]
            vv = vp[table_rows].transpose(0, 2, 1, 3, 4)                         # [r, K, P, ps, Dh]
            r = table_rows.shape[0]
            return kk.reshape(r, kh, dh, -1), vv.reshape(r, kh, -1, dh)

        s = table.shape[1] * ps
        slots = jnp.arange(s, dtype=jnp.int32)

        def shared():
            kk, vv = gathered(table[rb[:1]])
            out = attend(q[None], kk, vv, (slots[None, :] <= pb[:, None])[None])   # [1, blk, K, G, Dh]
            return out.reshape(q.shape[0], h * dh)

        def each():
            kk, vv = gathered(table[rb])
            out = attend(q[:, None], kk, vv, (slots[None, :] <= pb[:, None])[:, None])  # [blk, 1, K, G, Dh]
            return out.reshape(q.shape[0], h * dh)

        return jax.lax.cond(jnp.all(rb == rb[0]), shared, each)

    new_k, new_v = [], []
    for i, lw in enumerate(w["layers"]):
        q, k, v = (y[0] for y in _qkv(cfg, dt, lw, x, positions[None]))
        kp = k_pages[i].at[page, :, :, slot].set(k.astype(k_pages[i].dtype))    # [N, K, Dh] at (page, :, :, slot)
        vp = v_pages[i].at[page, :, slot, :].set(v.astype(v_pages[i].dtype))
        new_k.append(kp)
        new_v.append(vp)
        blocks = (q.reshape(n // block, block, kh, g, dh), rows.reshape(-1, block), positions.reshape(-1, block))
        out = jax.lax.map(lambda a: attend_block(a[0], kp, vp, a[1], a[2]), blocks).reshape(n, h * dh).astype(dt)
        x = _after_attention(cfg, dt, lw, x, out)
    return ops.rms_norm(x, w["final_norm"], cfg.rms_norm_eps), tuple(new_k), tuple(new_v)


def logits_t(w: dict[str, Any], h: jax.Array) -> jax.Array:
    """Hidden [B, D] -> fp32 logits, vocabulary-major [V, B] (the head GEMM's own output order, see `dense`)."""
    if weight_as_lhs(h.shape[0], w["head"].shape, w["head"].dtype):
        y = jax.lax.dot_general(w["head"], h, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.optimization_barrier(y)
    return dense(h, w["head"], jnp.float32).T


__all__ = ["CACHE_DTYPE", "K_SLOT_AXIS", "V_SLOT_AXIS", "attend", "dense", "hidden", "hidden_ragged", "logits_t",
           "min_rows",
           "new_cache", "store_dtype", "weight_as_lhs", "weights"]
