"""Qwen2 / Qwen2.5 decoder in Flax NNX, numerically aligned with HF `modeling_qwen2.py`.

Shapes: B batch, T new tokens, S cache slots (or T without a cache), D hidden, H query heads,
K kv heads, G = H // K, Dh head dim, M mlp width, V vocab.

Masks are driven by explicit data, never by assumptions about padding side:
- `positions` [B, T] are the RoPE positions (left-padded rows simply start later).
- `input_mask` [B, T] marks real tokens; padding is never attended to.
- Causality is by slot order: a query attends to valid keys written at or before its own slot.
- Packed rows (no cache): `segment_ids` [B, T] int (0 = padding) put several sequences in one row;
  a query then attends only to keys of its own segment, and `positions` restart at 0 for each
  segment (`positions_from_segments`). Inside the layers the segment ids travel as `key_valid`
  itself (int instead of bool, see `ops.attention_mask`), so no layer signature changes.
With a KV cache, row b writes its T new tokens at slots end[b] .. end[b]+T-1, so rows advance
independently (multi-turn rows can be continued with different lengths).

Numerics: RMSNorm, RoPE, softmax and logits are fp32 whatever the compute dtype.

Layers: unrolled (`layers` is a list of L DecoderLayers, params `layers/i/...`) or, with
`scan_layers=True`, one DecoderLayer whose params carry a leading [L] axis (logical axis "layers",
params `layers/...`) run under `jax.lax.scan`: the same numbers, but the compiled program holds one
layer's body instead of L copies, so compile time and compiler memory do not grow with depth.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from workflow_r1 import sharding
from workflow_r1.model import mixed, ops, paged_kv
from workflow_r1.model import splash
from workflow_r1.model.config import Qwen2Config

Array = jax.Array


@flax.struct.dataclass
class KVCache:
    """Per-layer key/value buffers plus slot bookkeeping.

    k, v: tuple (one per layer) of [B, S, K, Dh] in the compute dtype; for a model with scanned
      layers, one stacked array [L, B, S, K, Dh] each (`stacked`).
    valid: [B, S] bool, True where a real token was written.
    end: [B] int32, the next free slot of each row.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    valid: Array
    end: Array

    @property
    def size(self) -> int:
        return self.valid.shape[1]

    @property
    def stacked(self) -> bool:
        """True when k and v are single [L, ...] arrays (a model with scanned layers)."""
        return not isinstance(self.k, tuple)

    @classmethod
    def init(cls, cfg: Qwen2Config, batch: int, size: int, dtype: Any = jnp.float32, *,
             k_shape: tuple[int, ...] | None = None, v_shape: tuple[int, ...] | None = None,
             stacked: bool = False) -> "KVCache":
        """An empty cache of `size` slots per row: k/v [B, S, K, Dh], written with `ops.write_rows` on axis 1.

        k_shape / v_shape: another layout of the same slots per layer (the sampler's CPU path keeps
        its own, see sampler/fused_cpu.py). stacked: one [L, B, S, K, Dh] array each for k and v
        (the layout a model with `scan_layers` reads).
        """
        shape = (batch, size, cfg.num_kv_heads, cfg.head_dim)
        if stacked:
            return cls(k=jnp.zeros((cfg.num_layers,) + (k_shape or shape), dtype),
                       v=jnp.zeros((cfg.num_layers,) + (v_shape or shape), dtype),
                       valid=jnp.zeros((batch, size), bool), end=jnp.zeros((batch,), jnp.int32))
        return cls(k=tuple(jnp.zeros(k_shape or shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(v_shape or shape, dtype) for _ in range(cfg.num_layers)),
                   valid=jnp.zeros((batch, size), bool), end=jnp.zeros((batch,), jnp.int32))


CACHE_AXES = ("batch", "cache_length", "kv_heads", "head_dim")
STACKED_CACHE_AXES = ("layers",) + CACHE_AXES


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype: Any, init: str = "normal"):
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype: Any, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (dim,), (None,), param_dtype, "ones")

    def __call__(self, x: Array) -> Array:
        return ops.rms_norm(x, self.scale[...], self.eps)


# Sequences longer than this attend in query blocks (see `ops.attend`); shorter ones are unaffected.
QUERY_BLOCK = 1024
# Without a cache (training, scoring), sequences longer than this attend in causal blocks of this
# many queries (more for long sequences; see `ops.attend`), each skipping its future keys: those
# scores are masked anyway. Smaller blocks skip more of them but run more, smaller products; 128 is
# where the two balanced for the 0.5B in bf16 on a CPU (64 and 256 were both slower per layer).
CAUSAL_BLOCK = 128


