"""Batched KV-cache generation for the NNX Qwen2: jitted prefill + `lax.while_loop` decode.

Used by the rollout engine, the embedded executor backend (`make_generate_fn`) and evaluation.

Layout of a batch (the "session"): every row owns a compact run of cache slots. Row b holds its
first `cached[b]` tokens in slots 0 .. cached[b]-1, so a token's slot equals its RoPE position and
rows of different lengths need no left padding inside the cache. Tokens of a row that are known but
not yet written (a new prompt, an appended observation, the last generated token) are "pending";
`generate_from` first feeds all pending tokens (right-padded chunks written at each row's own
`cache.end[b]`), then decodes. Continuing a row after `append` therefore costs only the new tokens.

Compiled programs are few: chunk lengths, cache lengths and the output buffer are bucketed (powers
of two), params are a jit argument (the trainer passes new weights without recompiling), and the
decode state (KV cache included) is donated so the cache is updated in place.

Sampling (per call): greedy (temperature 0), or temperature with optional top-k / top-p, seeded per
call (row r at step i uses fold_in(fold_in(PRNGKey(seed), r), i), so a row's sample does not depend
on the other rows). For each generated token we return its log-probability under the *tempered
full-vocabulary* distribution, log_softmax(logits / temperature) (temperature 1 for greedy): top-k
and top-p only restrict which tokens can be drawn and are NOT renormalised into the returned
log-prob, which is what the RL loss's old-log-prob / importance ratio needs (the trainer recomputes
the same quantity from a full forward pass).

Stops, checked per row inside the loop (finished rows stop writing while the others continue):
EOS ids, `max_new_tokens`, the cache limit (`cache_size` tokens per row, prompt included), and stop
strings. Stop strings are matched on the bytes of the generated tokens by a KMP automaton lifted to
whole tokens (a [states, vocab] transition table per stop string, built once on the host), so a
string spanning several tokens, or ending inside a token, is caught at the exact token that
completes it. Generation ends with that token (it is kept, with its log-prob); nothing after it is
generated, so nothing needs trimming. Text returned by `generate_text` is cut exactly after the stop
string. Only generated text is matched (not the prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from workflow_r1 import sharding
from workflow_r1.model import qwen2
from workflow_r1.model import tokenizer as tokenizer_lib

FINISH_REASONS = ("eos", "stop", "length", "cache_full")
_EOS, _STOP, _LENGTH, _CACHE_FULL = range(4)
_RUNNING = -1


class SamplerError(ValueError):
    """Bad input to the sampler (empty prompts, prompt longer than the cache, unknown token id...)."""


@dataclasses.dataclass
class SampleOutput:
    """Generation result, one entry per requested row.

    tokens: generated ids per row, including the final EOS token / the token completing a stop string.
    logprobs: float32 [len(tokens[r])] per row, log p(token) under log_softmax(logits / temperature).
    finish_reason: "eos" | "stop" | "length" | "cache_full" per row.
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    finish_reason: list[str]


@dataclasses.dataclass
class Session:
    """A batch of rows being generated over several turns (see `Sampler.start`).

    sequences: every token of each row so far (prompt, generated, appended), host side.
    cached: [rows] how many leading tokens of each row are written in the KV cache; the rest are pending.
    cache: device KV cache with `padded_rows` >= rows rows and bucketed length (None until first use).
    """

    sequences: list[list[int]]
    cached: np.ndarray
    cache: qwen2.KVCache | None = None

    @property
    def num_rows(self) -> int:
        return len(self.sequences)

    def lengths(self) -> list[int]:
        """Total tokens per row (prompt + generated + appended)."""
        return [len(s) for s in self.sequences]


# ----------------------------------------------------------------------------------------- buckets

def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _bucket(n: int, buckets: Sequence[int] | None, minimum: int) -> int:
    """Smallest bucket >= n (powers of two when `buckets` is None or exhausted)."""
    if buckets:
        for b in buckets:
            if b >= n:
                return b
    return _pow2_at_least(n, minimum)


# ------------------------------------------------------------------------------------ stop strings

