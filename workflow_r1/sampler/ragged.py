"""One ragged engine step: a token budget of many sequences' tokens in one forward, in place in the pages.

The rollout engine with `rollout.max_tokens_per_step` calls this instead of a decode call
(sampler/paged.py's `generate`). A step takes, for each of R sequences, its next `counts[r]`
tokens after the `cached[r]` its pages hold: one token for a sequence that is decoding (its last
sampled token), a chunk of a prompt or an observation for the others. They go through the model as
one flat run (`paged_kv.RaggedKVCache`): each token is written into its sequence's pages at its
own position and attends to that sequence's positions up to its own. A sequence whose tokens are
all written by the step (its pending run ends here) samples one token from the logits after its
last one, with its own keys (seed, row id, step), as a decode call would; the others sample nothing
and continue with the next step.

So a step computes its tokens and nothing else: no row padding, no sequence waiting for the
executor, no finished row. The only padding is the flat run's bucket (a power of two: a full step
of a power-of-two budget is exactly its bucket).

Layout on the host (`plan`, `layout`): the decoding sequences' tokens first, one each, then the
chunks, each contiguous, so most of a chunk's attention blocks are its own row's. The table's
rows are in the run's order, each with its kv_lens and cu_q_lens: the TPU kernel's own input.
Compiled shapes: the run's length N (powers of two), the table's pages per row P (powers of two,
capped at a longest row); the table's rows (`max_rows` rounded up to a power of two) and the
sampled rows S = min(N, those) are fixed per rollout. The `local` run compiles 8 shapes, each
greedy (evaluation) and sampled (training).

Shapes: R sequences of the step, N flat tokens, P pages per table row, S sampled rows, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from workflow_r1.model import paged_kv
from workflow_r1.sampler import device_cache, fused_cpu, loop, sampling
from workflow_r1.sampler.paged import KVPages, working_pages
from workflow_r1.sampler.session import SampleOutput, SamplerError, _pow2_at_least


def plan(pending: list[int], budget: int) -> list[int]:
    """How many of its pending tokens each sequence writes in a step of at most `budget` tokens (0:
    none this step): decoding sequences (one pending token) first, one each, then chunks of the
    others in order."""
    counts = [0] * len(pending)
    left = budget
    for single in (True, False):
        for i, p in enumerate(pending):
            if left and (p == 1) == single:
                counts[i] = min(p, left)
                left -= counts[i]
    return counts


def layout(counts: np.ndarray, block: int = paged_kv.TOKEN_BLOCK, min_len: int = 1) -> tuple[np.ndarray, int, int]:
    """Where each sequence's tokens go in the flat run: (first slot [R], length N, attention block).

    Sequences with one token first, then the chunks, each contiguous. N is a power of two (at least
    `min_len`); the attention block is `block`, or N when that is shorter. A chunk's blocks are its
    own row's but for the two at its ends (paged_kv.attend_tokens gathers per token there).
    """
    order = np.concatenate([np.flatnonzero(counts == 1), np.flatnonzero(counts > 1)])
    first = np.zeros(len(counts), np.int64)
    first[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]]) if len(order) else []
    n = _pow2_at_least(int(counts.sum()), min_len)
    return first, n, min(block, n)


def step_impl(impl: loop.Impl, weights: Any, kv: Any, run: tuple[jax.Array, ...], sample_at: jax.Array,
              temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seeds: jax.Array, row_ids: jax.Array,
              steps: jax.Array, *, attention: str, block: int, greedy: bool, top_k_bucket: int,
              use_top_p: bool) -> tuple[jax.Array, jax.Array, Any]:
    """run: table [R', P]; tokens, positions, rows (table row), mask [N]; kv_lens [R'], cu_q_lens
    [R' + 1], num_seqs [1] (the kernel's view, paged_kv.RaggedKVCache). sample_at [S] flat indices
    -> the token and its log-prob sampled after each sample_at[s] (keys seeds/row_ids/steps [S]) and
    the pages with the step's tokens written. kv: the model path's pages (`KVPages.k`), or the
    fused CPU path's (k, v) page tuples."""
    table, tokens, positions, rows, mask, kv_lens, cu_q_lens, num_seqs = run
    if impl.kind == "fused_cpu":
        h, k, v = fused_cpu.hidden_ragged(impl.cfg, impl.dtype, weights, tokens, positions, rows, mask, *kv, table,
                                          block)
        kv, h = (k, v), h[None]
    else:
        model = nnx.merge(impl.graphdef, weights)
        cache = paged_kv.RaggedKVCache(kv=kv, table=table, rows=rows, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                                       num_seqs=num_seqs, attention=attention, block=block)
        h, cache = model.hidden_states(tokens[None], positions[None], input_mask=mask[None], cache=cache)
        kv = cache.kv
    logits_vb = loop.logits_t(impl, weights, h[0, sample_at])                     # [V, S]
    tok, lp = sampling.sample(logits_vb, sampling.step_keys(seeds, row_ids, steps), temperature=temperature,
                              top_p=top_p, top_k=top_k, greedy=greedy, top_k_bucket=top_k_bucket,
                              use_top_p=use_top_p)
    return tok, lp, kv


_step = jax.jit(step_impl, static_argnums=(0,), donate_argnames=("kv",),
                static_argnames=("attention", "block", "greedy", "top_k_bucket", "use_top_p"))


