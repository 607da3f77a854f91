"""Mixed-precision matrix products: low-precision GEMMs in both passes, fp32 accumulation.

`einsum(spec, a, b, dtype)` is `jnp.einsum(spec, a, b)` computed as bf16 (or any `dtype`) x bf16
with fp32 accumulation, rounded to `dtype`, and differentiated the same way: the two backward
products (`da = g . b`, `db = a . g`) also take `dtype` operands and accumulate in fp32. This is
the recipe of mixed-precision training (torch autocast, bf16 FSDP): every GEMM in bf16, master
weights in fp32.

Why not plain `jnp.einsum` on bf16 operands. Its output is bf16, and XLA:CPU has no kernel for a
bf16 x bf16 -> bf16 product: it converts both operands to fp32 and multiplies in fp32 (measured on
an AMX CPU, 512x896x4864: 21 ms, against 10 ms in fp32 and 5 ms for bf16 x bf16 -> fp32). Asking
for an fp32 result (`preferred_element_type`) selects the bf16 kernel, but JAX's automatic
transpose of such a product multiplies the fp32 cotangent by a bf16 operand, which again runs in
fp32. The custom VJP below keeps all three products on the fast path. On GPUs and TPUs the same
products are the native bf16 matmuls with fp32 accumulation, so nothing changes there but the
weight gradient, which is returned in the weight's own dtype (fp32 master weights: not rounded
through bf16 as autocast does).

Shapes: any einsum with two operands in which every index of an operand appears in the other
operand or in the output (no index summed within a single operand); all our layers qualify.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _parse(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


def _product(sx: str, sy: str, so: str, x: Array, y: Array) -> Array:
    """einsum(f"{sx},{sy}->{so}", x, y) with fp32 accumulation, x and y already in the compute dtype.

    A product with batch indices (attention: [B, K] heads) runs as the single dot_general whose
    layouts make XLA copy the fewest bytes. XLA:CPU's GEMM reads the left operand as [batch, free,
    contracted] and the right as [batch, contracted, free] or [batch, free, contracted], and writes
    [batch, left free, right free]; an operand or result in another order is transposed into a
    copy first. In jnp.einsum's order, the backward products over the [B, K, G, T, S] attention
    probabilities (dV = P^T dO, dK = dS^T Q, dP = dO V^T) copied that big array or result; ordered
    here, only the small [B, T, H, Dh] arrays are copied, never the probabilities.
    Products without batch indices (the projections), and every product off the CPU, keep
    jnp.einsum's order.
    """
    batch_all = [c for c in so if c in sx and c in sy]
    # The layout model is XLA:CPU's; GPU and TPU compilers fold transposes into their GEMMs.
    if not batch_all or jax.default_backend() != "cpu":
        return jnp.einsum(f"{sx},{sy}->{so}", x, y, preferred_element_type=jnp.float32)
    contract_all = [c for c in sx if c in sy and c not in so]
    size = {c: n for s_, t in ((sx, x), (sy, y)) for c, n in zip(s_, t.shape)}

    def numel(idx: str) -> int:
        return int(np.prod([size[c] for c in idx], dtype=np.int64))

    def order(src: str, keep: list[str]) -> str:
        return "".join(c for c in src if c in keep)

    best = None
    for (sl, l_), (sr, r_) in (((sx, x), (sy, y)), ((sy, y), (sx, x))):
        free = [c for c in sl + sr if c not in batch_all and c not in contract_all]
        # Every index order that one of the three arrays already has, for each group of indices
        # (deduplicated in a fixed order: ties must pick the same program in every process).
        for batch, contract, free_l, free_r in itertools.product(
                dict.fromkeys(order(s_, batch_all) for s_ in (sl, sr, so)),
                dict.fromkeys(order(s_, contract_all) for s_ in (sl, sr)),
                dict.fromkeys(order(s_, [c for c in free if c in sl]) for s_ in (sl, so)),
                dict.fromkeys(order(s_, [c for c in free if c in sr]) for s_ in (sr, so))):
            cost = ((sl != batch + free_l + contract) * 2 * numel(sl)
                    + (sr not in (batch + contract + free_r, batch + free_r + contract)) * 2 * numel(sr)
                    + (so != batch + free_l + free_r) * 4 * numel(so))
            if best is None or cost < best[0]:
                best = (cost, sl, l_, sr, r_, batch, contract, free_l, free_r)
    _, sl, l_, sr, r_, batch, contract, free_l, free_r = best
    got = batch + free_l + free_r
    # dot_general keeps each operand's free indices in that operand's order: transpose the one
    # whose free indices are wanted in another order (the copy XLA would make anyway).
    if sl != batch + free_l + contract:
        l_, sl = jnp.transpose(l_, [sl.index(c) for c in batch + free_l + contract]), batch + free_l + contract
    if sr not in (batch + contract + free_r, batch + free_r + contract):
        r_, sr = jnp.transpose(r_, [sr.index(c) for c in batch + contract + free_r]), batch + contract + free_r
    dims = (([sl.index(c) for c in contract], [sr.index(c) for c in contract]),
            ([sl.index(c) for c in batch], [sr.index(c) for c in batch]))
    out = jax.lax.dot_general(l_, r_, dims, preferred_element_type=jnp.float32)
    return out if got == so else jnp.transpose(out, [got.index(c) for c in so])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _einsum(spec: str, a: Array, b: Array, dtype: Any, out_dtype: Any) -> Array:
    sa, sb, so = _parse(spec)
    return _product(sa, sb, so, a.astype(dtype), b.astype(dtype)).astype(out_dtype)


def _fwd(spec: str, a: Array, b: Array, dtype: Any, out_dtype: Any) -> tuple[Array, tuple[Array, Array]]:
    # The operands are kept as given (an fp32 weight is the parameter itself: no extra copy) and
    # cast again in the backward pass.
    return _einsum(spec, a, b, dtype, out_dtype), (a, b)


def _bwd(spec: str, dtype: Any, out_dtype: Any, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    del out_dtype
    a, b = res
    sa, sb, so = _parse(spec)
    g = g.astype(dtype)
    da = _product(so, sb, sa, g, b.astype(dtype))
    db = _product(sa, so, sb, a.astype(dtype), g)
    return da.astype(a.dtype), db.astype(b.dtype)


_einsum.defvjp(_fwd, _bwd)


def einsum(spec: str, a: Array, b: Array, dtype: Any, out_dtype: Any = None) -> Array:
    """`jnp.einsum(spec, a, b)` in compute dtype `dtype` -> result in `out_dtype` (default `dtype`).

    fp32 `dtype`: the plain einsum (exact fp32, JAX's own gradient). Lower precision: both operands
    cast to `dtype`, fp32 accumulation, result rounded to `dtype`; the gradients are computed the
    same way and returned in each operand's own dtype (see the module docstring). An fp32
    `out_dtype` keeps the accumulator unrounded (attention scores); its cotangent is rounded to
    `dtype` before the backward products, as autocast does.
    """
    out_dtype = dtype if out_dtype is None else out_dtype
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)
    sa, sb, so = _parse(spec)
    for name, s, other in (("first", sa, sb + so), ("second", sb, sa + so)):
        if any(c not in other for c in s):
            raise ValueError(f"mixed.einsum({spec!r}): an index of the {name} operand is summed within it; "
                             "reduce it before the product")
    return _einsum(spec, a, b, jnp.dtype(dtype), jnp.dtype(out_dtype))


def _lead(x: Array, p: Array) -> tuple[int, ...]:
    """The leading axes of x over which p [*x.shape[-p.ndim:]] is broadcast."""
    if x.shape[x.ndim - p.ndim:] != p.shape:
        raise ValueError(f"parameter of shape {p.shape} does not match the trailing axes of {x.shape}")
    return tuple(range(x.ndim - p.ndim))


# The gradient of a parameter broadcast over [B, T] is a sum over B x T. Left to autodiff on bf16
# operands it is a bf16 reduction, which XLA:CPU accumulates in fp32 through a reduce-window
# (a naive loop: 2.8 ms for a [1024, 896] sum that takes 0.04 ms as an fp32 reduction; 0.22 s of a
# 4 x 256 step over the biases and norm scales) and then rounds to bf16. Below, that sum is taken
# in fp32 and returned in the parameter's dtype, unrounded.
@jax.custom_vjp
def _add(x: Array, p: Array) -> Array:
    return x + p.astype(x.dtype)


def _add_fwd(x: Array, p: Array) -> tuple[Array, Array]:
    return _add(x, p), p


def _add_bwd(p: Array, g: Array) -> tuple[Array, Array]:
    return g, jnp.sum(g.astype(jnp.float32), axis=_lead(g, p)).astype(p.dtype)


_add.defvjp(_add_fwd, _add_bwd)


@jax.custom_vjp
def _mul(x: Array, p: Array) -> Array:
    return x * p.astype(x.dtype)


def _mul_fwd(x: Array, p: Array) -> tuple[Array, tuple[Array, Array]]:
    return _mul(x, p), (x, p)


def _mul_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    x, p = res
    dp = jnp.sum(g.astype(jnp.float32) * x.astype(jnp.float32), axis=_lead(x, p))
    return g * p.astype(g.dtype), dp.astype(p.dtype)


_mul.defvjp(_mul_fwd, _mul_bwd)


def add(x: Array, p: Array) -> Array:
    """x + p in x's dtype, p [*x.shape[-p.ndim:]] a parameter (a bias) broadcast over x's leading axes.

    In fp32 the plain sum. In a lower precision the same value, and p's gradient (the cotangent
    summed over the leading axes) is accumulated in fp32 and returned in p's dtype.
    """
    _lead(x, p)
    return x + p.astype(x.dtype) if x.dtype == jnp.float32 else _add(x, p)


def mul(x: Array, p: Array) -> Array:
    """x * p in x's dtype, p a parameter (a norm scale) broadcast over x's leading axes; p's
    gradient accumulated in fp32 as in `add`."""
    _lead(x, p)
    return x * p.astype(x.dtype) if x.dtype == jnp.float32 else _mul(x, p)


# SwiGLU on bf16 activations. Left to autodiff, silu(g) * u and its gradient are a chain of bf16
# ops, each rounded and compiled by XLA:CPU into its own pass over the [B, T, M] activations
# (sigmoid, silu, product forward; three more backward): 8.8 ms per layer at 4 x 256 on the 0.5B,
# against 6.0 ms computed here in fp32 from the same bf16 operands, rounded once.
@jax.custom_vjp
def _swiglu(g: Array, u: Array) -> Array:
    return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)


def _swiglu_fwd(g: Array, u: Array) -> tuple[Array, tuple[Array, Array]]:
    return _swiglu(g, u), (g, u)


def _swiglu_bwd(res: tuple[Array, Array], dh: Array) -> tuple[Array, Array]:
    g, u = (x.astype(jnp.float32) for x in res)
    dh = dh.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    # silu(g) = g s, silu'(g) = s (1 + g (1 - s))
    dg = dh * u * s * (1 + g * (1 - s))
    return dg.astype(res[0].dtype), (dh * g * s).astype(res[1].dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(g: Array, u: Array) -> Array:
    """silu(g) * u for the gate and up activations g, u [..., M] of one dtype, in that dtype.

    fp32: the plain expression, JAX's own gradient. Lower precision: computed and differentiated
    in fp32 from the given operands, each result rounded once to their dtype.
    """
    if g.dtype != u.dtype:
        raise ValueError(f"swiglu: gate and up activations differ in dtype ({g.dtype} vs {u.dtype})")
    return jax.nn.silu(g) * u if g.dtype == jnp.float32 else _swiglu(g, u)


# Attention probabilities. Autodiff of where -> softmax -> cast keeps the fp32 probabilities
# [B, K, G, T, S] for the backward pass and runs it as separate passes over that array (the cast's
# transpose, the softmax's, the mask's): 21 ms per layer for attention at 2 x 512 on the 0.5B, its
# GEMMs 6 ms. Here the backward is one pass from the rounded probabilities, which are also what the
# weighted sum multiplied (half the residual memory).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(scores: Array, mask: Array, dtype: Any) -> Array:
    s = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def _softmax_fwd(scores: Array, mask: Array, dtype: Any) -> tuple[Array, Array]:
    p = _softmax(scores, mask, dtype)
    return p, p


def _softmax_bwd(dtype: Any, p: Array, dp: Array) -> tuple[Array, None]:
    del dtype
    p, dp = p.astype(jnp.float32), dp.astype(jnp.float32)
    # d softmax: p (dp - Σ p dp); masked entries have p = 0, so no gradient reaches them
    return p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def softmax(scores: Array, mask: Array, dtype: Any) -> Array:
    """Softmax over the last axis of fp32 `scores` where `mask` (broadcastable) is True, in fp32,
    rounded to `dtype` (attention probabilities for the weighted sum).

    A row with no True entry comes out uniform (finite; its output is padding). fp32 `dtype`: the
    plain expression, JAX's own gradient. Lower precision: the gradient is computed in fp32 from the
    rounded probabilities, in one pass.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    return _softmax(scores, mask, jnp.dtype(dtype))


__all__ = ["einsum", "add", "mul", "swiglu", "softmax"]