def project(module: nnx.Module, name: str, spec: str, x: Array, dtype: Any) -> Array:
    """x times the module's `{name}_kernel` by `spec`, in compute dtype `dtype`, plus the LoRA update of
    its `{name}_lora` adapter when it has one (model/lora.py)."""
    y = mixed.einsum(spec, x, getattr(module, f"{name}_kernel")[...], dtype)
    adapter = getattr(module, f"{name}_lora", None)
    return y if adapter is None else y + adapter(x, dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 query_block: int | None = QUERY_BLOCK):
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.dtype, self.query_block = cfg, dtype, query_block
        # Attention without a cache (training, scoring): "auto" | "jnp" | "splash" (`use_attention`).
        self.attention = "auto"
        self.q_kernel = _param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), param_dtype)
        self.q_bias = _param(rngs, (h, dh), ("heads", "head_dim"), param_dtype, "zeros")
        self.k_kernel = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.k_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), param_dtype, "zeros")
        self.v_kernel = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), param_dtype, "zeros")
        self.o_kernel = _param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), param_dtype)

    def __call__(self, x: Array, positions: Array, key_valid: Array, query_slots: Array,
                 cache_kv: tuple[Array, Array] | None, write_start: Array | None):
        """x [B, T, D] -> out [B, T, D], updated (k, v) cache buffers or None.

        key_valid [B, S] and query_slots [B, T] define the mask (see module docstring).
        """
        cfg, dt = self.cfg, self.dtype
        q = mixed.add(project(self, "q", "btd,dhk->bthk", x, dt), self.q_bias[...])
        k = mixed.add(project(self, "k", "btd,dhk->bthk", x, dt), self.k_bias[...])
        v = mixed.add(project(self, "v", "btd,dhk->bthk", x, dt), self.v_bias[...])
        q = ops.rope(q, positions, cfg.rope_theta)
        k = ops.rope(k, positions, cfg.rope_theta)
        q = sharding.constrain(q, ("batch", "length", "heads", "head_dim"))
        if isinstance(cache_kv, paged_kv.LayerPages) and cache_kv.rows is not None:
            # A ragged step: x is one flat run [1, N] of tokens of many rows (paged_kv.RaggedKVCache).
            pages = paged_kv.write_tokens(cache_kv.pages, k[0], v[0], cache_kv.table, cache_kv.rows, positions[0],
                                          key_valid[0])
            layer = cache_kv.replace(pages=pages)
            out = paged_kv.attend_tokens(q[0], layer, positions[0], cfg.head_dim, dt)[None]
            return project(self, "o", "bthk,hkd->btd", out, dt), layer
        if isinstance(cache_kv, paged_kv.LayerPages):
            # key_valid is the input mask here: padding tokens write to the scratch page.
            pages = paged_kv.write(cache_kv.pages, k, v, cache_kv.table, write_start, key_valid)
            layer = cache_kv.replace(pages=pages)
            out = paged_kv.attend(q, layer, write_start, cfg.head_dim, dt, self.query_block)
            return project(self, "o", "bthk,hkd->btd", out, dt), layer
        if cache_kv is not None:
            k = ops.write_rows(cache_kv[0], k.astype(cache_kv[0].dtype), write_start)
            v = ops.write_rows(cache_kv[1], v.astype(cache_kv[1].dtype), write_start)
            k = sharding.constrain(k, CACHE_AXES)
            v = sharding.constrain(v, CACHE_AXES)
            new_cache = (k, v)
        else:
            new_cache = None
        b, t, h, dh = q.shape
        kh = cfg.num_kv_heads
        qg = q.reshape(b, t, kh, h // kh, dh)
        # Without a cache the queries are the sequence itself (query_slots = arange(T), see
        # `Qwen2.hidden_states`), so the causal blocks apply.
        causal_block = CAUSAL_BLOCK if cache_kv is None else None
        impl = splash.resolve(self.attention) if cache_kv is None else "jnp"
        out = ops.attend(qg, k, v, key_valid, query_slots, dt, self.query_block, causal_block,
                         impl=impl).reshape(b, t, h, dh)
        out = project(self, "o", "bthk,hkd->btd", out, dt)
        return out, new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.gate_kernel = _param(rngs, (d, m), ("embed", "mlp"), param_dtype)
        self.up_kernel = _param(rngs, (d, m), ("embed", "mlp"), param_dtype)
        self.down_kernel = _param(rngs, (m, d), ("mlp", "embed"), param_dtype)

    def __call__(self, x: Array) -> Array:
        dt = self.dtype
        g = project(self, "gate", "btd,dm->btm", x, dt)
        u = project(self, "up", "btd,dm->btm", x, dt)
        h = sharding.constrain(mixed.swiglu(g, u), ("batch", "length", "mlp"))
        return project(self, "down", "btm,md->btd", h, dt)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen2Config, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, key_valid, query_slots, cache_kv, write_start):
        h, new_kv = self.attn(self.input_norm(x), positions, key_valid, query_slots, cache_kv, write_start)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x))
        return sharding.constrain(x, ("batch", "length", "embed")), new_kv


