"""Per-token log-probabilities and entropies of a sequence under the policy, without [B, T, V] logits.

Shapes: B rows, T positions, D hidden size, V vocabulary, C chunk length (positions per chunk),
M = B x C rows of one chunk, K the number of positions actually scored per row (see below).

The log-prob of token t is predicted from position t - 1 (causal LM shift):

    logp[b, t] = log softmax(h[b, t - 1] @ W)[tokens[b, t]]   for t >= 1,   logp[b, 0] = 0,

and likewise entropy[b, t] = H(softmax(h[b, t - 1] @ W)). Position 0 has no prediction, so it gets 0;
the loss mask is 0 there anyway (a row never starts with a policy token). In a packed row
(`segment_ids`, several sequences per row) the same holds at every sequence's first token: it is
never predicted from the previous sequence's last one (logp = entropy = 0 there).

Only scored positions are computed. With a `score_mask` (the loss mask: the policy's own tokens),
each row's scored positions are gathered to the front (a stable sort), and the output head runs on
the first K of them, where K is the smallest of four static sizes (T/4, T/2, 3T/4, T, picked at run
time by `lax.switch`) that holds every row's count. Prompts and observations, often most of a
multi-turn trajectory, then cost nothing in the [*, D] x [D, V] matmuls that dominate a small model.

Memory. The logits of a 0.5B Qwen (V = 151,936) for B x T = 8 x 8192 tokens would take 40 GB in
fp32. When they do not fit in `unchunked_max_bytes`, the K positions are scanned in chunks of C:
each step forms [B, C, V] logits, reduces them to (target logit, logsumexp, entropy) and drops them;
the backward pass recomputes a chunk's logits from its hidden states (a custom VJP keeps only the
hidden states, the logsumexp and the entropy per chunk), one extra [M, D] x [D, V] matmul. When
they fit, the logits are kept for the backward pass instead (no recomputation).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1 import sharding

Array = jax.Array

# Static sizes (fractions of T) among which the number of scored positions per row is rounded up.
_BUCKETS = 4


def _vocab_sharded() -> bool:
    """True when the active mesh splits the vocabulary dimension (tensor parallelism)."""
    mesh = sharding.current_mesh()
    if mesh is None:
        return False
    rule = sharding.LOGICAL_RULES.get("vocab")
    axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    return any(mesh.shape.get(a, 1) > 1 for a in axes)


def _logits(h: Array, w: Array) -> Array:
    """h [M, D] x w [D, V] -> fp32 logits [M, V] (fp32 accumulation whatever the compute dtype)."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32)
    return sharding.constrain(z, ("batch", "vocab"))


def _target_logit(z: Array, targets: Array) -> Array:
    """z [M, V], targets [M] -> z[m, targets[m]]."""
    if _vocab_sharded():
        # A one-hot compare stays local when the vocabulary is split over devices; a gather would
        # need the whole row on one device.
        ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        return jnp.sum(jnp.where(ids == targets[:, None], z, 0.0), axis=1)
    return jnp.take_along_axis(z, targets[:, None], axis=1)[:, 0]


def _head_forward(h: Array, wc: Array, targets: Array) -> tuple[Array, Array, Array, Array]:
    """h [M, D], wc [D, V] (compute dtype), targets [M] -> (logp, entropy, lse [M], fp32 logits [M, V])."""
    z = _logits(h, wc)
    # The row max, then Σ e and Σ e·z with e = exp(z - m): lse = m + log Σ e and
    # H = -Σ p log p = lse - Σ e·z / Σ e (logsumexp then a separate entropy pass read the logits
    # three times: 0.20 vs 0.14 s at M = 768, V = 151,936). Σ e·z rather than Σ e·(z - m): XLA:CPU
    # wrote z - m out as one more [M, V] array (33-57 ms). The cancellation in lse - Σ e·z / Σ e is
    # small: the two forms differed by at most 4e-6 over 768 rows of 151,936 logits with std 3.
    m = jnp.max(z, axis=1, keepdims=True)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=1)
    lse = m[:, 0] + jnp.log(s)
    ent = lse - jnp.sum(e * z, axis=1) / s
    return _target_logit(z, targets) - lse, ent, lse, z


