"""A KV cache in shared pages that the decoder writes and attends over in place.

`PagedKVCache` is the cache a sampler call runs on when the rollout engine's pages are read where
they lie (`rollout.paged_attention` "gather" or "kernel"), instead of being copied into a dense
working cache first ("view", sampler/paged.py). Row b of a call holds positions 0 .. end[b]-1 in
the pages table[b] lists: position p is slot p % ps of page table[b, p // ps].

Page layout, per layer: [N + 1, ps, 2K, Dh'] with keys at even heads (2k) and values at odd heads
(2k + 1): the layout jax's TPU kernel `ragged_paged_attention` reads, so the kernel takes the
pages with no copy. Page N is scratch: table entries no page backs point at it, and the writes of
padding tokens (a finished row's step, a chunk's right padding) land in it. Dh' is the head
dimension padded to the kernel's lane width (128) on the kernel path (the 0.5B's heads are 64
wide): zero lanes change no dot product.

Two attentions over the same pages, equal in exact arithmetic:
  - "gather" (jnp, any backend): each row's pages gathered into a dense [P * ps] run of slots and
    `ops.attend` over it: the reference for the kernel, and the path for GPUs;
  - "kernel": `ragged_paged_attention` reading the pages from HBM in place (TPU only).

On a tensor-parallel sampler's mesh the pages are split over their heads like the attention's
(`head_axis`: each chip holds its KV heads' pages and attends for its query heads); otherwise they
are replicated, and the kernel runs in `shard_map` over the rows' batch axes.

Queries of a call are a right-padded block [B, T] (a prefill chunk, or T = 1 while decoding): row
b's query t sits at position end[b] + t and attends to positions <= its own. Padding queries see
stale slots; their outputs are never used.

A ragged step (`RaggedKVCache`, `rollout.max_tokens_per_step`) is one flat run of N tokens
instead: token i belongs to row rows[i] of the table and sits at its own position, so decode
tokens of many rows and prefill chunks of a few share one forward and no token computes padding
beyond the step's bucket. Its attention (`attend_tokens`) in jnp goes in blocks of TOKEN_BLOCK
tokens: a block of one row's tokens (most of a chunk) gathers that row's pages once, a block of
several rows (decode tokens) gathers each token's row. The TPU kernel takes the run as it is (each
row's tokens contiguous, in table order: its cu_q_lens and kv_lens).

Shapes: B rows, T new tokens, N pages, ps page size, P pages per row (table width), S = P * ps,
K kv heads, G = H / K, Dh head dim, Dh' stored head dim, L layers.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from workflow_r1 import sharding
from workflow_r1.model import ops

Array = jax.Array

ATTENTIONS = ("gather", "kernel")
# The TPU kernel's accumulators are 128 lanes wide: it needs head_dim a multiple of that.
KERNEL_LANES = 128
# The kernel's blocks: key positions (whole pages) and queries per step. Given explicitly, as its
# own tuned table is looked up from the running device (none when compiling ahead of time); 512
# keys x 32 queries are its defaults' order (its table's entries hold 128 to 2,048 keys).
KV_BLOCK, Q_BLOCK = 512, 32
# Tokens of a ragged step attended together (`attend_tokens`): a block gathers its rows' pages.
TOKEN_BLOCK = 16


def head_axis(mesh: Any, num_kv_heads: int) -> str | None:
    """The mesh axis the pages' heads are split over: a tensor-parallel sampler's "tensor" axis
    when it divides the KV heads (each chip then holds and attends over its own heads' pages), or
    None (pages replicated on every device)."""
    t = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    return "tensor" if t > 1 and num_kv_heads % t == 0 else None


def page_spec(mesh: Any, num_kv_heads: int, stacked: bool) -> jax.sharding.PartitionSpec:
    """How a page array [(L,) N + 1, ps, 2K, Dh'] lies on `mesh` (see `head_axis`)."""
    lead = (None,) if stacked else ()
    return jax.sharding.PartitionSpec(*lead, None, None, head_axis(mesh, num_kv_heads), None)


def stored_head_dim(head_dim: int, attention: str) -> int:
    """Dh': the head dimension the pages store (padded to the kernel's lanes on the kernel path)."""
    return -(-head_dim // KERNEL_LANES) * KERNEL_LANES if attention == "kernel" else head_dim


@flax.struct.dataclass
class PagedKVCache:
    """Per-layer pages plus the rows' page tables.

    kv: tuple (one per layer) of [N + 1, ps, 2K, Dh'], or one stacked [L, N + 1, ps, 2K, Dh'].
    table: int32 [B, P], each row's pages in position order (N, the scratch page, where none).
    end: int32 [B], the next position of each row.
    attention: "gather" or "kernel" (static).
    """

    kv: Any
    table: Array
    end: Array
    attention: str = flax.struct.field(pytree_node=False, default="gather")

    @property
    def stacked(self) -> bool:
        return not isinstance(self.kv, tuple)

    @property
    def page_size(self) -> int:
        return (self.kv if self.stacked else self.kv[0]).shape[-3]

    @property
    def size(self) -> int:
        """Slots a row can reach: its table's pages."""
        return self.table.shape[1] * self.page_size

    def layer(self, pages: Array) -> "LayerPages":
        return LayerPages(pages=pages, table=self.table, attention=self.attention)


@flax.struct.dataclass
class RaggedKVCache:
    """Pages plus the table of a ragged step's rows: the forward's tokens are one flat run [1, N].

    kv: as `PagedKVCache.kv`. table: int32 [R, P], the step's rows' pages (N, the scratch page,
    where none). rows: int32 [N], the table row of each token (padding tokens repeat their
    predecessor's row and are masked out of the writes). Each token's position is the forward's
    own `positions` (its slot in its row's pages).
    """

    kv: Any
    table: Array
    rows: Array
    # The kernel's view of the same run (its `ragged_paged_attention` arguments): each table row's
    # tokens are contiguous and in table order; kv_lens [R] (its positions after the step),
    # cu_q_lens [R + 1] (where its tokens start in the run), num_seqs [1] (rows in use).
    kv_lens: Array | None = None
    cu_q_lens: Array | None = None
    num_seqs: Array | None = None
    attention: str = flax.struct.field(pytree_node=False, default="gather")
    block: int = flax.struct.field(pytree_node=False, default=TOKEN_BLOCK)   # attend_tokens' block

    @property
    def stacked(self) -> bool:
        return not isinstance(self.kv, tuple)

    def layer(self, pages: Array) -> "LayerPages":
        return LayerPages(pages=pages, table=self.table, attention=self.attention, rows=self.rows, block=self.block,
                          ragged=(self.kv_lens, self.cu_q_lens, self.num_seqs))


@flax.struct.dataclass
class LayerPages:
    """What one decoder layer reads and writes: its pages [N + 1, ps, 2K, Dh'] and the rows' tables;
    `rows` [N] for a ragged step (`RaggedKVCache`), None for a block of rows."""

    pages: Array
    table: Array
    attention: str = flax.struct.field(pytree_node=False, default="gather")
    rows: Array | None = None
    block: int = flax.struct.field(pytree_node=False, default=TOKEN_BLOCK)
    ragged: Any = None   # (kv_lens, cu_q_lens, num_seqs) of a ragged step, for the kernel


def write(pages: Array, k: Array, v: Array, table: Array, start: Array, mask: Array) -> Array:
    """pages with row b's token t (k, v [B, T, K, Dh]) at position start[b] + t; tokens where
    mask [B, T] is False (padding) go to the scratch page instead. The block as a flat run of B x T
    tokens (`write_tokens`)."""
    b, t, kh, dh = k.shape
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    pos = (start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]).reshape(-1)
    return write_tokens(pages, k.reshape(b * t, kh, dh), v.reshape(b * t, kh, dh), table, rows, pos, mask.reshape(-1))


def write_tokens(pages: Array, k: Array, v: Array, table: Array, rows: Array, positions: Array,
                 mask: Array) -> Array:
    """pages with token i (k, v [N, K, Dh]) at position positions[i] of row rows[i] of `table`;
    tokens where mask [N] is False (padding) go to the scratch page instead."""
    n1, ps, k2, dhp = pages.shape
    n, kh, dh = k.shape
    kv = jnp.stack([k, v], axis=2).reshape(n, k2, dh).astype(pages.dtype)   # k0, v0, k1, v1, ...
    if dhp != dh:
        kv = jnp.pad(kv, ((0, 0),) * 2 + ((0, dhp - dh),))
    col = jnp.minimum(positions // ps, table.shape[1] - 1)
    page = jnp.where(mask, table[rows, col], n1 - 1)
    flat = page * ps + positions % ps
    return pages.reshape(n1 * ps, k2, dhp).at[flat].set(kv).reshape(pages.shape)


def attend_tokens(q: Array, layer: LayerPages, positions: Array, head_dim: int, dtype: Any) -> Array:
    """q [N, H, Dh] (roped) -> [N, H, Dh]: token i over row layer.rows[i]'s positions <= its own,
    read from the pages (this step's tokens written already). N is a multiple of layer.block.

    Blocks of layer.block tokens under `lax.map`, so a step holds one block's gathered keys at a
    time: a block whose tokens are all one row's gathers that row's pages once ([1, S] keys for its
    queries); any other block gathers each token's row ([TOKEN_BLOCK, S] keys, one query each).
    Both branches compute each query's scores over the same S slots, masked by position.
    """
    if layer.attention == "kernel":
        return _kernel_tokens(q, layer, head_dim)
    if layer.attention != "gather":
        raise ValueError(f"paged attention {layer.attention!r} unknown; use one of {ATTENTIONS}")
    n, h, _ = q.shape
    n1, ps, k2, dhp = layer.pages.shape
    kh, blk = k2 // 2, layer.block
    g = h // kh

    def keys(table_rows: Array) -> tuple[Array, Array]:
        dense = layer.pages[table_rows].reshape(table_rows.shape[0], -1, k2, dhp)[..., :head_dim]
        return dense[:, :, 0::2].astype(q.dtype), dense[:, :, 1::2].astype(q.dtype)

    def one(args: tuple[Array, Array, Array]) -> Array:
        qb, rb, pb = args                                             # [blk, H, Dh], [blk], [blk]

        def shared() -> Array:
            k, v = keys(layer.table[rb[:1]])                          # [1, S, K, Dh]
            valid = jnp.ones(k.shape[:2], bool)
            return ops.attend(qb.reshape(1, blk, kh, g, head_dim), k, v, valid, pb[None], dtype).reshape(blk, h, -1)

        def each() -> Array:
            k, v = keys(layer.table[rb])                              # [blk, S, K, Dh]
            valid = jnp.ones(k.shape[:2], bool)
            return ops.attend(qb.reshape(blk, 1, kh, g, head_dim), k, v, valid, pb[:, None], dtype).reshape(blk, h, -1)

        return jax.lax.cond(jnp.all(rb == rb[0]), shared, each)

    blocks = (q.reshape(n // blk, blk, h, head_dim), layer.rows.reshape(-1, blk), positions.reshape(-1, blk))
    return jax.lax.map(one, blocks).reshape(n, h, head_dim)


def attend(q: Array, layer: LayerPages, start: Array, head_dim: int, dtype: Any,
           query_block: int | None = None) -> Array:
    """q [B, T, H, Dh] (roped) -> [B, T, H, Dh]: each query over its row's positions <= its own,
    read from `layer`'s pages (written for this call's tokens already)."""
    if layer.attention == "kernel":
        return _kernel(q, layer, start, head_dim)
    if layer.attention != "gather":
        raise ValueError(f"paged attention {layer.attention!r} unknown; use one of {ATTENTIONS}")
    b, t, h, _ = q.shape
    n1, ps, k2, dhp = layer.pages.shape
    dense = layer.pages[layer.table].reshape(b, -1, k2, dhp)[..., :head_dim]   # [B, S, 2K, Dh]
    k, v = dense[:, :, 0::2], dense[:, :, 1::2]
    slots = jnp.arange(dense.shape[1], dtype=jnp.int32)
    query_slots = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    key_valid = slots[None, :] < (start + t)[:, None]
    qg = q.reshape(b, t, k2 // 2, h // (k2 // 2), head_dim)
    return ops.attend(qg, k.astype(q.dtype), v.astype(q.dtype), key_valid, query_slots, dtype,
                      query_block).reshape(b, t, h, head_dim)


def _kernel_tokens(q: Array, layer: LayerPages, head_dim: int) -> Array:
    """The TPU kernel over a ragged step's flat run q [N, H, Dh]: sequence r's tokens are
    q[cu_q_lens[r]:cu_q_lens[r + 1]], its last positions before kv_lens[r] (the kernel's own
    input). Under a tensor-parallel mesh, in `shard_map` over the pages' heads."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    def run(q, pages, table, kv_lens, cu_q_lens, num_seqs):
        n, h, _ = q.shape
        ps, dhp = pages.shape[1], pages.shape[-1]
        qp = jnp.pad(q, ((0, 0),) * 2 + ((0, dhp - head_dim),)) if dhp != head_dim else q
        out = ragged_paged_attention(
            qp.astype(pages.dtype), pages, kv_lens, table, cu_q_lens, num_seqs, sm_scale=head_dim ** -0.5,
            num_kv_pages_per_block=max(1, min(table.shape[1], KV_BLOCK // ps)),
            num_queries_per_block=min(n, Q_BLOCK))
        return out[..., :head_dim].astype(q.dtype)

    args = (q, layer.pages, layer.table, *layer.ragged)
    mesh = sharding.current_mesh()
    if mesh is None or mesh.size == 1:
        return run(*args)
    # A Mosaic kernel is not partitioned by XLA: in shard_map, over the pages' heads where the
    # mesh splits them, else every device runs it on the whole (replicated) run.
    heads = head_axis(mesh, layer.pages.shape[2] // 2)
    spec = jax.sharding.PartitionSpec
    return jax.shard_map(run, mesh=mesh, in_specs=(spec(None, heads), spec(None, None, heads)) + (spec(),) * 4,
                         out_specs=spec(None, heads), check_vma=False)(*args)


def _kernel(q: Array, layer: LayerPages, start: Array, head_dim: int) -> Array:
    """The TPU kernel over the block: every row's T queries are its last T positions (kv_len =
    start + T), one sequence per row. Under a mesh the rows are split over its batch axes."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    def rows(q, pages, table, start):
        b, t, h, _ = q.shape
        ps, dhp = pages.shape[1], pages.shape[-1]
        qp = jnp.pad(q, ((0, 0),) * 3 + ((0, dhp - head_dim),)) if dhp != head_dim else q
        out = ragged_paged_attention(
            qp.reshape(b * t, h, dhp).astype(pages.dtype), pages, (start + t).astype(jnp.int32),
            table.astype(jnp.int32), (jnp.arange(b + 1, dtype=jnp.int32) * t), jnp.array([b], jnp.int32),
            sm_scale=head_dim ** -0.5, num_kv_pages_per_block=max(1, min(table.shape[1], KV_BLOCK // ps)),
            num_queries_per_block=min(b * t, Q_BLOCK))
        return out.reshape(b, t, h, dhp)[..., :head_dim].astype(q.dtype)

    mesh = sharding.current_mesh()
    if mesh is None or mesh.size == 1:
        return rows(q, layer.pages, layer.table, start)
    # A Mosaic kernel is not partitioned by XLA: always in shard_map on a mesh (replicated where
    # neither the rows' batch axes nor the pages' heads are split).
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape and mesh.shape[a] > 1) or None
    heads = head_axis(mesh, layer.pages.shape[2] // 2)
    spec = jax.sharding.PartitionSpec
    return jax.shard_map(rows, mesh=mesh, in_specs=(spec(axes, None, heads), spec(None, None, heads), spec(axes),
                                                    spec(axes)),
                         out_specs=spec(axes, None, heads), check_vma=False)(q, layer.pages, layer.table, start)
