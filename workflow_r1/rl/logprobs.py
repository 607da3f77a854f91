"""Per-token log-probabilities and entropies of a sequence under the policy, without [B, T, V] logits.

Shapes: B rows, T positions, D hidden size, V vocabulary, C chunk length (positions per chunk),
M = B x C rows of one chunk, K the number of positions actually scored per row (see below).

The log-prob of token t is predicted from position t - 1 (causal LM shift):

    logp[b, t] = log softmax(h[b, t - 1] @ W)[tokens[b, t]]   for t >= 1,   logp[b, 0] = 0,

and likewise entropy[b, t] = H(softmax(h[b, t - 1] @ W)). Position 0 has no prediction, so it gets 0;
the loss mask is 0 there anyway (a row never starts with a policy token).

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


@functools.cache
def _head(store_logits: bool, entropy_grad: bool):
    """The output head as a custom-VJP function (h [M, D], w, wc [D, V], targets [M]) -> (logp, entropy) [M].

    w is the projection as a parameter (any dtype) and wc the same values in the compute dtype,
    cast once by the caller (not once per chunk). The products use wc; the gradient goes to w in
    w's dtype, accumulated in fp32 (an fp32 master weight's gradient is never rounded to bf16).
    store_logits: keep the fp32 logits for the backward pass (else recompute them from h and wc).
    entropy_grad: propagate the entropy's cotangent (only an entropy bonus needs it).
    """

    def forward(h: Array, w: Array, wc: Array, targets: Array) -> tuple[tuple[Array, Array], tuple[Any, ...]]:
        del w
        z = _logits(h, wc)
        # Two passes over the [M, V] logits: the row max, then Σ e and Σ e·(z - m) together, with
        # e = exp(z - m). lse = m + log Σ e and H = -Σ p log p = log Σ e - Σ e·(z - m) / Σ e
        # (logsumexp then a separate entropy pass read the logits three times: 0.20 vs 0.14 s at
        # M = 768, V = 151,936).
        m = jnp.max(z, axis=1, keepdims=True)
        e = jnp.exp(z - m)
        s = jnp.sum(e, axis=1)
        log_s = jnp.log(s)
        lse = m[:, 0] + log_s
        ent = log_s - jnp.sum(e * (z - m), axis=1) / s
        logp = _target_logit(z, targets) - lse
        return (logp, ent), (h, wc, targets, lse, ent, z if store_logits else None)

    def backward(res: tuple[Any, ...], g: tuple[Array, Array]) -> tuple[Array, Array, None, None]:
        h, w, targets, lse, ent, z = res  # w: the compute-dtype copy
        g_logp, g_ent = g
        if z is None:
            z = _logits(h, w)
        p = jnp.exp(z - lse[:, None])
        ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        # d logp / dz = onehot(target) - p
        dz = jnp.where(ids == targets[:, None], g_logp[:, None], 0.0) - g_logp[:, None] * p
        if entropy_grad:
            # d H / dz_j = -p_j (z_j - lse + H)
            dz = dz - g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
        dz = sharding.constrain(dz, ("batch", "vocab")).astype(h.dtype)
        dh = jnp.einsum("mv,dv->md", dz, w, preferred_element_type=jnp.float32).astype(h.dtype)
        if h.dtype == jnp.float32:
            dw = jnp.einsum("md,mv->dv", h, dz, preferred_element_type=jnp.float32)
        else:
            # XLA:CPU has no low-precision kernel for a 2-D product contracting both operands'
            # leading axis: it converts h and the [M, V] dz to fp32 and runs an fp32 GEMM (0.86 s
            # vs 0.40 s at M = 768, a seventh of a 4 x 256 bf16 step). A unit batch axis makes XLA
            # contract (1, M) through a reshape, materialising the small [D, M] transpose of h, and
            # the product stays bf16 x bf16 -> fp32 (tests/test_logprobs.py checks the compiled HLO).
            dw = jnp.einsum("bmd,bmv->dv", h[None], dz[None], preferred_element_type=jnp.float32)
        return dh, dw, None, None  # dw fp32: cast to the parameter's dtype by JAX

    @jax.custom_vjp
    def head(h: Array, w: Array, wc: Array, targets: Array) -> tuple[Array, Array]:
        return forward(h, w, wc, targets)[0]

    head.defvjp(forward, backward)
    return head


def _score(h: Array, w: Array, wc: Array, targets: Array, chunk: int | None, store_logits: bool,
           entropy_grad: bool) -> tuple[Array, Array]:
    """h [B, K, D], targets [B, K] -> (logp, entropy) [B, K], in chunks of `chunk` positions (w, wc: `_head`)."""
    b, k, d = h.shape
    head = _head(store_logits, entropy_grad)
    if chunk is None or chunk >= k:
        lp, ent = head(h.reshape(b * k, d), w, wc, targets.reshape(b * k))
        return lp.reshape(b, k), ent.reshape(b, k)
    n = -(-k // chunk)
    pad = n * chunk - k
    # Padded positions score token 0 from a zero hidden state; they are sliced off below.
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [B, n*C, ...] -> [n, B, C, ...]: the batch dimension keeps its (data, fsdp) sharding.
    hs = jnp.moveaxis(h.reshape(b, n, chunk, d), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, n, chunk), 1, 0)

    def body(carry: None, xs: tuple[Array, Array]) -> tuple[None, tuple[Array, Array]]:
        hc, tc = xs
        hc = sharding.constrain(hc, ("batch", "length", "embed"))
        lp, ent = head(hc.reshape(b * chunk, d), w, wc, tc.reshape(b * chunk))
        return carry, (lp.reshape(b, chunk), ent.reshape(b, chunk))

    _, (lp, ent) = jax.lax.scan(body, None, (hs, ts))
    lp = jnp.moveaxis(lp, 0, 1).reshape(b, n * chunk)[:, :k]
    ent = jnp.moveaxis(ent, 0, 1).reshape(b, n * chunk)[:, :k]
    return lp, ent


def logprobs_from_hidden(h: Array, w: Array, tokens: Array, *, score_mask: Array | None = None,
                         chunk_size: int | None = 256, unchunked_max_bytes: int = 0, with_entropy: bool = True,
                         entropy_grad: bool = False, compute_dtype: Any = None) -> tuple[Array, Array]:
    """Shifted per-token log-probs and entropies from final hidden states.

    Args:
      h: [B, T, D] final-normed hidden states (any float dtype; matmuls accumulate in fp32).
      w: [D, V] output projection (`model.unembed()`), any dtype; its gradient comes back in that
        dtype, accumulated in fp32.
      tokens: [B, T] int token ids; tokens[:, t] is scored with the prediction made at t - 1.
      score_mask: [B, T], 1 where logp[:, t] is wanted (e.g. the loss mask). Other positions get 0
        and are not computed at all. None: every position t >= 1.
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

    def run(h_k: Array, t_k: Array) -> tuple[Array, Array]:
        k = h_k.shape[1]
        store = chunk_size is None or 4 * b * k * v <= unchunked_max_bytes
        return _score(h_k, w, wc, t_k, None if store else chunk_size, store, entropy_grad)

    if score_mask is None:
        logp, ent = run(h_in, targets)
    else:
        scored = score_mask[:, 1:].astype(bool)
        # Scored positions first, in order (stable), so that the first K cover every scored one.
        order = jnp.argsort(~scored, axis=1, stable=True)
        h_sorted = jnp.take_along_axis(h_in, order[..., None], axis=1)
        t_sorted = jnp.take_along_axis(targets, order, axis=1)
        sizes = sorted({min(n, 8 * math.ceil(n * (i + 1) / _BUCKETS / 8)) for i in range(_BUCKETS)})
        need = jnp.max(jnp.sum(scored, axis=1))

        def branch(k: int):
            def f(hs: Array, ts: Array) -> tuple[Array, Array]:
                lp, en = run(hs[:, :k], ts[:, :k])
                return jnp.pad(lp, ((0, 0), (0, n - k))), jnp.pad(en, ((0, 0), (0, n - k)))
            return f

        index = jnp.sum(jnp.asarray(sizes) < need)  # smallest size >= need
        lp_sorted, ent_sorted = jax.lax.switch(index, [branch(k) for k in sizes], h_sorted, t_sorted)
        inverse = jnp.argsort(order, axis=1)
        logp = jnp.where(scored, jnp.take_along_axis(lp_sorted, inverse, axis=1), 0.0)
        ent = jnp.where(scored, jnp.take_along_axis(ent_sorted, inverse, axis=1), 0.0)
    if not with_entropy:
        ent = jnp.zeros_like(ent)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def token_logprobs(model: Any, tokens: Array, positions: Array, input_mask: Array | None = None, *,
                   score_mask: Array | None = None, chunk_size: int | None = 256, unchunked_max_bytes: int = 0,
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
      temperature: score under softmax(logits / temperature), the distribution the rollouts were
        sampled from (the sampler returns log-probs at its sampling temperature too). Applied to
        the fp32 output projection, so it costs nothing per token.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts are scored at 1.0)")
    h, _ = model.hidden_states(tokens, positions, input_mask=input_mask)
    w = model.unembed()
    w = w if temperature == 1.0 else w.astype(jnp.float32) / temperature
    return logprobs_from_hidden(h, w, tokens, score_mask=score_mask, chunk_size=chunk_size,
                                unchunked_max_bytes=unchunked_max_bytes, with_entropy=with_entropy,
                                entropy_grad=entropy_grad, compute_dtype=model.dtype)


__all__ = ["logprobs_from_hidden", "token_logprobs"]
