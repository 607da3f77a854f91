"""Causal self-attention through jax's Pallas splash-attention kernel: training and scoring on TPU.

`attend` computes what `ops.attend` computes without a cache (the queries are the sequence itself,
query_slots = arange(T)) with `jax.experimental.pallas.ops.tpu.splash_attention`: a flash-attention
kernel that skips the key blocks a causal mask zeroes and never materialises the [T, T] scores,
forward or backward (its custom VJP saves q, k, v, the output and each query's log-sum-exp).

Shapes: B batch, T tokens, K kv heads, G query heads per kv head (H = K G), Dh head dim.

The kernel attends one sequence at a time ([H, T, Dh] queries, [K, T, Dh] keys: query head h reads
kv head h // G, which is `ops.attend`'s [K, G] order flattened) and is vmapped over the batch. The
packing mask is the kernel's segment ids: a token of segment s attends to earlier tokens of segment
s only; padding is segment 0, so a padding query attends to earlier padding (never to a real key),
and its output, never used, differs from the jnp path's. Real queries get the jnp path's result up
to float rounding. T is padded to a multiple of the kernel's block with segment-0 tokens, after
every real one, so they change nothing.

Under a mesh (`sharding.use_mesh`) the kernel runs in `shard_map` over the batch's mesh axes (a
Pallas call is one device's program: the compiler cannot split it itself); every other axis sees
whole rows.

`interpret=True` runs the kernel in Pallas' interpreter, on any backend (the CPU tests); compiled, it
runs on TPU only (`check_platform`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1 import sharding

Array = jax.Array

# The kernel's tile along T: its key blocks are a multiple of the TPU's 128 lanes. Larger tiles run
# fewer, larger products (the kernel's own default is 128; 512 is MaxText's training default); the
# largest of these that divides the padded length is used.
BLOCKS = (512, 256, 128)
LANES = 128

IMPLS = ("auto", "jnp", "splash")


def platform() -> str:
    """The platform the program being traced compiles for: the active mesh's devices' (an AOT compile
    for a TPU topology on a CPU host says "tpu"), else the default backend's."""
    mesh = sharding.current_mesh()
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def resolve(impl: str) -> str:
    """`model.attention` -> the path this program takes: "auto" is splash on TPU and jnp elsewhere;
    "splash" where it cannot run is one error line."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention={impl!r} unknown; use one of {IMPLS}")
    where = platform()
    if impl == "auto":
        return "splash" if where == "tpu" else "jnp"
    if impl == "splash" and where != "tpu":
        raise ValueError(f"model.attention='splash' runs on TPU only, this program compiles for {where}; "
                         "use model.attention=auto (splash on TPU, jnp elsewhere) or jnp")
    return impl


def block_size(t: int) -> int:
    """The kernel's q and kv tile for T tokens padded to a multiple of LANES."""
    padded = -(-t // LANES) * LANES
    return next(b for b in BLOCKS if padded % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(t: int, heads: int, block: int, interpret: bool) -> Any:
    """The causal multi-head kernel for sequences of t tokens (a multiple of block) and `heads`
    query heads; built once per shape.

    As `make_splash_mha`, but its block masks stay NumPy arrays: constants of whichever program uses
    the kernel. (`make_splash_mha` turns them into jax arrays: inside a trace those are that trace's
    values, which the cached kernel would carry into the next one; made eagerly under a mesh of
    compile-only TPU devices, they cannot be placed.)"""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * heads)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    shape = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)
    fwd, mask_function = mi.process_mask(mask, (block, block), **shape)
    dq, _ = mi.process_mask(mask, (block, block), **shape)
    dkv, _ = mi.process_mask_dkv(mask, (block, block), shrink_grid=True, **shape)
    return sk.SplashAttentionKernel(fwd, dq, dkv, block_sizes=sizes, is_mqa=False, save_residuals=False,
                                    mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
                                    residual_checkpoint_name=None, mask_function=mask_function,
                                    interpret=interpret)


def attend(qg: Array, k: Array, v: Array, segments: Array, dtype: Any, *, interpret: bool = False,
           block: int | None = None) -> Array:
    """Causal grouped-query attention: qg [B, T, K, G, Dh], k/v [B, T, K, Dh] -> [B, T, K, G, Dh] in dtype.

    segments [B, T]: bool valid tokens, or int segment ids of packed rows (0 = padding), as
    `ops.attention_mask`'s key_valid with query_slots = arange(T). block: the kernel's tile, a
    multiple of 128 (default `block_size(T)`).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, t, kh, g, dh = qg.shape
    block = block or block_size(t)
    pad = -(-t // block) * block - t
    # [B, T, K, G, Dh] -> [B, H, T, Dh] with h = k G + g; the kernel takes scores unscaled.
    q = (qg.astype(dtype) * jnp.asarray(dh ** -0.5, dtype)).reshape(b, t, kh * g, dh)
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    k, v = (jnp.pad(x.astype(dtype), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (k, v))
    seg = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, pad)))
    kernel = _kernel(t + pad, kh * g, block, interpret)

    def rows(q: Array, k: Array, v: Array, seg: Array) -> Array:
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s)))(q, k, v, seg)

    mesh = sharding.current_mesh()
    if mesh is not None:
        spec = sharding.logical_to_spec(("batch",), (b,), mesh)
        if any(spec):
            four, two = jax.sharding.PartitionSpec(spec[0], None, None, None), jax.sharding.PartitionSpec(spec[0], None)
            rows = jax.shard_map(rows, mesh=mesh, in_specs=(four, four, four, two), out_specs=four, check_vma=False)
    out = rows(q, k, v, seg)  # [B, H, T + pad, Dh]
    return out[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, kh, g, dh)
