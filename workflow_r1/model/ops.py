"""The decoder's pure functions: RMSNorm, rotary embeddings (with a one-pass backward), per-row
cache writes, the slot-order attention mask (segment-aware for packed rows) and blocked grouped-query
attention. `qwen2.py` builds the modules from them; the fused CPU sampler calls them directly.

Shapes: B batch, T new tokens, S cache slots (or T without a cache), K kv heads, G query heads per kv
head, Dh head dim, D hidden.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1.model import mixed, splash

Array = jax.Array


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """RMSNorm of x [..., D] with scale [D], in x's dtype.

    As HF: normalise in fp32, cast back to x's dtype, then scale (cast to x's dtype too).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return mixed.mul(xf.astype(x.dtype), scale)


def rope(x: Array, positions: Array, theta: float) -> Array:
    """Rotates x [B, T, N, Dh] by positions [B, T] with the half-split (rotate_half) convention."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    return _rotate(x, cos, sin)


@jax.custom_vjp
def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """x [..., Dh] rotated pairwise (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of Dh."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# The transpose of a rotation is the rotation by the opposite angle: one elementwise pass like the
# forward. Autodiff's own transpose (two padded halves summed) compiled on XLA:CPU, in bf16, to a
# fusion 16x slower than the forward (7 ms per layer at 4 x 256, 0.19 s of the step).
def _rotate_fwd(x: Array, cos: Array, sin: Array) -> tuple[Array, tuple[Array, Array]]:
    return _rotate(x, cos, sin), (cos, sin)


def _rotate_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array, Array]:
    cos, sin = res
    return _rotate(g, cos, -sin), jnp.zeros_like(cos), jnp.zeros_like(sin)  # angles: constants


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def write_rows(buf: Array, new: Array, start: Array, axis: int = 1) -> Array:
    """buf [B, ..., S, ...] <- new [B, ..., T, ...] at per-row slot start [B] along slot `axis`.

    Every other axis of `new` matches `buf`. The model's cache and masks use slot axis 1
    ([B, S, K, Dh], [B, S]); the sampler's CPU cache uses axis 3 for keys [B, K, Dh, S], 2 for values.
    """
    def one(b, n, s):
        return jax.lax.dynamic_update_slice(b, n, tuple(s if i == axis - 1 else 0 for i in range(b.ndim)))
    return jax.vmap(one)(buf, new, start)


# Integer key ids at multiples of this are shared prefixes (`attention_mask`); a segment id is
# below it, so a row holds at most PREFIX - 1 segments.
PREFIX = 1 << 16


def attention_mask(key_valid: Array, query_slots: Array) -> Array:
    """key_valid [B, S] bool or int segment ids, query_slots [B, T] int -> mask [B, T, S] bool.

    A query attends to the valid keys written at or before its own slot (causality by slot order).
    Integer key_valid: segment ids (0 = padding, not a key); a query at slot s belongs to segment
    key_valid[:, s] and attends only to keys of that same segment (packed sequences never see
    each other). The slots index key_valid, so any block of queries finds its own segments.

    An id that is a multiple of `PREFIX` (p x PREFIX, p >= 1) marks a shared prefix: its keys are
    also seen by every segment whose id is p x PREFIX + s (1 <= s < PREFIX), so segments in one
    row can each continue their own prefix (`rl/shared_prompt.py`: packed responses, each after
    its prompt's K/V). Plain segment ids (below PREFIX) have no prefix: the rule above is all.
    """
    key_slots = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    causal = key_slots[None, None, :] <= query_slots[:, :, None]
    if key_valid.dtype == jnp.bool_:
        return key_valid[:, None, :] & causal
    query_seg = jnp.take_along_axis(key_valid, jnp.clip(query_slots, 0, key_valid.shape[1] - 1), axis=1)
    key, query = key_valid[:, None, :], query_seg[:, :, None]
    # A plain id's prefix is 0, never a key; a prefix's own prefix is itself, already matched.
    same = (key == query) | (key == query - query % PREFIX)
    return (key > 0) & same & causal


def _tie(x: Array, dep: Array) -> Array:
    """x plus 0 times an element of dep: x's value (dep is finite), computed only once dep exists.

    A data dependency the compiler keeps (XLA folds x * 0 for integers only; XLA:CPU drops
    `lax.optimization_barrier`, and with it the order it would impose)."""
    return x + (dep.reshape(-1)[0] * 0).astype(x.dtype)