def _head_backward(h: Array, wc: Array, targets: Array, lse: Array, ent: Array, z: Array | None,
                   g_logp: Array, g_ent: Array | None) -> tuple[Array, Array]:
    """Gradients of the head for cotangents g_logp (and g_ent, None: no entropy gradient) [M]:
    (dh [M, D] in h's dtype, dw [D, V] fp32). z: the forward's logits, or None to recompute them."""
    if z is None:
        z = _logits(h, wc)
    p = jnp.exp(z - lse[:, None])
    ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    # d logp / dz = onehot(target) - p
    dz = jnp.where(ids == targets[:, None], g_logp[:, None], 0.0) - g_logp[:, None] * p
    if g_ent is not None:
        # d H / dz_j = -p_j (z_j - lse + H)
        dz = dz - g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
    dz = sharding.constrain(dz, ("batch", "vocab")).astype(h.dtype)
    dh = jnp.einsum("mv,dv->md", dz, wc, preferred_element_type=jnp.float32).astype(h.dtype)
    if h.dtype == jnp.float32:
        return dh, jnp.einsum("md,mv->dv", h, dz, preferred_element_type=jnp.float32)
    # XLA:CPU has no low-precision kernel for a 2-D product contracting both operands' leading
    # axis: it converts h and the [M, V] dz to fp32 and runs an fp32 GEMM (0.86 s vs 0.40 s at
    # M = 768, a seventh of a 4 x 256 bf16 step). A unit batch axis makes XLA contract (1, M)
    # through a reshape, materialising the small [D, M] transpose of h, and the product stays
    # bf16 x bf16 -> fp32 (tests/test_mixed_precision.py checks the compiled HLO).
    return dh, jnp.einsum("bmd,bmv->dv", h[None], dz[None], preferred_element_type=jnp.float32)