def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level BPE alphabet: byte value -> the printable character standing for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def vocab_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """The raw bytes each token id stands for (b"" for ids the tokenizer does not define).

    Works for byte-level BPE tokenizers (Qwen, GPT-2 family): the concatenation of a sequence's token
    bytes is the UTF-8 of its decoded text, special tokens included as their literal content.
    """
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    n = min(vocab_size, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in added:
            out.append(added[i].encode("utf-8"))
        elif piece is None:
            out.append(b"")
        elif all(c in byte_of for c in piece):
            out.append(bytes(byte_of[c] for c in piece))
        else:  # not byte-level (e.g. sentencepiece): best effort through the tokenizer's own decode
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out + [b""] * (vocab_size - n)


def _kmp_automaton(pattern: bytes) -> np.ndarray:
    """[L+1, 256] byte transitions of the KMP automaton for `pattern`; state L (= matched) absorbs."""
    n = len(pattern)
    prefix = [0] * n  # longest proper prefix of pattern[:q+1] that is also its suffix
    k = 0
    for q in range(1, n):
        while k and pattern[q] != pattern[k]:
            k = prefix[k - 1]
        if pattern[q] == pattern[k]:
            k += 1
        prefix[q] = k
    delta = np.zeros((n + 1, 256), np.int32)
    for q in range(n):
        if q:
            delta[q] = delta[prefix[q - 1]]
        delta[q, pattern[q]] = q + 1
    delta[n] = n
    return delta


def stop_tables(stop_strings: Sequence[str], token_bytes: Sequence[bytes]) -> np.ndarray:
    """int16 [num_stops, max_len, V]: next automaton state after a token, or -1 if it completes the string.

    Entry [s, q, t] is where stop string s's matcher goes from state q (q bytes of s matched) after
    the bytes of token t; -1 means the string occurs ending inside t. States q >= len(s) are unused.
    """
    v = len(token_bytes)
    lengths = np.fromiter((len(b) for b in token_bytes), np.int64, v)
    order = np.argsort(-lengths, kind="stable")  # longest first: column j is needed by a prefix only
    maxlen = int(lengths.max(initial=0))
    mat = np.zeros((v, max(maxlen, 1)), np.uint8)
    for row, t in enumerate(order):
        b = token_bytes[t]
        if b:
            mat[row, :len(b)] = np.frombuffer(b, np.uint8)
    counts = [int((lengths > j).sum()) for j in range(maxlen)]  # tokens with a byte at column j
    pats = [s.encode("utf-8") for s in stop_strings]
    width = max(len(p) for p in pats)
    out = np.zeros((len(pats), width, v), np.int16)
    for s, pat in enumerate(pats):
        n = len(pat)
        delta = _kmp_automaton(pat)
        cur = np.repeat(np.arange(n, dtype=np.int32)[:, None], v, axis=1)  # [n, V] in sorted token order
        for j in range(maxlen):
            m = counts[j]
            cur[:, :m] = delta[cur[:, :m], mat[None, :m, j]]
        out[s, :n][:, order] = np.where(cur == n, -1, cur)
    return out


# ---------------------------------------------------------------------------------- jitted kernels

def _row_keys(seed_key: jax.Array, step: jax.Array, batch: int) -> jax.Array:
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(seed_key, r), step))(jnp.arange(batch))


def _nucleus_min_prob(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] probabilities -> [B] smallest kept probability x0 of the top-p nucleus.

    A token is kept iff the mass of strictly more probable tokens is < top_p (the HF rule); the kept
    set is {p >= x0} with x0 the smallest float where mass_above(x0) < top_p. Found by bisection on
    the int32 bit patterns of non-negative floats (monotone), 31 exact steps, no sort over V.
    """
    def mass_above(bits):
        x = jax.lax.bitcast_convert_type(bits, jnp.float32)[:, None]
        return jnp.sum(jnp.where(probs > x, probs, 0.0), axis=-1)

    b = probs.shape[0]
    lo = jnp.full((b,), -1, jnp.int32)  # invariant: mass_above(lo) >= top_p (lo = -1 means "below 0")
    hi = jnp.full((b,), jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32), jnp.int32)

    def body(_, lh):
        lo, hi = lh
        mid = lo + (hi - lo) // 2
        ok = mass_above(jnp.maximum(mid, 0)) < top_p
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def _argmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """First index of the max over `axis` of a 2-D array, int32 [other axis].

    Same result as jnp.argmax, ~4x faster on XLA:CPU for a 152k vocabulary: two vectorised
    reductions (max, then min of the float index where x equals it) instead of one (value, index)
    pair reduction. Float indices are exact below 2**24.
    """
    v = x.shape[axis]
    hit = x == jnp.max(x, axis=axis, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.float32, x.shape, axis % x.ndim)
    idx = jnp.min(jnp.where(hit, iota, jnp.float32(v)), axis=axis)
    return jnp.minimum(idx, v - 1).astype(jnp.int32)


def _picked_logprob(scaled: jax.Array, tok: jax.Array, axis: int = -1) -> jax.Array:
    """log_softmax(scaled)[tok] per row (vocabulary on `axis` of a 2-D array), no [B, V] log-probs."""
    picked = jnp.take_along_axis(scaled, jnp.expand_dims(tok, axis), axis=axis).squeeze(axis)
    return picked - jax.nn.logsumexp(scaled, axis=axis)


def _gumbel_argmax(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One categorical sample per row (row r uses keys[r]): argmax(logits + Gumbel noise)."""
    g = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[1:], jnp.float32))(keys)
    return _argmax(logits + g)


def _sample(logits_vb: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, *,
            greedy: bool, top_k_bucket: int, use_top_p: bool) -> tuple[jax.Array, jax.Array]:
    """logits fp32 [V, B] -> (token [B] int32, log-prob [B] fp32 under log_softmax(logits / T)).

    Vocabulary-major because that is how the "nk" path's head GEMM produces them (see `_dense`):
    greedy decoding reduces over V in that layout, with no [B, V] copy per step.
    top_k (dynamic, <= top_k_bucket) is applied first, then top_p on the renormalised top-k
    distribution (HF's order); top_k_bucket = 0 means no top-k.
    """
    if greedy:
        tok = _argmax(logits_vb, axis=0)
        return tok, _picked_logprob(logits_vb, tok, axis=0)
    scaled = logits_vb.T / temperature
    if top_k_bucket:
        vals, idx = jax.lax.top_k(scaled, top_k_bucket)  # sorted descending
        vals = jnp.where(jnp.arange(top_k_bucket)[None, :] < top_k, vals, -jnp.inf)
        if use_top_p:
            p = jax.nn.softmax(vals, axis=-1)
            vals = jnp.where(jnp.cumsum(p, axis=-1) - p < top_p, vals, -jnp.inf)
        choice = _gumbel_argmax(keys, vals)
        tok = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    else:
        allowed = scaled
        if use_top_p:
            probs = jax.nn.softmax(scaled, axis=-1)
            x0 = _nucleus_min_prob(probs, top_p)
            allowed = jnp.where(probs >= x0[:, None], scaled, -jnp.inf)
        tok = _gumbel_argmax(keys, allowed)
    return tok, _picked_logprob(scaled, tok)