def _after(x: Array, dep: Array) -> Array:
    """x, ordered after dep; backward, dep's cotangent (zero) comes after x's, so the order holds in
    reverse too."""
    return _ordered(x, dep, dep.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ordered(x: Array, dep: Array, shape: tuple[int, ...]) -> Array:
    return _tie(x, dep)


def _ordered_fwd(x: Array, dep: Array, shape: tuple[int, ...]) -> tuple[Array, Array]:
    return _tie(x, dep), jnp.zeros((), dep.dtype)


def _ordered_bwd(shape: tuple[int, ...], zero: Array, ct: Array) -> tuple[Array, Array]:
    return ct, jnp.broadcast_to(_tie(zero, ct), shape)


_ordered.defvjp(_ordered_fwd, _ordered_bwd)


def _remat_in_sequence(f: Any) -> Any:
    """f(q, *rest) rematerialised in the backward pass like `jax.checkpoint(f)` (only its inputs are
    saved), its recomputation held back until its output's cotangent exists.

    `jax.checkpoint`'s recomputations depend on the inputs alone, so XLA:CPU's scheduler runs every
    block's together, early, each holding its scores and probabilities until its cotangent arrives
    (10.7 GiB of temporaries for the tiny preset's update at 8 x 5,120). Tied to the cotangent, with
    the blocks chained in `attend`, one block's backward runs at a time.
    """
    @jax.custom_vjp
    def run(*args):
        return f(*args)

    def fwd(*args):
        return f(*args), args

    def bwd(args, ct):
        args = tuple(_after(a, ct) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)
        _, vjp = jax.vjp(f, *args)
        return vjp(ct)

    run.defvjp(fwd, bwd)
    return run


# The most causal blocks `attend` unrolls: each is a product of its own shape, so the compiled
# program (and its compile time and memory) grows with their count.
MAX_CAUSAL_BLOCKS = 16


def attend(qg: Array, k: Array, v: Array, key_valid: Array, query_slots: Array, dtype: Any,
           query_block: int | None = None, causal_block: int | None = None,
           max_causal_blocks: int = MAX_CAUSAL_BLOCKS, impl: str = "jnp", interpret: bool = False) -> Array:
    """Masked grouped-query attention: qg [B, T, K, G, Dh], k/v [B, S, K, Dh] -> [B, T, K, G, Dh].

    key_valid [B, S]: bool valid keys, or int segment ids for packed rows (see `attention_mask`).

    Scores and softmax in fp32, the weighted sum in `dtype`. With `query_block` and T > query_block
    the queries are processed in blocks of at most that many, each block rematerialised in the
    backward pass, so memory holds [B, H, query_block, S] scores instead of [B, H, T, S] (training on
    long multi-turn trajectories: 8 rows x 14 heads x 8192^2 fp32 scores would be 30 GB per layer).
    Every block computes exactly what the unblocked form computes for its queries.

    causal_block: only when the queries are the sequence itself (no cache: query_slots[:, i] = i and
    S = T). Queries go in causal blocks, and a block attends to the keys up to its own last query
    only: the later ones are in its future, masked anyway. At T = 2 x 128 this computes 3/4 of the
    [T, S] scores, at 4 x 128 5/8 (flash attention's causal skipping, with static shapes: one
    unrolled product per block). A block is causal_block queries, or the smallest multiple of it
    that keeps the blocks to max_causal_blocks (compile time and program size grow with their
    count: at T = 9,472, 15 blocks of 640 instead of 74 of 128). With T > query_block a block is
    at most query_block queries (that bound wins over the count) and is rematerialised.
    Real queries get exactly the unblocked result; a fully-masked (padding) query's output, never
    used, is a uniform mean over its block's keys instead of all keys.

    impl: "jnp" (the above) or "splash": jax's Pallas flash-attention kernel for TPU (`splash.attend`;
    `interpret` runs it in Pallas' interpreter on any backend), for the causal case only (no cache,
    query_slots = arange(T)); real queries get the jnp result up to float rounding.
    """
    b, t = qg.shape[:2]
    if impl == "splash":
        if k.shape[1] != t:
            raise ValueError(f"splash attention needs the queries to be the keys (S = T), got S={k.shape[1]}, T={t}")
        return splash.attend(qg, k, v, key_valid, dtype, interpret=interpret)
    scale = qg.shape[-1] ** -0.5

    def block(q: Array, slots: Array, kk: Array, vv: Array, valid: Array) -> Array:
        scores = mixed.einsum("btkgd,bskd->bkgts", q, kk, dtype, jnp.float32) * scale
        mask = attention_mask(valid, slots)  # [B, t, S]
        # Masked by a finite fill: fully-masked (padding) queries stay NaN-free; their outputs are never used.
        probs = mixed.softmax(scores, mask[:, None, None], dtype)
        return mixed.einsum("bkgts,bskd->btkgd", probs, vv, dtype)

    long = bool(query_block) and t > query_block
    if causal_block and t > causal_block:
        if k.shape[1] != t:
            raise ValueError(f"causal_block needs the queries to be the keys (S = T), got S={k.shape[1]}, T={t}")
        size = max(causal_block, -(-t // (max_causal_blocks * causal_block)) * causal_block)
        if long:
            size = min(size, query_block)
        run = _remat_in_sequence(block) if long else block
        outs: list[Array] = []
        for lo in range(0, t, size):
            q = qg[:, lo:lo + size]
            if outs:
                # Independent, the blocks run side by side on XLA:CPU, every block's scores live at
                # once; each block waits for the previous one's output (and, backward, its cotangent
                # for the next one's), so they run one at a time.
                q = _after(q, outs[-1])
            outs.append(run(q, query_slots[:, lo:lo + size], *(x[:, :lo + size] for x in (k, v, key_valid))))
        return jnp.concatenate(outs, axis=1)
    if not long:
        return block(qg, query_slots, k, v, key_valid)
    n = -(-t // query_block)
    pad = n * query_block - t
    q = jnp.pad(qg, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    slots = jnp.pad(query_slots, ((0, 0), (0, pad)))
    q = jnp.moveaxis(q.reshape((b, n, query_block) + qg.shape[2:]), 1, 0)       # [n, B, C, K, G, Dh]
    slots = jnp.moveaxis(slots.reshape(b, n, query_block), 1, 0)                 # [n, B, C]
    out = jax.lax.map(jax.checkpoint(lambda a: block(*a, k, v, key_valid)), (q, slots))  # [n, B, C, K, G, Dh]
    return jnp.moveaxis(out, 0, 1).reshape((b, n * query_block) + qg.shape[2:])[:, :t]