def _chunks(x: Array, chunk: int) -> Array:
    """[B, K, ...] -> [n, B, C, ...] with K zero-padded to n * C (the batch keeps its sharding)."""
    b, k = x.shape[:2]
    n = -(-k // chunk)
    x = jnp.pad(x, ((0, 0), (0, n * chunk - k)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)


def _unchunk(x: Array, k: int) -> Array:
    """[n, B, C, ...] -> [B, K, ...] (inverse of `_chunks`)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], -1) + x.shape[3:])[:, :k]


def _bucket_forward(h: Array, wc: Array, targets: Array, chunk: int | None) -> tuple[Array, ...]:
    """h [B, K, D], targets [B, K] -> (logp, entropy, lse) [B, K] and the logits [B*K, V] (chunk
    None: kept for the backward pass) or None (scanned in chunks of `chunk` positions, dropped)."""
    b, k, d = h.shape
    if chunk is None:
        lp, ent, lse, z = _head_forward(h.reshape(b * k, d), wc, targets.reshape(b * k))
        return lp.reshape(b, k), ent.reshape(b, k), lse.reshape(b, k), z

    def body(carry: None, xs: tuple[Array, Array]) -> tuple[None, tuple[Array, Array, Array]]:
        hc, tc = xs
        hc = sharding.constrain(hc, ("batch", "length", "embed"))
        lp, ent, lse, _ = _head_forward(hc.reshape(b * chunk, d), wc, tc.reshape(b * chunk))
        return carry, tuple(x.reshape(b, chunk) for x in (lp, ent, lse))

    # Padded positions score token 0 from a zero hidden state; they are sliced off.
    _, outs = jax.lax.scan(body, None, (_chunks(h, chunk), _chunks(targets, chunk)))
    return tuple(_unchunk(x, k) for x in outs) + (None,)


def _bucket_backward(h: Array, wc: Array, targets: Array, lse: Array, ent: Array, z: Array | None,
                     g_logp: Array, g_ent: Array | None, chunk: int | None) -> tuple[Array, Array]:
    """The gradients of `_bucket_forward`: (dh [B, K, D], dw [D, V] fp32, summed over chunks)."""
    b, k, d = h.shape
    if chunk is None:
        flat = lambda x: None if x is None else x.reshape(b * k)  # noqa: E731
        dh, dw = _head_backward(h.reshape(b * k, d), wc, flat(targets), flat(lse), flat(ent), z,
                                flat(g_logp), flat(g_ent))
        return dh.reshape(b, k, d), dw

    def body(dw: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        hc, tc, lc, ec, gl, ge = xs
        hc = sharding.constrain(hc, ("batch", "length", "embed"))
        m = b * chunk
        dh, dwc = _head_backward(hc.reshape(m, d), wc, tc.reshape(m), lc.reshape(m), ec.reshape(m), None,
                                 gl.reshape(m), None if g_ent is None else ge.reshape(m))
        return dw + dwc, dh.reshape(b, chunk, d)

    # Padded positions get a zero cotangent, so they add nothing to dw.
    xs = tuple(_chunks(x, chunk) for x in (h, targets, lse, ent, g_logp, g_logp if g_ent is None else g_ent))
    dw, dh = jax.lax.scan(body, jnp.zeros(wc.shape, jnp.float32), xs)
    return _unchunk(dh, k), dw


@functools.cache
def _bucketed_head(sizes: tuple[int, ...], chunks: tuple[int | None, ...], entropy_grad: bool):
    """The output head over sorted positions, as a custom-VJP function
    (h [B, N, D], w, wc [D, V], targets [B, N], index) -> (logp, entropy) [B, N].

    Runs on the first sizes[index] positions only (the rest come out 0); chunks[i] is bucket i's
    chunk length, None to keep its logits for the backward pass. w is the projection as a
    parameter (any dtype), wc the same values in the compute dtype, cast once by the caller; the
    products use wc, and the gradient goes to w accumulated in fp32 (an fp32 master weight's
    gradient is never rounded to bf16). One residual buffer of logits serves every bucket: under a
    differentiated `lax.switch`, JAX would keep each branch's own and zero-fill the untaken ones'
    (1.1 GB allocated and zeroed per step at 4 x 256 on the 0.5B).
    """
    stored = [k for k, c in zip(sizes, chunks) if c is None]
    rows = max(stored, default=0)  # logits rows per sequence that the residual buffer holds

    def forward(h, w, wc, targets, index):
        b, n, _ = h.shape

        def branch(k: int, chunk: int | None):
            def f(h, wc, targets):
                lp, ent, lse, z = _bucket_forward(h[:, :k], wc, targets[:, :k], chunk)
                pad = lambda x: jnp.pad(x, ((0, 0), (0, n - k)))  # noqa: E731
                if not rows:
                    return pad(lp), pad(ent), pad(lse), None
                if z is None:  # this bucket keeps no logits: the buffer is not read
                    z = jnp.zeros((b * rows, wc.shape[1]), jnp.float32)
                else:
                    z = jnp.pad(z.reshape(b, k, -1), ((0, 0), (0, rows - k), (0, 0))).reshape(b * rows, -1)
                return pad(lp), pad(ent), pad(lse), z
            return f

        lp, ent, lse, z = jax.lax.switch(index, [branch(k, c) for k, c in zip(sizes, chunks)], h, wc, targets)
        return (lp, ent), (h, w, wc, targets, index, lse, ent, z)

    def backward(res, g):
        h, w, wc, targets, index, lse, ent, z = res
        g_logp, g_ent = g
        b, n, d = h.shape

        def branch(k: int, chunk: int | None):
            def f(h, wc, targets, lse, ent, z, g_logp, g_ent):
                zk = None if chunk is not None else z.reshape(b, rows, -1)[:, :k].reshape(b * k, -1)
                dh, dw = _bucket_backward(h[:, :k], wc, targets[:, :k], lse[:, :k], ent[:, :k], zk,
                                          g_logp[:, :k], g_ent[:, :k] if entropy_grad else None, chunk)
                return jnp.pad(dh, ((0, 0), (0, n - k), (0, 0))), dw
            return f

        dh, dw = jax.lax.switch(index, [branch(k, c) for k, c in zip(sizes, chunks)],
                                h, wc, targets, lse, ent, z, g_logp, g_ent)
        return dh, dw.astype(w.dtype), None, None, None  # accumulated in fp32, in the parameter's dtype

    @jax.custom_vjp
    def head(h, w, wc, targets, index):
        return forward(h, w, wc, targets, index)[0]

    head.defvjp(forward, backward)
    return head


def logprobs_from_hidden(h: Array, w: Array, tokens: Array, *, score_mask: Array | None = None,
                         segment_ids: Array | None = None, chunk_size: int | None = 256, unchunked_max_bytes: int = 0, with_entropy: bool = True,
                         entropy_grad: bool = False, compute_dtype: Any = None) -> tuple[Array, Array]:
    """Shifted per-token log-probs and entropies from final hidden states.

    Args:
      h: [B, T, D] final-normed hidden states (any float dtype; matmuls accumulate in fp32).
      w: [D, V] output projection (`model.unembed()`), any dtype; its gradient comes back in that
        dtype, accumulated in fp32.
      tokens: [B, T] int token ids; tokens[:, t] is scored with the prediction made at t - 1.
      score_mask: [B, T], 1 where logp[:, t] is wanted (e.g. the loss mask). Other positions get 0
        and are not computed at all. None: every position t >= 1.
      segment_ids: [B, T] int of a packed row (0 = padding), or None (one sequence per row).
        Position t is scored only when it continues the segment of t - 1 (a segment's first token
        and padding get 0, whatever score_mask says).
      chunk_size: positions per chunk (C) when chunking; None: never chunk.
      unchunked_max_bytes: do not chunk when the fp32 logits of all computed positions take at most
        this many bytes; keep them for the backward pass instead of recomputing (0: always chunk).
      with_entropy: False returns zeros for the entropy (it is computed in the same pass anyway).
      entropy_grad: let gradients flow through the entropy (only an entropy bonus needs it);
        otherwise its cotangent is ignored.
      compute_dtype: dtype of the head's matmul operands, h and w cast to it (default: h's dtype).

    Returns:
      (logp [B, T] fp32, entropy [B, T] fp32), 0 at position 0 and at unscored positions.
    """
    b, t, d = h.shape
    if tokens.shape != (b, t):
        raise ValueError(f"tokens must be [B, T]=({b}, {t}) like h, got {tokens.shape}")
    if score_mask is not None and score_mask.shape != (b, t):
        raise ValueError(f"score_mask must be [B, T]=({b}, {t}), got {score_mask.shape}")
    if segment_ids is not None:
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids must be [B, T]=({b}, {t}), got {segment_ids.shape}")
        # The causal shift stops at segment starts: t is predicted from t - 1 of the same sequence only.
        same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
        same = jnp.pad(same, ((0, 0), (1, 0)))
        score_mask = same if score_mask is None else same & score_mask.astype(bool)
    n = t - 1  # positions that predict a next token
    zero = jnp.zeros((b, 1), jnp.float32)
    if n <= 0:
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.float32)
    v = w.shape[-1]
    if compute_dtype is not None:
        h = h.astype(compute_dtype)
    wc = w.astype(h.dtype)  # once, outside any chunk loop
    h_in = h[:, :-1]
    targets = tokens[:, 1:].astype(jnp.int32)

    def chunk_of(k: int) -> int | None:
        """Bucket k's chunk length, None to keep all its logits (they fit `unchunked_max_bytes`)."""
        return None if chunk_size is None or 4 * b * k * v <= unchunked_max_bytes else min(chunk_size, k)

    if score_mask is None:
        head = _bucketed_head((n,), (chunk_of(n),), entropy_grad)
        logp, ent = head(h_in, w, wc, targets, jnp.zeros((), jnp.int32))
    else:
        scored = score_mask[:, 1:].astype(bool)
        # Scored positions first, in order (stable), so that the first K cover every scored one.
        order = jnp.argsort(~scored, axis=1, stable=True)
        h_sorted = jnp.take_along_axis(h_in, order[..., None], axis=1)
        t_sorted = jnp.take_along_axis(targets, order, axis=1)
        sizes = tuple(sorted({min(n, 8 * math.ceil(n * (i + 1) / _BUCKETS / 8)) for i in range(_BUCKETS)}))
        need = jnp.max(jnp.sum(scored, axis=1))
        index = jnp.sum(jnp.asarray(sizes) < need)  # smallest size >= need
        head = _bucketed_head(sizes, tuple(chunk_of(k) for k in sizes), entropy_grad)
        lp_sorted, ent_sorted = head(h_sorted, w, wc, t_sorted, index)
        inverse = jnp.argsort(order, axis=1)
        logp = jnp.where(scored, jnp.take_along_axis(lp_sorted, inverse, axis=1), 0.0)
        ent = jnp.where(scored, jnp.take_along_axis(ent_sorted, inverse, axis=1), 0.0)
    if not with_entropy:
        ent = jnp.zeros_like(ent)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def token_logprobs(model: Any, tokens: Array, positions: Array, input_mask: Array | None = None, *,
                   score_mask: Array | None = None, segment_ids: Array | None = None, chunk_size: int | None = 256, unchunked_max_bytes: int = 0,
                   with_entropy: bool = True, entropy_grad: bool = False,
                   temperature: float = 1.0) -> tuple[Array, Array]:
    """Runs the model and scores the tokens: (logp [B, T], entropy [B, T]), fp32, 0 at position 0.

    Args:
      model: a `qwen2.Qwen2` (anything with `hidden_states(tokens, positions, input_mask=...)`,
        `unembed()` and `dtype`).
      tokens, positions: [B, T] int. input_mask: [B, T] (1 = real token) or None (all real; right
        padding needs no mask, since causal attention never lets a pad token reach an earlier one).
      score_mask, chunk_size, unchunked_max_bytes, with_entropy, entropy_grad: see
        `logprobs_from_hidden`.
      segment_ids: [B, T] int, packed rows (0 = padding): attention stays within each segment
        (the model's `segment_ids`) and no segment's first token is scored; None: one sequence per row.
      temperature: score under softmax(logits / temperature), the distribution the rollouts were
        sampled from (the sampler returns log-probs at its sampling temperature too). Applied to
        the fp32 output projection, so it costs nothing per token.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts are scored at 1.0)")
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}
    h, _ = model.hidden_states(tokens, positions, input_mask=input_mask, **packed)
    w = model.unembed()
    w = w if temperature == 1.0 else w.astype(jnp.float32) / temperature
    return logprobs_from_hidden(h, w, tokens, score_mask=score_mask, segment_ids=segment_ids, chunk_size=chunk_size,
                                unchunked_max_bytes=unchunked_max_bytes, with_entropy=with_entropy,
                                entropy_grad=entropy_grad, compute_dtype=model.dtype)


__all__ = ["logprobs_from_hidden", "token_logprobs"]
