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
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def _parse(spec: str) -> tuple[str, str, str]:
    ins, out = spec.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _einsum(spec: str, a: Array, b: Array, dtype: Any, out_dtype: Any) -> Array:
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32).astype(out_dtype)


def _fwd(spec: str, a: Array, b: Array, dtype: Any, out_dtype: Any) -> tuple[Array, tuple[Array, Array]]:
    # The operands are kept as given (an fp32 weight is the parameter itself: no extra copy) and
    # cast again in the backward pass.
    return _einsum(spec, a, b, dtype, out_dtype), (a, b)


def _bwd(spec: str, dtype: Any, out_dtype: Any, res: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    del out_dtype
    a, b = res
    sa, sb, so = _parse(spec)
    g = g.astype(dtype)
    da = jnp.einsum(f"{so},{sb}->{sa}", g, b.astype(dtype), preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{sa},{so}->{sb}", a.astype(dtype), g, preferred_element_type=jnp.float32)
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


__all__ = ["einsum"]
