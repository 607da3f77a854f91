"""A paged KV cache on device: pages of `page_size` tokens, and the dense view a sampler call runs on.

`KVPages` holds, per layer, N pages of keys and values plus one scratch page (index N) that every
padded or unused table entry points at. A page is a slice of one row of the sampler's own cache
layout with `page_size` slots: [ps, K, Dh] for the model path (stacked [L, ...] for scanned
layers), keys [K, Dh, ps] and values [K, ps, Dh] for the fused CPU path (fused_cpu.py). Which page
holds which tokens is host bookkeeping (rollout/pages.py); here are only the two copies between
pages and a call's working cache:

  - `view`: the pages of R live sequences, by their page tables [R, P], as an ordinary
    `qwen2.KVCache` of R rows x P * ps slots (slot = position, as everywhere in the sampler), so a
    sampler call (`Sampler.generate_from`) runs on it unchanged and computes only those rows, at the
    length they need rather than the longest a row may reach;
  - `write_back`: the pages a call wrote, copied from that cache into the pages (W pages, not all).

This dense view (`Sampler(paged_attention="view")`) costs one copy of the live rows' KV per call
(a call decodes many tokens: its per-step cost is the sampler's own). With "gather" or "kernel"
the pages are one combined [N + 1, ps, 2K, Dh'] array per layer (model/paged_kv.py: the layout of
jax's TPU `ragged_paged_attention`) and a call runs on them in place: the model writes its tokens
into the rows' pages and attends over them (a jnp gather, or the TPU kernel), with no view and no
copy back.

`generate` is one call of the rollout engine: the view of its rows, `Sampler.generate_from` on it, and
the pages it wrote copied back (`Sampler.generate_paged` is this function); `call_shape` gives that
working cache its rows and slots (what the sampler's write plan reaches).

Shapes: N pages, ps page size, R rows of a view (padded), P pages per row, S = P * ps slots,
W pages written back.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from workflow_r1.model import paged_kv, qwen2
from workflow_r1.sampler import device_cache, fused_cpu
from workflow_r1.sampler.session import SampleOutput, Session, _bucket, _pow2_at_least


@flax.struct.dataclass
class KVPages:
    """Per-layer page buffers: k, v tuples of [N + 1, *page] (or stacked arrays [L, N + 1, *page]).

    k_axis, v_axis: the slot axis of a page (and of a cache row, batch axis excluded)."""

    k: Any
    v: Any
    page_size: int = flax.struct.field(pytree_node=False)
    k_axis: int = flax.struct.field(pytree_node=False)
    v_axis: int = flax.struct.field(pytree_node=False)
    # "view", or the paged attention that reads `k` in place ("gather", "kernel"): then `k` holds
    # the combined pages of model/paged_kv.py and `v` is None.
    attention: str = flax.struct.field(pytree_node=False, default="view")

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def num_pages(self) -> int:
        """Pages that can hold tokens (the scratch page not counted)."""
        first = self.k if self.stacked else self.k[0]
        return first.shape[1 if self.stacked else 0] - 1

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves((self.k, self.v)))

    @property
    def bytes_per_page(self) -> int:
        return self.nbytes // (self.num_pages + 1)


MODES = ("auto", "view") + paged_kv.ATTENTIONS


def attention_mode(mode: str, impl: str, backend: str | None = None) -> str:
    """The paged attention a sampler of path `impl` runs for `mode` (see `Sampler(paged_attention=)`)."""
    backend = backend or jax.default_backend()
    if mode not in MODES:
        raise ValueError(f"rollout.paged_attention={mode!r} unknown; use one of {MODES}")
    if mode == "auto":
        return "kernel" if backend == "tpu" and impl == "model" else "view"
    if mode != "view" and impl != "model":
        raise ValueError(f"rollout.paged_attention={mode!r} runs on the model path; the {impl} sampler "
                         "reads its pages through a view: set it to 'view' or 'auto'")
    if mode == "kernel" and backend != "tpu":
        raise ValueError(f"rollout.paged_attention='kernel' is jax's TPU kernel; this backend is {backend}: "
                         "use 'gather' (the same attention in jnp) or 'auto'")
    return mode


def new_pages(sampler: Any, num_pages: int, page_size: int) -> KVPages:
    """`num_pages` empty pages (plus the scratch page) in `sampler`'s cache layout and dtype."""
    cfg, kind = sampler.cfg, sampler.impl
    n, k, dh, ps = num_pages + 1, cfg.num_kv_heads, cfg.head_dim, page_size
    attention = sampler.paged_attention
    if attention != "view":  # split over heads on a tensor-parallel sampler's mesh (paged_kv.head_axis)
        shape = (n, ps, 2 * k, paged_kv.stored_head_dim(dh, attention))
        put = _placer(sampler.mesh, paged_kv.page_spec(sampler.mesh, k, sampler._stacked))
        kk = (put(jnp.zeros((cfg.num_layers,) + shape, sampler.cache_dtype)) if sampler._stacked
              else tuple(put(jnp.zeros(shape, sampler.cache_dtype)) for _ in range(cfg.num_layers)))
        return KVPages(k=kk, v=None, page_size=ps, k_axis=0, v_axis=0, attention=attention)
    if kind == "fused_cpu":
        shapes, axes, dtype = ((n, k, dh, ps), (n, k, ps, dh)), (fused_cpu.K_SLOT_AXIS - 1, fused_cpu.V_SLOT_AXIS - 1), \
            fused_cpu.CACHE_DTYPE
    else:
        shapes, axes, dtype = ((n, ps, k, dh),) * 2, (0, 0), sampler.cache_dtype
    put = _placer(sampler.mesh)
    if sampler._stacked:
        kk, vv = (put(jnp.zeros((cfg.num_layers,) + s, dtype)) for s in shapes)
    else:
        kk, vv = (tuple(put(jnp.zeros(s, dtype)) for _ in range(cfg.num_layers)) for s in shapes)
    return KVPages(k=kk, v=vv, page_size=ps, k_axis=axes[0], v_axis=axes[1])


