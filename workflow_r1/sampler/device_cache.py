"""A sampler session's KV cache on the sampler's devices: where its arrays live, its allocation and
growth, and the chunked writes of pending tokens.

Placement: without a mesh every array stays on the default device. On a mesh (`Sampler(mesh=)`),
arrays with a leading batch axis [Bp, ...] are sharded over its "data" and "fsdp" axes (so Bp is
padded to a multiple of their size, `batch_multiple`), the KV cache as `qwen2.CACHE_AXES` (stacked:
`STACKED_CACHE_AXES`) says, and the rest (stop tables, EOS ids) is replicated; every jitted program
runs under the mesh (`on_mesh`).

The cache (`ensure`): Bp rows (B padded to the batch multiple, at least the fused CPU path's
minimum rows) x S slots, S bucketed (`Sampler(cache_buckets=)`, default powers of two >= 128) but
never more than a multiple of 64 past what `cache_size` can need; allocated at the first write and
grown (loop.grow) when a write needs more slots. `write` writes each row's pending tokens in right-padded chunks of `chunk_len` tokens
(the plan of session.write_plan, run through loop.extend).

The functions take the `Sampler` (sampler.py) whose cache it is, as paged.py's do.

Shapes: B rows of a session, Bp padded rows, S cache slots per row, V vocabulary; `logits`
[Bp, V] float32 (each row's logits after its last written token).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from workflow_r1 import sharding
from workflow_r1.model import paged_kv, qwen2
from workflow_r1.sampler import fused_cpu, loop
from workflow_r1.sampler.session import Session, _bucket, write_plan


# ------------------------------------------------------------------------------------ placement

def batch_multiple(mesh: jax.sharding.Mesh | None) -> int:
    """What a batch's rows are padded to a multiple of: the size of the mesh's data x fsdp axes."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.shape)


def put_batch(mesh: jax.sharding.Mesh | None, x: np.ndarray) -> jax.Array:
    """A host array with a leading batch axis, on the devices (batch over data / fsdp on a mesh)."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.device_put(x, sharding.batch_sharding(mesh, x.ndim))


def replicated(mesh: jax.sharding.Mesh | None, x: jax.Array) -> jax.Array:
    """`x` on every device of the mesh (unchanged without one)."""
    if mesh is None:
        return x
    return jax.device_put(x, NamedSharding(mesh, jax.sharding.PartitionSpec()))


def on_mesh(mesh: jax.sharding.Mesh | None, fn, *args, **kw):
    """fn(*args, **kw) under `mesh` (the jitted programs' sharding constraints read it)."""
    with sharding.use_mesh(mesh):
        return fn(*args, **kw)


# ---------------------------------------------------------------------------------------- cache

def new_cache(sampler: Any, batch: int, size: int) -> qwen2.KVCache:
    """An empty cache of `batch` rows x `size` slots in the sampler's layout, on its devices."""
    if sampler.impl == "fused_cpu":
        return fused_cpu.new_cache(sampler.cfg, batch, size)
    mesh = sampler.mesh
    cache = qwen2.KVCache.init(sampler.cfg, batch, size, sampler.cache_dtype, stacked=sampler._stacked)
    if mesh is None:
        return cache
    if cache.stacked:  # a model with scanned layers: one [L, B, S, K, Dh] array each
        kv = sharding.named_sharding(mesh, qwen2.STACKED_CACHE_AXES, cache.k.shape)
        k, v = jax.device_put(cache.k, kv), jax.device_put(cache.v, kv)
    else:
        kv = sharding.named_sharding(mesh, qwen2.CACHE_AXES, cache.k[0].shape)
        k, v = tuple(jax.device_put(x, kv) for x in cache.k), tuple(jax.device_put(x, kv) for x in cache.v)
    return qwen2.KVCache(k=k, v=v,
                         valid=put_batch(mesh, np.zeros((batch, size), bool)),
                         end=put_batch(mesh, np.zeros((batch,), np.int32)))


def ensure(sampler: Any, session: Session, need: int) -> None:
    """Allocates or grows the session's cache to at least `need` slots per row (bucketed)."""
    # Bucketed, but never more than a multiple of 64 past what the logical cap can need (the
    # cap plus the finished-row scratch slot, or a padded chunk written near the cap).
    size = min(_bucket(need, sampler.cache_buckets, 128), -(-max(need, sampler.cache_size + 1) // 64) * 64)
    if session.cache is None:
        m = batch_multiple(sampler.mesh)
        padded = max(sampler._min_rows, -(-session.num_rows // m) * m)
        session.cache = new_cache(sampler, padded, size)
    elif session.cache.size < need and isinstance(session.cache, paged_kv.PagedKVCache):
        raise ValueError(f"a paged call's tables reach {session.cache.size} slots, it writes up to {need}: "
                         "paged.call_shape must cover every slot the call writes")
    elif session.cache.size < need:
        k_axis, v_axis = ((fused_cpu.K_SLOT_AXIS, fused_cpu.V_SLOT_AXIS) if sampler.impl == "fused_cpu"
                          else (1, 1))
        session.cache = on_mesh(sampler.mesh, loop.grow, session.cache, new_size=size, k_slot_axis=k_axis,
                                v_slot_axis=v_axis)


# --------------------------------------------------------------------------------------- writes

def chunk_len(sampler: Any, k: int) -> int:
    """The chunk length that writes k tokens (its next chunk when k > prefill_chunk). A single
    token (a paused row's last sampled one) is a chunk of its own length, not one of 16."""
    return 1 if k == 1 else min(sampler.prefill_chunk, _bucket(k, sampler.buckets, 16))


def write(sampler: Any, session: Session, cache: qwen2.KVCache, logits: jax.Array,
          target: np.ndarray) -> tuple[jax.Array, qwen2.KVCache]:
    """Writes each row's tokens [session.cached[b], target[b]) in right-padded chunks; returns the
    logits after each row's last written token (unchanged for rows writing nothing) and the cache."""
    mesh = sampler.mesh
    bp, n = cache.end.shape[0], session.num_rows
    cached = session.cached.copy()
    while True:
        left = target - cached
        if not left.any():
            return logits, cache
        plan = write_plan(left, bp, chunk=lambda k: chunk_len(sampler, k), min_rows=sampler._min_rows,
                          sub_batches=mesh is None)
        for t, written, index in plan:
            r = bp if index is None else len(index)
            at = written if index is None else np.searchsorted(index, written)  # written rows' places
            toks, cnt = np.zeros((r, t), np.int32), np.zeros(r, np.int32)
            counts = np.zeros(n, np.int64)
            counts[written] = np.minimum(left[written], t)
            for i, b in zip(at, written):
                toks[i, :counts[b]] = session.sequences[b][cached[b]:cached[b] + counts[b]]
                cnt[i] = counts[b]
            logits, cache = on_mesh(mesh, loop.extend, sampler._impl, sampler._weights, cache, logits,
                                    put_batch(mesh, toks), put_batch(mesh, cnt),
                                    None if index is None else jnp.asarray(index))
            cached = cached + counts