@dataclasses.dataclass(frozen=True)
class _Impl:
    """Static description of the forward used inside the jitted programs (a hashable jit static arg).

    kind "model": the NNX model itself (`nnx.merge(graphdef, weights)`), weights = its nnx.State.
    kind "nk": the sampler's CPU path, weights = `_nk_weights(...)`: the same parameters with every
    projection stored [out, in] (HF's Linear layout) and q/k/v and gate/up fused, and matmuls that
    accumulate in fp32. XLA:CPU runs bf16 dots ~1.8x faster on [out, in] weights with fp32
    accumulation than on the model's [in, out] layout; the math is the model's, and tests check
    both paths agree.
    """

    kind: str
    graphdef: Any
    cfg: Any
    dtype: Any


def _nk_weights_impl(params: Any, cfg: Any, dtype: Any) -> dict[str, Any]:
    """Model nnx.State -> the "nk" weight tree (projections [out, in], q/k/v and gate/up fused)."""
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def val(x):
        return x[...] if hasattr(x, "get_value") else x

    layers = []
    for i in range(cfg.num_layers):
        a, m, lp = params["layers"][i]["attn"], params["layers"][i]["mlp"], params["layers"][i]
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
    if _store_dtype(dtype) == jnp.uint16:
        # A 16-bit float gather makes XLA:CPU convert the whole table to fp32 per call; gather bits.
        embed = jax.lax.bitcast_convert_type(embed, jnp.uint16)
    return {"embed": embed, "head": head, "final_norm": val(params["final_norm"]["scale"]).astype(dtype),
            "layers": layers}


_nk_weights = jax.jit(_nk_weights_impl, static_argnums=(1, 2))


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf.astype(x.dtype) * scale.astype(x.dtype)


def _weight_as_lhs(rows: int, dtype: Any) -> bool:
    """Whether `_dense` computes x @ w.T as (w @ x.T).T for `rows` activation rows (a static choice).

    Measured on a 2-core Sapphire Rapids with `gemm_floor` in benchmarks/sampler_vs_hf.py (a
    decode step's GEMMs and their glue, 0.5B shapes): with the weight as the GEMM's lhs (its long
    side) XLA:CPU's bf16 kernels take 65 / 63 / 88 / 168 ms per step at 8 / 16 / 24 / 32 rows,
    against 97 / 97 / 103 / 143 ms in the x @ w.T order; in fp32 the weight-as-lhs order wins
    through 32 rows (107 vs 148 ms at 8 rows, 224 vs 284 ms at 32).
    """
    return rows <= (32 if jnp.dtype(dtype).itemsize >= 4 else 24)