def _placer(mesh: Any, spec: PartitionSpec = PartitionSpec()):
    """Places page arrays on `mesh` by `spec`: replicated by default (every device of the host
    computes the rows it is given from a full copy); the in-place pages may be split over heads."""
    if mesh is None:
        return lambda x: x
    return lambda x: jax.device_put(x, NamedSharding(mesh, spec))


def _to_rows(pages: jax.Array, table: jax.Array, axis: int) -> jax.Array:
    """pages [N+1, *page] (slot axis `axis` of a page), table [R, P] -> [R, *row] with P * ps slots."""
    g = jnp.moveaxis(pages[table], 1, 1 + axis)             # [R, ..., P, ps, ...]
    shape = list(pages.shape[1:])
    shape[axis] *= table.shape[1]
    return g.reshape((table.shape[0], *shape))


def _from_rows(pages: jax.Array, dense: jax.Array, axis: int, rows: jax.Array, slots: jax.Array,
               ids: jax.Array) -> jax.Array:
    """pages with page ids[w] <- page slots[w] of row rows[w] of `dense` [R, *row] (W entries)."""
    ps = pages.shape[1 + axis]
    shape = list(dense.shape)
    shape[1 + axis:2 + axis] = [dense.shape[1 + axis] // ps, ps]
    split = jnp.moveaxis(dense.reshape(shape), 1 + axis, 1)  # [R, P, *page]
    return pages.at[ids].set(split[rows, slots])


def _view_impl(kv: KVPages, table: jax.Array, cached: jax.Array) -> qwen2.KVCache:
    s = table.shape[1] * kv.page_size
    if kv.stacked:
        k = jax.vmap(lambda x: _to_rows(x, table, kv.k_axis))(kv.k)
        v = jax.vmap(lambda x: _to_rows(x, table, kv.v_axis))(kv.v)
    else:
        k = tuple(_to_rows(x, table, kv.k_axis) for x in kv.k)
        v = tuple(_to_rows(x, table, kv.v_axis) for x in kv.v)
    valid = jnp.arange(s, dtype=jnp.int32)[None, :] < cached[:, None]
    return qwen2.KVCache(k=k, v=v, valid=valid, end=cached.astype(jnp.int32))


def _write_back_impl(kv: KVPages, cache: qwen2.KVCache, rows: jax.Array, slots: jax.Array,
                     ids: jax.Array) -> KVPages:
    if kv.stacked:
        k = jax.vmap(lambda p, d: _from_rows(p, d, kv.k_axis, rows, slots, ids))(kv.k, cache.k)
        v = jax.vmap(lambda p, d: _from_rows(p, d, kv.v_axis, rows, slots, ids))(kv.v, cache.v)
    else:
        k = tuple(_from_rows(p, d, kv.k_axis, rows, slots, ids) for p, d in zip(kv.k, cache.k))
        v = tuple(_from_rows(p, d, kv.v_axis, rows, slots, ids) for p, d in zip(kv.v, cache.v))
    return kv.replace(k=k, v=v)


_view = jax.jit(_view_impl)
_write_back = jax.jit(_write_back_impl, donate_argnames=("kv",))


def view(sampler: Any, kv: KVPages, table: np.ndarray, cached: np.ndarray) -> qwen2.KVCache:
    """The working cache of R rows: row r holds the pages table[r] (int [R, P]; the scratch page
    index N where a row has no page) with its first cached[r] slots valid and end = cached[r]."""
    return device_cache.on_mesh(sampler.mesh, _view, kv, jnp.asarray(table, jnp.int32),
                                jnp.asarray(cached, jnp.int32))


def write_back(sampler: Any, kv: KVPages, cache: qwen2.KVCache, written: list[tuple[int, int, int]]) -> KVPages:
    """`kv` with each (row, page slot, page id) of `written` copied from `cache` (a `view`'s cache
    after a call). Padded to a power of two of entries (at least 16) with copies into the scratch page."""
    if not written:
        return kv
    # At least 16 entries: most calls write a few pages, and each count would be a program of its own.
    w = max(16, 1 << (len(written) - 1).bit_length())
    pad = [(0, 0, kv.num_pages)] * (w - len(written))
    rows, slots, ids = (jnp.asarray(np.array(c, np.int32)) for c in zip(*(written + pad)))
    return device_cache.on_mesh(sampler.mesh, _write_back, kv, cache, rows, slots, ids)


def call_shape(sampler: Any, page_size: int, cached: np.ndarray, lengths: np.ndarray,
               limits: np.ndarray) -> tuple[int, int]:
    """(rows, slots) of the working cache of one `Sampler.generate_from` over sequences holding
    `cached` of their `lengths` tokens [R] and decoding up to `limits` more [R].

    rows: R padded to a power of two (at least the sampler's minimum, a multiple of its batch
      multiple), so calls reuse few compiled shapes.
    slots: a power of two of pages covering the furthest slot the call writes, but no more pages
      than a longest row needs (`cache_size` + 1 slots: so a long row's view is not rounded up to
      almost twice it). Every chunk of its write plan is right-padded to a bucket (a shorter cache
      would shift the padded write over real slots), and a finished row writes one scratch slot at
      its end.
    """
    m = device_cache.batch_multiple(sampler.mesh)
    rows = -(-_pow2_at_least(len(cached), sampler._min_rows) // m) * m
    first = min(sampler.prefill_chunk, _bucket(int((lengths - cached).max()), sampler.buckets, 16))
    far = max(int((lengths + limits).max()), int((cached + first).max()))  # generate_from's own need
    done = cached.copy()
    while (left := lengths - done).any():
        chunk = device_cache.chunk_len(sampler, int(left.max()))
        far = max(far, int((done[left > 0] + chunk).max()))
        done = done + np.minimum(left, chunk)
    return rows, page_size * working_pages(-(-far // page_size), sampler.cache_size, page_size)


def abstract_cache(cfg: Any, attention: str, rows: int, slots: int, num_pages: int, page_size: int, dtype: Any,
                   mesh: Any, stacked: bool) -> tuple[Any, int, int]:
    """The cache one call of `rows` x `slots` runs on, as ShapeDtypeStructs on `mesh` (what
    `workflow_r1.aot` compiles): a dense `qwen2.KVCache` ("view"), or the `num_pages` pool itself
    (`paged_kv.PagedKVCache`, placed as `new_pages` places it). Returns it, the bytes per device
    its attention reads at full length (the rows' own K/V), and the bytes of one page (all layers)
    per device (pages split over a tensor-parallel sampler's heads hold 1 / tensor of it)."""
    from workflow_r1 import sharding

    stored = paged_kv.stored_head_dim(cfg.head_dim, attention)
    page_b = 2 * cfg.num_layers * cfg.num_kv_heads * stored * page_size * jnp.dtype(dtype).itemsize
    rows_of = lambda ndim: sharding.batch_sharding(mesh, ndim)  # noqa: E731
    sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    if attention == "view":
        kv = jax.eval_shape(lambda: qwen2.KVCache.init(cfg, rows, slots, dtype, stacked=stacked))
        axes = qwen2.STACKED_CACHE_AXES if stacked else qwen2.CACHE_AXES
        kv_sds = lambda x: sds(x.shape, x.dtype, sharding.named_sharding(mesh, axes, x.shape))  # noqa: E731
        cache = qwen2.KVCache(k=jax.tree.map(kv_sds, kv.k), v=jax.tree.map(kv_sds, kv.v),
                              valid=sds(kv.valid.shape, bool, rows_of(2)), end=sds((rows,), jnp.int32, rows_of(1)))
        live = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(cache))
        return cache, live, page_b
    shape = (num_pages + 1, page_size, 2 * cfg.num_kv_heads, stored)
    spec = paged_kv.page_spec(mesh, cfg.num_kv_heads, stacked)
    layer = sds(((cfg.num_layers,) if stacked else ()) + shape, dtype, NamedSharding(mesh, spec))
    page_b //= dict(mesh.shape)[spec[-2]] if spec[-2] else 1
    cache = paged_kv.PagedKVCache(kv=layer if stacked else (layer,) * cfg.num_layers,
                                  table=sds((rows, slots // page_size), jnp.int32, rows_of(2)),
                                  end=sds((rows,), jnp.int32, rows_of(1)), attention=attention)
    return cache, rows * slots * page_b // page_size // device_cache.batch_multiple(mesh), page_b


def working_pages(need: int, cache_size: int, page_size: int) -> int:
    """Pages of a call's working cache that must hold `need` pages: a power of two, capped at the
    pages of one longest row (cache_size + 1 slots), never below `need`."""
    return max(need, min(_pow2_at_least(need, 1), -(-(cache_size + 1) // page_size)))


def generate(sampler: Any, kv: KVPages, tables: list[list[int]], sequences: list[list[int]], cached: list[int],
             max_new_tokens: list[int], **sampling: Any) -> tuple[SampleOutput, KVPages, list[int]]:
    """One call over R sequences whose K/V live in `kv`: writes each one's pending tokens and decodes.

    tables: the pages of each sequence, in order (covering its tokens and the tokens this call
      writes: `sequences[r]`'s past `cached[r]` and up to `max_new_tokens[r] - 1` generated).
    sequences: every token of each sequence (host ids); the first cached[r] are in its pages.
    max_new_tokens: each sequence's limit; sampling: `Sampler.generate_from`'s keywords (temperature,
      top_p, top_k, seed, row_ids, step_offset, stop_after, min_buffer), one entry per sequence.
    Returns the generation (one entry per sequence), the pages with what the call wrote, and how
    many leading tokens of each sequence (now including its generated ones) are in its pages.
    """
    ps, r = kv.page_size, len(sequences)
    cached_in = np.asarray(cached, np.int64)
    lengths = np.array([len(s) for s in sequences])
    padded, slots = call_shape(sampler, ps, cached_in, lengths, np.asarray(max_new_tokens))
    table = np.full((padded, slots // ps), kv.num_pages, np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    full_cached = np.zeros(padded, np.int64)
    full_cached[:r] = cached_in
    in_place = kv.attention != "view"  # the call writes and reads the pages themselves
    cache = (paged_kv.PagedKVCache(kv=kv.k, table=device_cache.put_batch(sampler.mesh, table),
                                   end=device_cache.put_batch(sampler.mesh, full_cached.astype(np.int32)),
                                   attention=kv.attention) if in_place
             else view(sampler, kv, table, full_cached))
    session = Session(sequences=[list(s) for s in sequences], cached=cached_in.copy(), cache=cache)
    out = sampler.generate_from(session, list(max_new_tokens), rows=list(range(r)), **sampling)
    after = [int(c) for c in session.cached]
    if in_place:
        return out, kv.replace(k=session.cache.kv), after
    written = [(i, j, tables[i][j]) for i in range(r) for j in range(int(cached_in[i]) // ps, -(-after[i] // ps))]
    return out, write_back(sampler, kv, session.cache, written), after
