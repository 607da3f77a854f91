"""The sampler's jitted programs: `extend` (prefill a chunk, in every row or a few), `decode` (a
`lax.while_loop`) and `grow`.

Layout of a batch: every row owns a compact run of cache slots. Row b holds its first tokens in
slots 0 .. end[b]-1, so a token's slot equals its RoPE position and rows of different lengths need
no left padding inside the cache. `extend` writes a right-padded chunk of tokens at each row's own
end; `decode` then samples token after token, every row stopping on its own (EOS, stop string,
token limit) while the others continue, and carries its per-step state in `DecodeState`.

The programs are compiled once per static `Impl` and bucketed shape: weights are a jit argument
(new weights do not recompile) and the cache is donated, so it is updated in place.

Shapes: B batch rows (padded), T chunk length, S cache slots, D hidden, V vocabulary,
N stop strings, L output buffer length (`buf_len`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from workflow_r1.model import paged_kv, qwen2
from workflow_r1.sampler import fused_cpu, sampling

# Why a row stopped: `DecodeState.reason` holds an index into FINISH_REASONS, or RUNNING.
FINISH_REASONS = ("eos", "stop", "length", "cache_full")
EOS, STOP, LENGTH, CACHE_FULL = range(4)
RUNNING = -1


@dataclasses.dataclass(frozen=True)
class Impl:
    """Static description of the forward used inside the jitted programs (a hashable jit static arg).

    kind "model": the NNX model itself (`nnx.merge(graphdef, weights)`), weights = its nnx.State.
    kind "fused_cpu": the sampler's CPU path (fused_cpu.py), weights = `fused_cpu.weights(...)`,
    computing in `dtype` with a head-major fp32 cache.
    """

    kind: str
    graphdef: Any
    cfg: Any
    dtype: Any


def hidden(impl: Impl, weights: Any, tokens: jax.Array, positions: jax.Array, input_mask: jax.Array,
           cache: qwen2.KVCache) -> tuple[jax.Array, qwen2.KVCache]:
    """tokens/positions/input_mask [B, T] -> final-normed hidden [B, T, D] and the updated cache."""
    if impl.kind == "fused_cpu":
        return fused_cpu.hidden(impl.cfg, impl.dtype, weights, tokens, positions, input_mask, cache)
    model = nnx.merge(impl.graphdef, weights)
    return model.hidden_states(tokens, positions, input_mask=input_mask, cache=cache)


def logits_t(impl: Impl, weights: Any, h: jax.Array) -> jax.Array:
    """Hidden [B, D] -> fp32 logits, vocabulary-major [V, B] (see `fused_cpu.dense`)."""
    if impl.kind == "fused_cpu":
        return fused_cpu.logits_t(weights, h)
    logits = nnx.merge(impl.graphdef, weights).logits_from_hidden(h)              # [B, V]
    # The barrier keeps XLA from folding the transpose into the head's dot: the folded form
    # (a transposed [D, V] table as lhs) has no bf16 x bf16 -> fp32 kernel on XLA:CPU and fails
    # at run time.
    return jax.lax.optimization_barrier(logits).T


def extend_impl(impl: Impl, weights: Any, cache: qwen2.KVCache, logits: jax.Array, tokens: jax.Array,
                 counts: jax.Array, rows: jax.Array | None = None) -> tuple[jax.Array, qwen2.KVCache]:
    """Writes a right-padded chunk of tokens [B, T] (counts [B] real ones per row) at each row's end.

    Returns the logits [B, V] after each row's last real token (rows with counts == 0 keep their
    previous `logits`) and the cache with end += counts.

    rows: None, or int32 [R] distinct cache rows that `tokens` [R, T] and `counts` [R] are for. Only
    those rows go through the model (gathered, extended, scattered back), so writing a few rows'
    tokens costs R x T positions, not B x T (a row's observation does not make every row of the
    call compute its length).
    """
    if rows is not None:
        new_logits, sub = extend_impl(impl, weights, _take_rows(cache, rows), logits[rows], tokens, counts)
        return logits.at[rows].set(new_logits), _put_rows(cache, rows, sub)
    t = tokens.shape[1]
    ar = jnp.arange(t, dtype=jnp.int32)
    mask = ar[None, :] < counts[:, None]
    positions = cache.end[:, None] + ar[None, :]  # slot == position: rows are compact in the cache
    h, new_cache = hidden(impl, weights, tokens, positions, mask, cache)
    last = jnp.take_along_axis(h, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    new_logits = logits_t(impl, weights, last).T
    logits = jnp.where((counts > 0)[:, None], new_logits, logits)
    return logits, new_cache.replace(end=cache.end + counts)


@flax.struct.dataclass
class DecodeState:
    """The carry of `decode`'s `lax.while_loop`: what changes from one step to the next.

    step: int32 [], index of the next token to sample (its column in `tokens`).
    cache: the KV cache; each row's last sampled token is not written yet (it is fed next step).
    token: int32 [B], each row's last sampled token.
    done: bool [B], rows that have stopped (or never ran: limit 0).
    n_gen: int32 [B], tokens generated per row.
    reason: int32 [B], an index into FINISH_REASONS, or RUNNING.
    stop_state: int16 [B, max(N, 1)], each stop string's automaton state per row (see stop_strings.py).
    tokens: int32 [B, L], logprobs: fp32 [B, L], what each row generated so far (zero past n_gen).
    """

    step: jax.Array
    cache: qwen2.KVCache
    token: jax.Array
    done: jax.Array
    n_gen: jax.Array
    reason: jax.Array
    stop_state: jax.Array
    tokens: jax.Array
    logprobs: jax.Array


def decode_impl(impl: Impl, weights: Any, cache: qwen2.KVCache, logits: jax.Array, limit: jax.Array,
                 limit_reason: jax.Array, eos_ids: jax.Array, tables: jax.Array | None,
                 temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seeds: jax.Array,
                 row_ids: jax.Array, step_offset: jax.Array, stop_after: jax.Array, *, buf_len: int, greedy: bool,
                 top_k_bucket: int, use_top_p: bool):
    """Samples up to limit[b] tokens per row (limit 0 = row inactive), starting from `logits` [B, V].

    limit_reason [B]: reason code when a row reaches its limit (LENGTH or CACHE_FULL).
    eos_ids [E] int32; tables: int16 [N, states, V] stop-string transitions, or None.
    seeds, row_ids, step_offset: int32 [B], the sampling keys: row b's i-th token of this call uses
      `sampling.step_keys` with step step_offset[b] + i (a turn resumed in a later call keeps its keys).
    stop_after: int32 scalar; the loop ends once this many of the active rows have finished, the
      others stay RUNNING (the rollout engine takes a finished row out at once); >= B means all.
    Returns (tokens [B, L], logprobs [B, L], n_generated [B], reason [B], cache).
    The last generated token of a row is not written to the cache (it is pending).
    """
    b = logits.shape[0]
    n_stop = 0 if tables is None else tables.shape[0]
    sample = functools.partial(sampling.sample, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                               top_k_bucket=top_k_bucket, use_top_p=use_top_p)

    def pick(s: DecodeState, logits_vb: jax.Array) -> DecodeState:
        """Samples step s.step for rows not done; records it; updates the per-row stop checks."""
        i, running, stop_state = s.step, ~s.done, s.stop_state
        tok, lp = sample(logits_vb, sampling.step_keys(seeds, row_ids, step_offset + i))
        col = jnp.minimum(i, buf_len - 1)
        toks = jax.lax.dynamic_update_slice(s.tokens, jnp.where(running, tok, 0)[:, None], (0, col))
        lps = jax.lax.dynamic_update_slice(s.logprobs, jnp.where(running, lp, 0.0)[:, None], (0, col))
        n_gen = s.n_gen + running.astype(jnp.int32)
        is_eos = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
        if n_stop:
            nxt = tables[jnp.arange(n_stop)[None, :], stop_state, tok[:, None]]  # [B, N]
            is_stop = jnp.any(nxt < 0, axis=-1)
            stop_state = jnp.where(running[:, None], jnp.maximum(nxt, 0), stop_state)
        else:
            is_stop = jnp.zeros_like(is_eos)
        at_limit = n_gen >= limit
        new_reason = jnp.where(is_eos, EOS, jnp.where(is_stop, STOP, jnp.where(at_limit, limit_reason, RUNNING)))
        finished = running & (new_reason != RUNNING)
        reason = jnp.where(finished, new_reason, s.reason)
        return s.replace(step=i + 1, token=tok, done=s.done | finished, n_gen=n_gen, reason=reason,
                         stop_state=stop_state, tokens=toks, logprobs=lps)

    done0 = limit <= 0
    state = pick(DecodeState(
        step=jnp.int32(0), cache=cache, token=jnp.zeros((b,), jnp.int32), done=done0,
        n_gen=jnp.zeros((b,), jnp.int32), reason=jnp.where(done0, limit_reason, RUNNING).astype(jnp.int32),
        stop_state=jnp.zeros((b, max(n_stop, 1)), jnp.int16 if tables is None else tables.dtype),
        tokens=jnp.zeros((b, buf_len), jnp.int32), logprobs=jnp.zeros((b, buf_len), jnp.float32)), logits.T)

    idle = jnp.sum(done0)

    def cond(s: DecodeState) -> jax.Array:
        finished = jnp.sum(s.done) - idle
        return (s.step < buf_len) & jnp.any(~s.done) & (finished < stop_after)

    def body(s: DecodeState) -> DecodeState:
        running = ~s.done
        # Finished rows still flow through the batch, but write an invalid slot and keep their end.
        h, new_cache = hidden(impl, weights, s.token[:, None], s.cache.end[:, None], running[:, None], s.cache)
        s = s.replace(cache=new_cache.replace(end=s.cache.end + running.astype(jnp.int32)))
        return pick(s, logits_t(impl, weights, h[:, 0]))

    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, state.n_gen, state.reason, state.cache


def _grow_impl(cache: qwen2.KVCache, new_size: int, k_slot_axis: int, v_slot_axis: int) -> qwen2.KVCache:
    """The cache with every row's slots zero-padded to new_size (k along k_slot_axis, v along
    v_slot_axis, valid along 1; a stacked cache's [L] axis comes first)."""
    def p(x, axis):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, new_size - x.shape[axis])
        return jnp.pad(x, pad)

    if cache.stacked:
        return qwen2.KVCache(k=p(cache.k, k_slot_axis + 1), v=p(cache.v, v_slot_axis + 1), valid=p(cache.valid, 1),
                             end=cache.end)
    return qwen2.KVCache(k=tuple(p(x, k_slot_axis) for x in cache.k), v=tuple(p(x, v_slot_axis) for x in cache.v),
                         valid=p(cache.valid, 1), end=cache.end)