def _layer_forward(layer, x, positions, key_valid, query_slots, cache_kv, write_start):
    return layer(x, positions, key_valid, query_slots, cache_kv, write_start)


def _apply_layer(graphdef: Any, state: Any, x: Array, positions: Array, key_valid: Array,
                 query_slots: Array) -> Array:
    return nnx.merge(graphdef, state)(x, positions, key_valid, query_slots, None, None)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_layer(graphdef: Any, state: Any, x: Array, positions: Array, key_valid: Array,
                 query_slots: Array) -> Array:
    """One decoder layer (no cache) whose activations are recomputed in the backward pass.

    Only the layer's input is kept between the passes. `jax.checkpoint` expresses the same thing,
    but XLA:CPU expands its optimization barriers before common-subexpression elimination, which
    then merges the recomputation back into the forward pass and keeps every activation alive
    (measured: a 24-layer MLP stack took 1.99 GB with or without it; 0.17 GB with this). Here the
    recomputation depends on the incoming cotangent (`x + 0 * ct`), so no compiler can hoist it.
    """
    return _apply_layer(graphdef, state, x, positions, key_valid, query_slots)


def _remat_layer_fwd(graphdef, state, x, positions, key_valid, query_slots):
    return _apply_layer(graphdef, state, x, positions, key_valid, query_slots), (state, x, positions, key_valid,
                                                                                 query_slots)


def _remat_layer_bwd(graphdef, residuals, ct):
    state, x, positions, key_valid, query_slots = residuals
    x = x + (0.0 * ct[:, :1, :1]).astype(x.dtype)  # not foldable for floats (0 * inf is nan)
    _, vjp = jax.vjp(functools.partial(_apply_layer, graphdef), state, x, positions, key_valid, query_slots)
    return vjp(ct)


_remat_layer.defvjp(_remat_layer_fwd, _remat_layer_bwd)