def step(sampler: Any, kv: KVPages, tables: list[list[int]], sequences: list[list[int]], cached: list[int],
         counts: list[int], *, seed: list[int], row_ids: list[int], step_offset: list[int], temperature: float = 0.0,
         top_p: float = 1.0, top_k: int = 0, max_rows: int = 0, **_: Any) -> tuple[SampleOutput, KVPages, list[int]]:
    """One ragged step over R sequences held in `kv`, read in place: the model path's pages
    ("gather", model/paged_kv.py) or the fused CPU path's (its own cache layout, fused_cpu.py).

    tables: each sequence's pages in order, covering its positions up to cached[r] + counts[r].
    sequences: every token of each sequence (host ids); the first cached[r] are in its pages and
      the next counts[r] (>= 1) are written by this step.
    seed, row_ids, step_offset: each sequence's sampling keys for the token it may sample.
    max_rows: the most sequences a step of this rollout holds (fixes the sampled rows' shape).
    Returns, as `paged.generate` does: the generation (one token, finish "eos" or "length", for a
    sequence whose tokens the step wrote to its end; none, "paused", for the others), the pages and
    each sequence's tokens now in its pages.
    """
    fused = sampler.impl == "fused_cpu"
    if not fused and kv.attention == "view":
        raise SamplerError("a ragged step (rollout.max_tokens_per_step) on the model path reads its pages in place; "
                           "this sampler's go through a view: set rollout.paged_attention=gather (or kernel on TPU)")
    if sampler.mesh is not None and device_cache.batch_multiple(sampler.mesh) > 1:
        raise SamplerError("a ragged step runs one flat run of tokens, not rows split over the mesh's batch axes: "
                           "use rollout.tensor_parallel=-1 (a host's chips split the heads) or "
                           "rollout.max_tokens_per_step=0")
    ps, r = kv.page_size, len(sequences)
    cached_in, cnt = np.asarray(cached, np.int64), np.asarray(counts, np.int64)
    lengths = np.array([len(s) for s in sequences], np.int64)
    if (cnt < 1).any() or (cached_in + cnt > lengths).any():
        raise SamplerError(f"counts={counts} must each be >= 1 and within the sequence's pending tokens")
    first, n, block = layout(cnt, min_len=sampler._min_rows)
    # Table rows in the run's order (the kernel reads each row's tokens at cu_q_lens[row]).
    order = np.argsort(first, kind="stable")
    slot_of = np.empty(r, np.int64)
    slot_of[order] = np.arange(r)
    tokens = np.zeros(n, np.int32)
    positions = np.zeros(n, np.int32)
    mask = np.zeros(n, bool)
    rows = np.zeros(n, np.int32)
    for i in order:
        a, c = int(first[i]), int(cnt[i])
        tokens[a:a + c] = sequences[i][cached_in[i]:cached_in[i] + c]
        positions[a:a + c] = np.arange(cached_in[i], cached_in[i] + c)
        mask[a:a + c] = True
        rows[a:a + c] = slot_of[i]
    rows[int(cnt.sum()):] = r - 1   # padding: the last row's (its writes go to the scratch page)
    need = -(-int((cached_in + cnt).max()) // ps)
    p = working_pages(need, sampler.cache_size, ps)
    rp = _pow2_at_least(max(max_rows, r), 1)   # one table shape per rollout
    table = np.full((rp, p), kv.num_pages, np.int32)
    kv_lens, cu_q_lens = np.zeros(rp, np.int32), np.full(rp + 1, int(cnt.sum()), np.int32)
    for j, i in enumerate(order):
        table[j, :len(tables[i])] = tables[i][:p]
        kv_lens[j], cu_q_lens[j] = cached_in[i] + cnt[i], first[i]
    sampled = np.flatnonzero(cached_in + cnt == lengths)
    s = min(n, rp)
    sample_at = np.zeros(s, np.int32)
    sample_at[:len(sampled)] = first[sampled] + cnt[sampled] - 1
    keys = [np.zeros(s, np.int32) for _ in range(3)]
    for k, values in zip(keys, (seed, row_ids, step_offset)):
        k[:len(sampled)] = np.asarray(values, np.int64)[sampled]
    greedy = temperature == 0
    # Every input on every device of the sampler's mesh, and the step under that mesh (the kernel's
    # shard_map and the model's sharding constraints read it).
    put = lambda x: device_cache.replicated(sampler.mesh, jnp.asarray(x))  # noqa: E731
    run = tuple(put(x) for x in (table, tokens, positions, rows, mask, kv_lens, cu_q_lens, np.array([r], np.int32)))
    tok, lp, new_kv = device_cache.on_mesh(
        sampler.mesh, _step, sampler._impl, sampler._weights, (kv.k, kv.v) if fused else kv.k, run, put(sample_at),
        jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p), jnp.int32(top_k), *(put(k) for k in keys),
        attention=kv.attention, block=block, greedy=greedy,
        top_k_bucket=0 if greedy or not top_k else min(sampler.vocab_size, _pow2_at_least(top_k, 8)),
        use_top_p=(not greedy) and top_p < 1.0)
    tok, lp = np.asarray(jax.device_get(tok)), np.asarray(jax.device_get(lp))
    out = SampleOutput(tokens=[[] for _ in range(r)], logprobs=[np.zeros(0, np.float32) for _ in range(r)],
                       finish_reason=["paused"] * r)
    eos = set(sampler.eos_ids)
    for j, i in enumerate(sampled):
        t = int(tok[j])
        out.tokens[i] = [t]
        out.logprobs[i] = lp[j:j + 1].astype(np.float32)
        out.finish_reason[i] = "eos" if t in eos else "length"
    kv = kv.replace(k=new_kv[0], v=new_kv[1]) if fused else kv.replace(k=new_kv)
    return out, kv, [int(c) for c in cached_in + cnt]


__all__ = ["layout", "plan", "step"]