def _take_rows(cache: qwen2.KVCache, index: jax.Array) -> qwen2.KVCache:
    """The cache of rows `index` [R] int32 (keys, values, valid, end), in that order.

    Every layout keeps rows on axis 0 (axis 1 of a stacked cache, after its [L] axis), so one gather
    per buffer does it. A paged cache's rows are their page tables (the pages are shared).
    """
    if isinstance(cache, paged_kv.PagedKVCache):
        return cache.replace(table=cache.table[index], end=cache.end[index])
    if cache.stacked:
        return qwen2.KVCache(k=cache.k[:, index], v=cache.v[:, index], valid=cache.valid[index],
                             end=cache.end[index])
    return qwen2.KVCache(k=tuple(x[index] for x in cache.k), v=tuple(x[index] for x in cache.v),
                         valid=cache.valid[index], end=cache.end[index])


def _put_rows(cache: qwen2.KVCache, index: jax.Array, rows: qwen2.KVCache) -> qwen2.KVCache:
    """`cache` with its rows `index` [R] (distinct) replaced by the R rows of `rows`."""
    if isinstance(cache, paged_kv.PagedKVCache):  # the pages the rows wrote, and their ends
        return cache.replace(kv=rows.kv, end=cache.end.at[index].set(rows.end))
    if cache.stacked:
        k, v = cache.k.at[:, index].set(rows.k), cache.v.at[:, index].set(rows.v)
    else:
        k = tuple(x.at[index].set(y) for x, y in zip(cache.k, rows.k))
        v = tuple(x.at[index].set(y) for x, y in zip(cache.v, rows.v))
    return qwen2.KVCache(k=k, v=v, valid=cache.valid.at[index].set(rows.valid), end=cache.end.at[index].set(rows.end))


extend = jax.jit(extend_impl, static_argnums=(0,), donate_argnames=("cache", "logits"))
decode = jax.jit(decode_impl, static_argnums=(0,), donate_argnames=("cache",),
                 static_argnames=("buf_len", "greedy", "top_k_bucket", "use_top_p"))
grow = jax.jit(_grow_impl, static_argnames=("new_size", "k_slot_axis", "v_slot_axis"))


__all__ = ["CACHE_FULL", "EOS", "FINISH_REASONS", "LENGTH", "RUNNING", "STOP", "DecodeState", "Impl", "decode",
           "extend", "grow", "hidden", "logits_t"]