def _layer_forward_remat(layer, x, positions, key_valid, query_slots, cache_kv, write_start):
    if cache_kv is not None:  # decoding with a cache is never differentiated
        return _layer_forward(layer, x, positions, key_valid, query_slots, cache_kv, write_start)
    graphdef, state = nnx.split(layer)
    return _remat_layer(graphdef, state, x, positions, key_valid, query_slots), None


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """L identical-structure layers -> one DecoderLayer whose params are stacked [L, ...], with the
    logical axis "layers" in front of each param's axes (replicated: see sharding.LOGICAL_RULES)."""
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def one(*vs: nnx.Variable) -> nnx.Variable:
        axes = vs[0].get_metadata().get("axes")
        return vs[0].replace(jnp.stack([v.get_value() for v in vs]),
                             **({"axes": ("layers",) + tuple(axes)} if axes is not None else {}))

    return nnx.merge(graphdef, jax.tree.map(one, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def layer_params(params: Any, i: int, stacked: bool) -> Any:
    """Layer i's parameters from the model's `layers` state (an nnx.State or its dict): its own
    subtree when unrolled, the i-th slice of every stacked array when scanned."""
    if not stacked:
        return params[i]

    def take(v: Any) -> Any:
        return v.replace(v.get_value()[i]) if isinstance(v, nnx.Variable) else v[i]

    return jax.tree.map(take, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Qwen2(nnx.Module):
    """Qwen2 causal LM. `__call__(tokens, positions, ...) -> (logits fp32 [B, T, V], cache)`.

    scan_layers: stack the layers' params [L, ...] and run them under `jax.lax.scan` (see the
    module docstring); the same random init as the unrolled model for the same seed.
    """

    def __init__(self, cfg: Qwen2Config, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 remat: bool = False, scan_layers: bool = False, rngs: nnx.Rngs):
        self.cfg, self.dtype, self.remat, self.scan_layers = cfg, dtype, remat, scan_layers
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)
        layers = [DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(cfg.num_layers)]
        self.layers = stack_layers(layers) if scan_layers else nnx.List(layers)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def hidden_states(self, tokens: Array, positions: Array, *, input_mask: Array | None = None,
                      cache: KVCache | None = None,
                      segment_ids: Array | None = None) -> tuple[Array, KVCache | None]:
        """tokens, positions [B, T] int -> final-normed hidden states [B, T, D] (compute dtype), cache.

        segment_ids: [B, T] int, packed rows (no cache): 1, 2, ... per sequence, 0 on padding; a
        token attends only to earlier tokens of its own segment. positions should then restart at
        0 per segment (`positions_from_segments`). None: one sequence per row.
        """
        b, t = tokens.shape
        if input_mask is None:
            input_mask = jnp.ones((b, t), bool)
        input_mask = input_mask.astype(bool)
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed rows) work without a KV cache only; unpack the rows to decode")
            # Int key_valid = segment ids: `ops.attention_mask` then keeps each segment to itself.
            input_mask = jnp.where(input_mask, segment_ids.astype(jnp.int32), 0)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        x = sharding.constrain(x, ("batch", "length", "embed"))
        if isinstance(cache, (paged_kv.PagedKVCache, paged_kv.RaggedKVCache)):
            return self._hidden_paged(x, positions, input_mask, cache)
        if cache is None:
            key_valid = input_mask
            query_slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            write_start = None
        else:
            write_start = cache.end
            query_slots = write_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            key_valid = ops.write_rows(cache.valid, input_mask, write_start)
        forward = _layer_forward_remat if self.remat else _layer_forward
        if self.scan_layers:
            x, new_k, new_v = self._scanned(forward, x, positions, key_valid, query_slots, cache, write_start)
        else:
            new_k, new_v = [], []
            for i, layer in enumerate(self.layers):
                kv = None if cache is None else (cache.k[i], cache.v[i])
                x, new_kv = forward(layer, x, positions, key_valid, query_slots, kv, write_start)
                if new_kv is not None:
                    new_k.append(new_kv[0])
                    new_v.append(new_kv[1])
            new_k, new_v = tuple(new_k), tuple(new_v)
        x = self.final_norm(x)
        if cache is not None:
            cache = KVCache(k=new_k, v=new_v, valid=key_valid, end=cache.end + t)
        return x, cache

    def _scanned(self, forward, x, positions, key_valid, query_slots, cache, write_start):
        """The stacked layers under `lax.scan`: x [B, T, D] -> (x, new k [L, ...], new v [L, ...]).

        The cache rides in the carry and each layer's slot is updated in place
        (dynamic_update_index), so a donated cache is not copied; without a cache the params are
        the scanned-over inputs and x the only carry.
        """
        graphdef, state = nnx.split(self.layers)
        if cache is None:
            def body(h, layer_state):
                return forward(nnx.merge(graphdef, layer_state), h, positions, key_valid, query_slots, None,
                               None)[0], None

            x, _ = jax.lax.scan(body, x, state)
            return x, None, None
        if not cache.stacked:
            raise ValueError("a model with scan_layers reads a stacked KV cache: KVCache.init(..., stacked=True) "
                             "or model.init_cache")

        def body_kv(carry, xs):
            h, k_all, v_all = carry
            i, layer_state = xs
            kv = (jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False),
                  jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False))
            h, (k, v) = forward(nnx.merge(graphdef, layer_state), h, positions, key_valid, query_slots, kv,
                                write_start)
            k_all = sharding.constrain(jax.lax.dynamic_update_index_in_dim(k_all, k, i, 0), STACKED_CACHE_AXES)
            v_all = sharding.constrain(jax.lax.dynamic_update_index_in_dim(v_all, v, i, 0), STACKED_CACHE_AXES)
            return (h, k_all, v_all), None

        (x, k, v), _ = jax.lax.scan(body_kv, (x, cache.k, cache.v),
                                    (jnp.arange(self.cfg.num_layers, dtype=jnp.int32), state))
        return x, k, v

    def _hidden_paged(self, x: Array, positions: Array, input_mask: Array,
                      cache: paged_kv.PagedKVCache | paged_kv.RaggedKVCache) -> tuple[Array, Any]:
        """`hidden_states` over a paged cache: each layer writes its tokens into its pages and attends
        over them in place (the layers see the input mask where a dense cache passes key_valid).
        A ragged step's tokens carry their own positions (no row ends to advance)."""
        ragged = isinstance(cache, paged_kv.RaggedKVCache)
        start = None if ragged else cache.end
        if self.scan_layers:
            if not cache.stacked:
                raise ValueError("a model with scan_layers reads stacked pages (one [L, ...] array)")
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                h, kv_all = carry
                i, layer_state = xs
                pages = jax.lax.dynamic_index_in_dim(kv_all, i, 0, keepdims=False)
                h, layer = _layer_forward(nnx.merge(graphdef, layer_state), h, positions, input_mask, None,
                                          cache.layer(pages), start)
                return (h, jax.lax.dynamic_update_index_in_dim(kv_all, layer.pages, i, 0)), None

            (x, kv), _ = jax.lax.scan(body, (x, cache.kv),
                                      (jnp.arange(self.cfg.num_layers, dtype=jnp.int32), state))
        else:
            if cache.stacked:
                raise ValueError("a model with unrolled layers reads one page array per layer (a tuple)")
            kv = []
            for i, layer in enumerate(self.layers):
                x, written = _layer_forward(layer, x, positions, input_mask, None, cache.layer(cache.kv[i]), start)
                kv.append(written.pages)
            kv = tuple(kv)
        if ragged:
            return self.final_norm(x), cache.replace(kv=kv)
        return self.final_norm(x), cache.replace(kv=kv, end=cache.end + x.shape[1])

    def unembed(self) -> Array:
        """The [D, V] output projection (the transposed embedding when tied)."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits_from_hidden(self, h: Array) -> Array:
        """h [..., D] -> fp32 logits [..., V] (accumulated in fp32)."""
        w = self.unembed().astype(self.dtype)
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens: Array, positions: Array, *, input_mask: Array | None = None,
                 cache: KVCache | None = None, segment_ids: Array | None = None) -> tuple[Array, KVCache | None]:
        h, cache = self.hidden_states(tokens, positions, input_mask=input_mask, cache=cache, segment_ids=segment_ids)
        logits = sharding.constrain(self.logits_from_hidden(h), ("batch", "length", "vocab"))
        return logits, cache

    def init_cache(self, batch: int, size: int, dtype: Any | None = None) -> KVCache:
        return KVCache.init(self.cfg, batch, size, dtype or self.dtype, stacked=self.scan_layers)


def positions_from_segments(segment_ids: Array) -> Array:
    """Packed segment ids [B, T] (1, 2, ... contiguous runs, 0 = padding) -> positions [B, T]:
    0 at each segment's first token, counting up within it; 0 on padding."""
    seg = jnp.asarray(segment_ids)
    t = seg.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
    prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start = jax.lax.cummax(jnp.where(seg != prev, idx, 0), axis=1)
    return jnp.where(seg > 0, idx - start, 0).astype(jnp.int32)


def use_attention(model: nnx.Module, impl: str) -> nnx.Module:
    """`model` (in place) with its attention without a cache (training, scoring) taking `impl`:
    "auto" (jax's splash kernel where the program compiles for TPU, jnp elsewhere), "jnp" or
    "splash" (TPU only: elsewhere the trace fails with one line). See `model.splash`."""
    if impl not in splash.IMPLS:
        raise ValueError(f"model.attention={impl!r} unknown; use one of {splash.IMPLS}")
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Attention):
            module.attention = impl
    return model


def create(cfg: Qwen2Config, *, seed: int = 0, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
           remat: bool = False, scan_layers: bool = False) -> Qwen2:
    """A randomly initialised model (tests, or as the target of a checkpoint load)."""
    return Qwen2(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
                 rngs=nnx.Rngs(params=seed))


def abstract(cfg: Qwen2Config, **kw: Any) -> Qwen2:
    """The model with ShapeDtypeStruct leaves: no memory allocated (used to plan sharded loads)."""
    return nnx.eval_shape(lambda: create(cfg, **kw))


__all__ = ["Qwen2", "KVCache", "create", "abstract", "stack_layers", "layer_params",
           "positions_from_segments", "RMSNorm"]