def _dense(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x [N, in] @ w[out, in].T -> [N, out] with fp32 accumulation, result in out_dtype (default x's).

    Small N (decode) runs as (w @ x.T).T, see `_weight_as_lhs`; the barrier keeps XLA's simplifier
    from folding the transpose back into the dot. Both operands stay row-major with the
    contraction on the minor axis: other layouts make XLA:CPU convert the weight to fp32 per call.
    """
    if _weight_as_lhs(x.shape[0], w.dtype):
        y = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        y = jax.lax.optimization_barrier(y).T
    else:
        y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _store_dtype(dtype: Any) -> Any:
    """How the "nk" path stores a 16-bit float table it gathers from: as uint16 bits.

    XLA:CPU runs a bf16 gather (or scatter) by converting the whole buffer to fp32 and back on
    every call; an integer buffer is read in place.
    """
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else dtype


# The "nk" KV cache is head-major, [B, K, S, Dh] (the model's is [B, S, K, Dh]), so attention is two
# batched matmuls over (B, K) in the cache's own layout; the slot-major layout makes XLA:CPU
# transpose the whole cache every step. It is stored in fp32 whatever the compute dtype, holding
# values already rounded to that dtype (so the numbers are the model's): a bf16 buffer costs a
# whole-cache convert per step on XLA:CPU, whether scattered into directly or via uint16 bits
# (that bitcast is materialised as a copy before the attention matmul): 13 ms of a 230 ms step
# at batch 32. The price is twice the cache memory.
_NK_SLOT_AXIS = 2
_NK_CACHE_DTYPE = jnp.float32


def _write_cache(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, K, S, Dh] <- new [B, T, K, Dh] (compute dtype, converted exactly) at per-row slot start [B]."""
    new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (0, s, 0)))(buf, new, start)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked attention: q [B, T, K, G, Dh] (compute dtype), k/v fp32 cache [B, K, S, Dh] holding
    compute-dtype values, mask [B, T, S] -> fp32 [B, T, K, G, Dh].

    The model's numbers: scores and softmax in fp32, probabilities rounded to the compute dtype for
    the weighted sum, which accumulates in fp32 (a product of two bf16 values is exact in fp32, so
    fp32 matmuls on bf16-valued operands are the model's bf16 matmuls with fp32 accumulation).
    """
    dh, dt, f32 = q.shape[-1], q.dtype, jnp.float32
    scores = jnp.einsum("btkgd,bksd->bkgts", q.astype(f32), k.astype(f32)) * (dh ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).astype(f32)
    # A plain [.., T, S] @ [S, Dh] batched matmul, transposed after (small): XLA:CPU's fast path.
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(f32))
    return out.transpose(0, 3, 1, 2, 4)


def _nk_hidden(impl: _Impl, w: dict[str, Any], tokens: jax.Array, positions: jax.Array, input_mask: jax.Array,
               cache: qwen2.KVCache) -> tuple[jax.Array, qwen2.KVCache]:
    """Same contract as `Qwen2.hidden_states` with a cache (see qwen2.py), on the "nk" weights.

    Activations are kept 2-D [B*T, D] between attentions: a size-1 T axis (decode) otherwise makes
    XLA:CPU insert layout copies inside the elementwise fusions.
    """
    cfg, dt = impl.cfg, impl.dtype
    b, t = tokens.shape
    h, kh, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = jnp.take(w["embed"], tokens.reshape(-1), axis=0)
    if x.dtype == jnp.uint16:  # see _nk_weights_impl
        x = jax.lax.bitcast_convert_type(x, dt)
    x = x.astype(dt)                                                               # [B*T, D]
    start = cache.end
    query_slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    key_valid = qwen2._write_rows(cache.valid, input_mask.astype(bool), start)
    key_slots = jnp.arange(cache.size, dtype=jnp.int32)
    mask = key_valid[:, None, :] & (key_slots[None, None, :] <= query_slots[:, :, None])  # [B, T, S]
    new_k, new_v = [], []
    for i, lw in enumerate(w["layers"]):
        # Projections are rounded to the compute dtype as in the model; RoPE then runs in fp32 (in
        # bf16 XLA:CPU emulates every elementwise op with converts: ~50 ms/layer for a B=32 prefill).
        qkv = (_dense(_rms(x, lw["in_norm"], cfg.rms_norm_eps), lw["qkv_w"]) + lw["qkv_b"]).astype(jnp.float32)
        q = qwen2.rope(qkv[:, :h * dh].reshape(b, t, h, dh), positions, cfg.rope_theta).astype(dt)
        k = qwen2.rope(qkv[:, h * dh:(h + kh) * dh].reshape(b, t, kh, dh), positions, cfg.rope_theta).astype(dt)
        v = qkv[:, (h + kh) * dh:].reshape(b, t, kh, dh).astype(dt)
        new_k.append(_write_cache(cache.k[i], k, start))
        new_v.append(_write_cache(cache.v[i], v, start))
        out = _attend(q.reshape(b, t, kh, h // kh, dh), new_k[-1], new_v[-1], mask).astype(dt)
        x = x + _dense(out.reshape(b * t, h * dh), lw["o_w"])
        # gate/up are rounded to the compute dtype as in the model, but silu(g) * u is evaluated in
        # fp32: XLA:CPU emulates bf16 elementwise math with a convert after every op (~1 ms/layer).
        gu = _dense(_rms(x, lw["post_norm"], cfg.rms_norm_eps), lw["gu_w"]).astype(jnp.float32)
        g, u = gu[:, :cfg.intermediate_size], gu[:, cfg.intermediate_size:]
        x = x + _dense((jax.nn.silu(g) * u).astype(dt), lw["down_w"])
    x = _rms(x, w["final_norm"], cfg.rms_norm_eps).reshape(b, t, -1)
    return x, qwen2.KVCache(k=tuple(new_k), v=tuple(new_v), valid=key_valid, end=cache.end + t)


def _hidden(impl: _Impl, weights: Any, tokens: jax.Array, positions: jax.Array, input_mask: jax.Array,
            cache: qwen2.KVCache) -> tuple[jax.Array, qwen2.KVCache]:
    """tokens/positions/input_mask [B, T] -> final-normed hidden [B, T, D] and the updated cache."""
    if impl.kind == "nk":
        return _nk_hidden(impl, weights, tokens, positions, input_mask, cache)
    model = nnx.merge(impl.graphdef, weights)
    return model.hidden_states(tokens, positions, input_mask=input_mask, cache=cache)


def _logits_t(impl: _Impl, weights: Any, h: jax.Array) -> jax.Array:
    """Hidden [B, D] -> fp32 logits, vocabulary-major [V, B] (see `_dense`)."""
    if impl.kind == "nk" and _weight_as_lhs(h.shape[0], weights["head"].dtype):
        y = jax.lax.dot_general(weights["head"], h, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.optimization_barrier(y)
    if impl.kind == "nk":
        return _dense(h, weights["head"], jnp.float32).T
    return nnx.merge(impl.graphdef, weights).logits_from_hidden(h).T


def _logits(impl: _Impl, weights: Any, h: jax.Array) -> jax.Array:
    """Hidden [B, D] -> fp32 logits [B, V]."""
    return _logits_t(impl, weights, h).T


def _extend_impl(impl: _Impl, weights: Any, cache: qwen2.KVCache, logits: jax.Array, tokens: jax.Array,
                 counts: jax.Array) -> tuple[jax.Array, qwen2.KVCache]:
    """Writes a right-padded chunk of tokens [B, T] (counts [B] real ones per row) at each row's end.

    Returns the logits [B, V] after each row's last real token (rows with counts == 0 keep their
    previous `logits`) and the cache with end += counts.
    """
    t = tokens.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    mask = ar[None, :] < counts[:, None]
    positions = cache.end[:, None] + ar[None, :]  # slot == position: rows are compact in the cache
    h, new_cache = _hidden(impl, weights, tokens, positions, mask, cache)
    last = jnp.take_along_axis(h, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    new_logits = _logits(impl, weights, last)
    logits = jnp.where((counts > 0)[:, None], new_logits, logits)
    return logits, new_cache.replace(end=cache.end + counts)


def _decode_impl(impl: _Impl, weights: Any, cache: qwen2.KVCache, logits: jax.Array, limit: jax.Array,
                 limit_reason: jax.Array, eos_ids: jax.Array, tables: jax.Array | None,
                 temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seed_key: jax.Array, *,
                 buf_len: int, greedy: bool, top_k_bucket: int, use_top_p: bool):
    """Samples up to limit[b] tokens per row (limit 0 = row inactive), starting from `logits` [B, V].

    limit_reason [B]: reason code when a row reaches its limit (length or cache_full).
    Returns (tokens [B, buf_len], logprobs [B, buf_len], n_generated [B], reason [B], cache).
    The last generated token of a row is not written to the cache (it is pending).
    """
    b = logits.shape[0]
    n_stop = 0 if tables is None else tables.shape[0]
    sample = functools.partial(_sample, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               top_k_bucket=top_k_bucket, use_top_p=use_top_p)

    def pick(i, logits, done, n_gen, reason, stop_state, toks, lps):
        """Samples step i for rows not done; records it; updates the per-row stop checks."""
        running = ~done
        tok, lp = sample(logits, _row_keys(seed_key, i, b))
        col = jnp.minimum(i, buf_len - 1)
        toks = jax.lax.dynamic_update_slice(toks, jnp.where(running, tok, 0)[:, None], (0, col))
        lps = jax.lax.dynamic_update_slice(lps, jnp.where(running, lp, 0.0)[:, None], (0, col))
        n_gen = n_gen + running.astype(jnp.int32)
        is_eos = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        if n_stop:
            nxt = tables[jnp.arange(n_stop)[None, :], stop_state, tok[:, None]]  # [B, n_stop]
            is_stop = jnp.any(nxt < 0, axis=-1)
            stop_state = jnp.where(running[:, None], jnp.maximum(nxt, 0), stop_state)
        else:
            is_stop = jnp.zeros_like(is_eos)
        at_limit = n_gen >= limit
        new_reason = jnp.where(is_eos, _EOS, jnp.where(is_stop, _STOP, jnp.where(at_limit, limit_reason, _RUNNING)))
        finished = running & (new_reason != _RUNNING)
        reason = jnp.where(finished, new_reason, reason)
        return tok, done | finished, n_gen, reason, stop_state, toks, lps

    done0 = limit <= 0
    n_gen0 = jnp.zeros((b,), jnp.int32)
    reason0 = jnp.where(done0, limit_reason, _RUNNING).astype(jnp.int32)
    stop0 = jnp.zeros((b, max(n_stop, 1)), jnp.int16 if tables is None else tables.dtype)
    toks0 = jnp.zeros((b, buf_len), jnp.int32)
    lps0 = jnp.zeros((b, buf_len), jnp.float32)
    tok, done, n_gen, reason, stop_state, toks, lps = pick(
        jnp.int32(0), logits.T, done0, n_gen0, reason0, stop0, toks0, lps0)

    def cond(carry):
        i, _, _, done, *_ = carry
        return (i < buf_len) & jnp.any(~done)

    def body(carry):
        i, cache, tok, done, n_gen, reason, stop_state, toks, lps = carry
        running = ~done
        # Finished rows still flow through the batch, but write an invalid slot and keep their end.
        h, new_cache = _hidden(impl, weights, tok[:, None], cache.end[:, None], running[:, None], cache)
        cache = new_cache.replace(end=cache.end + running.astype(jnp.int32))
        logits = _logits_t(impl, weights, h[:, 0])
        tok, done, n_gen, reason, stop_state, toks, lps = pick(i, logits, done, n_gen, reason, stop_state, toks, lps)
        return i + 1, cache, tok, done, n_gen, reason, stop_state, toks, lps

    carry = (jnp.int32(1), cache, tok, done, n_gen, reason, stop_state, toks, lps)
    _, cache, _, _, n_gen, reason, _, toks, lps = jax.lax.while_loop(cond, body, carry)
    return toks, lps, n_gen, reason, cache


def _grow_impl(cache: qwen2.KVCache, new_size: int, kv_slot_axis: int) -> qwen2.KVCache:
    def p(x, axis):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, new_size - x.shape[axis])
        return jnp.pad(x, pad)

    return qwen2.KVCache(k=tuple(p(x, kv_slot_axis) for x in cache.k), v=tuple(p(x, kv_slot_axis) for x in cache.v),
                         valid=p(cache.valid, 1), end=cache.end)


_extend = jax.jit(_extend_impl, static_argnums=(0,), donate_argnames=("cache", "logits"))
_decode = jax.jit(_decode_impl, static_argnums=(0,), donate_argnames=("cache",),
                  static_argnames=("buf_len", "greedy", "top_k_bucket", "use_top_p"))
_grow = jax.jit(_grow_impl, static_argnames=("new_size", "kv_slot_axis"))


# ---------------------------------------------------------------------------------------- sampler

class Sampler:
    """Generates from an NNX Qwen2 with a per-row KV cache. See the module docstring for semantics.

    Args:
      model: the model (its params are split out and passed to the jitted programs as arguments).
      tokenizer: an HF tokenizer; needed for stop strings and the text helpers.
      cache_size: most tokens a row may hold (prompt + generated + appended).
      buckets: allowed chunk lengths for writing prompts/observations (default: powers of two, at
        least 16, at most `prefill_chunk`); longer inputs are written in several chunks.
      cache_buckets: allowed physical cache lengths (default: powers of two >= 128).
      prefill_chunk: longest chunk written in one call (bounds prefill memory).
      mesh: run on this mesh (batch over data/fsdp, weights as already sharded by `checkpoint.load`).
      token_bytes: bytes per token id, overriding what `tokenizer` gives (tests, custom vocabularies).
      eos_ids: default EOS ids (default: the model config's, e.g. <|im_end|>, <|endoftext|>).
      impl: "model" runs the NNX model's own forward; "nk" runs the sampler's CPU path (same math,
        projections stored [out, in], fp32 accumulation; see `_Impl`); "auto" picks "nk" on a
        single CPU device and "model" otherwise.
      dtype: compute dtype of the "nk" path (default: the model's compute dtype), e.g. bfloat16
        rollouts from fp32 training weights; its KV cache is fp32 holding values of this dtype.
        The "model" path always uses the model's.
    """

    def __init__(self, model: qwen2.Qwen2, tokenizer: Any = None, *, cache_size: int = 4096,
                 buckets: Sequence[int] | None = None, cache_buckets: Sequence[int] | None = None,
                 prefill_chunk: int = 512, mesh: jax.sharding.Mesh | None = None,
                 token_bytes: Sequence[bytes] | None = None, eos_ids: Sequence[int] | None = None,
                 impl: str = "auto", dtype: Any = None):
        if cache_size < 2:
            raise SamplerError(f"cache_size={cache_size} must be at least 2")
        if impl not in ("auto", "model", "nk"):
            raise SamplerError(f"impl={impl!r} unknown; use 'auto', 'model' or 'nk'")
        if impl == "auto":
            impl = "nk" if mesh is None and jax.default_backend() == "cpu" else "model"
        if impl == "nk" and mesh is not None:
            raise SamplerError("impl='nk' is the single-device CPU path; use impl='model' with a mesh")
        dtype = jnp.dtype(model.dtype if dtype is None else dtype)
        if impl == "model" and dtype != jnp.dtype(model.dtype):
            raise SamplerError(f"dtype={dtype} differs from the model's compute dtype {jnp.dtype(model.dtype)}; "
                               "impl='model' runs the model as loaded (load it with that dtype, or use impl='nk')")
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.cache_size = int(cache_size)
        self.prefill_chunk = int(prefill_chunk)
        self.buckets = sorted(buckets) if buckets else None
        self.cache_buckets = sorted(cache_buckets) if cache_buckets else None
        self.mesh = mesh
        graphdef, params = nnx.split(model)
        self._impl = _Impl(impl, graphdef if impl == "model" else None, self.cfg, dtype)
        self.cache_dtype = dtype
        # bf16 dots with a single row take a slow XLA:CPU path (weights converted to fp32 per call).
        self._min_rows = 2 if impl == "nk" and dtype == jnp.bfloat16 else 1
        self.update_params(params)
        self._token_bytes = list(token_bytes) if token_bytes is not None else None
        self._tables: dict[tuple[str, ...], jax.Array] = {}
        self.eos_ids = tuple(self.cfg.eos_token_ids if eos_ids is None else eos_ids)
        self._check_ids(self.eos_ids, "eos id")

    # ------------------------------------------------------------------ params / helpers

    def update_params(self, params: Any) -> None:
        """Use new weights (an nnx.State from `nnx.split(model)[1]`, or a model) without recompiling."""
        if isinstance(params, nnx.Module):
            params = nnx.split(params)[1]
        if self._impl.kind == "nk":
            self._weights = _nk_weights(params, self.cfg, self._impl.dtype)
        else:
            self._weights = params

    @property
    def impl(self) -> str:
        """The forward in use: "model" or "nk"."""
        return self._impl.kind

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def token_bytes(self) -> list[bytes]:
        if self._token_bytes is None:
            if self.tokenizer is None:
                raise SamplerError("stop strings need token texts: pass tokenizer= (or token_bytes=) to Sampler")
            self._token_bytes = vocab_bytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        for t in ids:
            if not 0 <= int(t) < self.vocab_size:
                raise SamplerError(f"{what} {t} is outside the vocabulary [0, {self.vocab_size}); "
                                   "check the tokenizer matches the checkpoint")

    def _stop_table(self, stop_strings: tuple[str, ...]) -> jax.Array:
        if stop_strings not in self._tables:
            for s in stop_strings:
                if not isinstance(s, str) or not s:
                    raise SamplerError(f"stop string {s!r} must be a non-empty str")
            table = stop_tables(stop_strings, self.token_bytes())
            # Padded (never-matching all-zero rows, unused states) to a few shapes: fewer compiles.
            n, width = _pow2_at_least(table.shape[0], 1), -(-table.shape[1] // 16) * 16
            table = np.pad(table, ((0, n - table.shape[0]), (0, width - table.shape[1]), (0, 0)))
            self._tables[stop_strings] = self._replicated(jnp.asarray(table))
        return self._tables[stop_strings]

    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in ("data", "fsdp") if a in self.mesh.shape)

    def _put_batch(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, sharding.batch_sharding(self.mesh, x.ndim))

    def _replicated(self, x: jax.Array) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.device_put(x, NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def _new_cache(self, batch: int, size: int) -> qwen2.KVCache:
        if self._impl.kind == "nk":  # head-major fp32 (see _NK_SLOT_AXIS)
            shape = (batch, self.cfg.num_kv_heads, size, self.cfg.head_dim)
            zeros = lambda: tuple(jnp.zeros(shape, _NK_CACHE_DTYPE) for _ in range(self.cfg.num_layers))  # noqa: E731
            return qwen2.KVCache(k=zeros(), v=zeros(), valid=jnp.zeros((batch, size), bool),
                                 end=jnp.zeros((batch,), jnp.int32))
        cache = qwen2.KVCache.init(self.cfg, batch, size, self.cache_dtype)
        if self.mesh is None:
            return cache
        kv = sharding.named_sharding(self.mesh, qwen2.CACHE_AXES, cache.k[0].shape)
        return qwen2.KVCache(k=tuple(jax.device_put(x, kv) for x in cache.k),
                             v=tuple(jax.device_put(x, kv) for x in cache.v),
                             valid=self._put_batch(np.zeros((batch, size), bool)),
                             end=self._put_batch(np.zeros((batch,), np.int32)))

    def _call(self, fn, *args, **kw):
        with sharding.use_mesh(self.mesh):
            return fn(*args, **kw)

    # ------------------------------------------------------------------ session API

    def start(self, prompts: Sequence[Sequence[int]]) -> Session:
        """A session over `prompts` (token ids, any lengths); nothing is computed until `generate_from`."""
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise SamplerError("prompts is empty; pass a non-empty list of token-id lists")
        seqs = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise SamplerError(f"prompt {i} is empty; every row needs at least one token")
            if len(p) >= self.cache_size:
                raise SamplerError(f"prompt {i} has {len(p)} tokens but cache_size={self.cache_size} leaves no "
                                   "room to generate; raise Sampler(cache_size=...) or shorten the prompt")
            self._check_ids(p, f"token id in prompt {i}:")
            seqs.append(p)
        return Session(sequences=seqs, cached=np.zeros(len(seqs), np.int64))

    def append(self, session: Session, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Appends tokens (e.g. an observation) to the given rows; written lazily by the next generate_from."""
        if len(rows) != len(tokens):
            raise SamplerError(f"append got {len(rows)} rows but {len(tokens)} token lists")
        for r, toks in zip(rows, tokens):
            self._check_row(session, r)
            toks = [int(t) for t in toks]
            self._check_ids(toks, f"token id appended to row {r}:")
            if len(session.sequences[r]) + len(toks) > self.cache_size:
                raise SamplerError(f"row {r} has {len(session.sequences[r])} tokens; appending {len(toks)} exceeds "
                                   f"cache_size={self.cache_size}; raise Sampler(cache_size=...) or truncate")
            session.sequences[r].extend(toks)

    def _check_row(self, session: Session, r: int) -> None:
        if not 0 <= r < session.num_rows:
            raise SamplerError(f"row {r} is not in this session of {session.num_rows} rows")

    def _ensure_cache(self, session: Session, need: int) -> None:
        """Allocates or grows the session's cache to at least `need` slots per row (bucketed)."""
        # Bucketed, but never more than a multiple of 64 past what the logical cap can need (the
        # cap plus the finished-row scratch slot, or a padded chunk written near the cap).
        size = min(_bucket(need, self.cache_buckets, 128), -(-max(need, self.cache_size + 1) // 64) * 64)
        if session.cache is None:
            padded = max(self._min_rows, -(-session.num_rows // self._batch_multiple()) * self._batch_multiple())
            session.cache = self._new_cache(padded, size)
        elif session.cache.size < need:
            session.cache = self._call(_grow, session.cache, new_size=size,
                                       kv_slot_axis=_NK_SLOT_AXIS if self._impl.kind == "nk" else 1)

    def generate_from(self, session: Session, max_new_tokens: int, *, rows: Sequence[int] | None = None,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                      stop_strings: Sequence[str] = (), eos_ids: Sequence[int] | None = None) -> SampleOutput:
        """Writes each selected row's pending tokens, then generates; other rows are left as they are.

        Returns one entry per row of `rows` (default: all rows), in that order.
        """
        rows = list(range(session.num_rows)) if rows is None else [int(r) for r in rows]
        if not rows:
            raise SamplerError("rows is empty; pass at least one row to generate for")
        for r in rows:
            self._check_row(session, r)
        if len(set(rows)) != len(rows):
            raise SamplerError(f"rows {rows} has duplicates")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise SamplerError(f"max_new_tokens={max_new_tokens} must be a positive int")
        if not temperature >= 0:
            raise SamplerError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        if not 0 < top_p <= 1:
            raise SamplerError(f"top_p={top_p} must be in (0, 1]")
        if top_k < 0 or top_k > self.vocab_size:
            raise SamplerError(f"top_k={top_k} must be in [0, {self.vocab_size}] (0 = off)")
        eos = tuple(self.eos_ids if eos_ids is None else eos_ids)
        self._check_ids(eos, "eos id")
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(stop_strings)
        tables = self._stop_table(stop_strings) if stop_strings else None

        n = session.num_rows
        lengths = np.array(session.lengths(), np.int64)
        room = self.cache_size - lengths
        sel = np.zeros(n, bool)
        sel[rows] = True
        feed = sel & (room > 0)  # rows at the cache limit generate nothing ("cache_full")
        limit = np.where(feed, np.minimum(max_new_tokens, room), 0)
        limit_reason = np.where(room <= max_new_tokens, _CACHE_FULL, _LENGTH)
        pending = np.where(feed, lengths - session.cached, 0)
        if feed.any() and (pending[feed] < 1).any():
            bad = int(np.flatnonzero(feed & (pending < 1))[0])
            raise SamplerError(f"row {bad} has no pending token to continue from")

        # Physical cache: every row writes `chunk` slots from its end during a prefill chunk, and
        # finished rows write one scratch slot at their end while others decode.
        chunk = min(self.prefill_chunk, _bucket(int(pending.max(initial=1)), self.buckets, 16))
        final_end = np.where(feed, lengths + limit - 1, lengths)
        need = int(max((session.cached + chunk).max(), final_end.max() + 1))
        self._ensure_cache(session, need)
        cache = session.cache
        bp = cache.end.shape[0]

        logits = self._put_batch(np.zeros((bp, self.vocab_size), np.float32))
        cached = session.cached.copy()
        while True:
            left = np.where(feed, lengths - cached, 0)
            if not left.any():
                break
            t = min(self.prefill_chunk, _bucket(int(left.max()), self.buckets, 16))
            counts = np.minimum(left, t)
            toks = np.zeros((bp, t), np.int32)
            for b in np.flatnonzero(counts):
                toks[b, :counts[b]] = session.sequences[b][cached[b]:cached[b] + counts[b]]
            cnt = np.zeros(bp, np.int32)
            cnt[:n] = counts
            logits, cache = self._call(_extend, self._impl, self._weights, cache, logits,
                                       self._put_batch(toks), self._put_batch(cnt))
            cached = cached + counts

        buf_len = _bucket(int(limit.max()), None, 16)
        lim = np.zeros(bp, np.int32)
        lim[:n] = limit
        lreason = np.full(bp, _LENGTH, np.int32)
        lreason[:n] = limit_reason
        greedy = temperature == 0
        toks, lps, n_gen, reason, cache = self._call(
            _decode, self._impl, self._weights, cache, logits, self._put_batch(lim), self._put_batch(lreason),
            self._replicated(jnp.asarray(eos if eos else (-1,), jnp.int32)), tables,
            jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p), jnp.int32(top_k),
            self._replicated(jax.random.PRNGKey(seed)), buf_len=buf_len, greedy=greedy,
            top_k_bucket=0 if greedy or not top_k else min(self.vocab_size, _pow2_at_least(top_k, 8)),
            use_top_p=(not greedy) and top_p < 1.0)
        session.cache = cache
        toks, lps, n_gen, reason = (np.asarray(jax.device_get(x)) for x in (toks, lps, n_gen, reason))

        out_t, out_l, out_r = [], [], []
        for r in rows:
            k = int(n_gen[r])
            gen = toks[r, :k].tolist()
            session.sequences[r].extend(gen)
            if k:
                cached[r] = lengths[r] + k - 1  # the last generated token is pending
            out_t.append(gen)
            out_l.append(lps[r, :k].astype(np.float32))
            out_r.append(FINISH_REASONS[int(reason[r])])
        session.cached = cached
        return SampleOutput(tokens=out_t, logprobs=out_l, finish_reason=out_r)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_strings: Sequence[str] = (),
                 eos_ids: Sequence[int] | None = None) -> SampleOutput:
        """Generates up to `max_new_tokens` for each prompt (token-id lists of any lengths)."""
        session = self.start(prompts)
        return self.generate_from(session, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed, stop_strings=stop_strings, eos_ids=eos_ids)

    # ------------------------------------------------------------------ text helpers

    def encode_chat(self, item: str | Sequence[dict[str, str]]) -> list[int]:
        """A user message (str) or a list of chat messages -> prompt ids with the chat template applied."""
        if self.tokenizer is None:
            raise SamplerError("text helpers need a tokenizer: pass tokenizer= to Sampler")
        return tokenizer_lib.chat_ids(self.tokenizer, item)

    def decode(self, tokens: Sequence[int], finish_reason: str = "length",
               stop_strings: Sequence[str] = (), eos_ids: Sequence[int] | None = None) -> str:
        """Generated ids -> text: a final EOS token is dropped; with a stop, text ends right after the string."""
        eos = set(self.eos_ids if eos_ids is None else eos_ids)
        tokens = list(tokens)
        if finish_reason == "eos" and tokens and tokens[-1] in eos:
            tokens = tokens[:-1]
        tb = self.token_bytes()
        raw = b"".join(tb[t] for t in tokens)
        if finish_reason == "stop":
            ends = [raw.find(s.encode()) + len(s.encode()) for s in stop_strings if raw.find(s.encode()) >= 0]
            if ends:
                raw = raw[:min(ends)]
        return raw.decode("utf-8", errors="replace")

    def generate_text(self, items: Sequence[str | Sequence[dict[str, str]]], max_new_tokens: int,
                      **kw: Any) -> list[tuple[str, str]]:
        """Chat-templated generation: each item is a user message or a message list -> (text, finish_reason)."""
        if isinstance(items, str):
            raise SamplerError("generate_text takes a list of messages or texts, not a single str")
        out = self.generate([self.encode_chat(x) for x in items], max_new_tokens, **kw)
        stops = kw.get("stop_strings", ())
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        return [(self.decode(t, r, stops, kw.get("eos_ids")), r) for t, r in zip(out.tokens, out.finish_reason)]


def load_sampler(checkpoint_dir: str, *, dtype: Any = jnp.float32, mesh: jax.sharding.Mesh | None = None,
                 **kw: Any) -> Sampler:
    """Loads an HF checkpoint directory (weights + tokenizer) into a Sampler."""
    import transformers

    from workflow_r1.model import checkpoint

    model = checkpoint.load(checkpoint_dir, mesh=mesh, dtype=dtype, param_dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir))
    return Sampler(model, tokenizer, mesh=mesh, **kw)


def make_generate_fn(checkpoint_dir: str, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: int = 0, stop_strings: Sequence[str] = (), **kw: Any):
    """`generate_fn(prompts: list[str], max_tokens: int) -> list[(text, finish_reason)]` for the executor.

    Each prompt becomes a single user message with the chat template applied. Extra keywords go to
    `load_sampler` / `Sampler` (dtype, cache_size, mesh, ...).
    """
    sampler = load_sampler(checkpoint_dir, **kw)

    def generate_fn(prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
        if not prompts:
            return []
        return sampler.generate_text(list(prompts), max_tokens, temperature=temperature, top_p=top_p,
                                     top_k=top_k, seed=seed, stop_strings=stop_strings)

    generate_fn.sampler = sampler
    return generate_fn


__all__ = ["Sampler", "Session", "SampleOutput", "SamplerError", "FINISH_REASONS", "make_generate_fn",
           "load_sampler", "stop_tables", "vocab_bytes"]
