"""What the sampler hands out and keeps per batch: a `Session` of rows over several turns, the
`SampleOutput` of one generation, its error type, the checks of a generation's per-row arguments,
and the bucketing of compiled lengths (powers of two) that keeps the number of compiled programs small.

Shapes: B rows of a session; token ids are int lists on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from workflow_r1.model import qwen2


# finish_reason of a row that `generate_from(stop_after=...)` returned before it finished.
PAUSED = "paused"


class SamplerError(ValueError):
    """Bad input to the sampler (empty prompts, prompt longer than the cache, unknown token id...)."""


@dataclasses.dataclass
class SampleOutput:
    """Generation result, one entry per requested row.

    tokens: generated ids per row, including the final EOS token / the token completing a stop string.
    logprobs: float32 [len(tokens[r])] per row, log p(token) under log_softmax(logits / temperature).
    finish_reason: "eos" | "stop" | "length" | "cache_full" per row.
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    finish_reason: list[str]


@dataclasses.dataclass
class Session:
    """A batch of rows being generated over several turns (see `Sampler.start`).

    sequences: every token of each row so far (prompt, generated, appended), host side.
    cached: [rows] how many leading tokens of each row are written in the KV cache; the rest are pending.
    cache: device KV cache with `padded_rows` >= rows rows and bucketed length (None until first use).
    row_offset: the global index of row 0 in the sampling keys (`sampling.row_keys`): a host that
      generates rows [o, o + rows) of a multi-host batch samples what one process would for them.
    """

    sequences: list[list[int]]
    cached: np.ndarray
    cache: qwen2.KVCache | None = None
    row_offset: int = 0

    @property
    def cache_bytes(self) -> int:
        """Device bytes of the KV cache (keys, values and slot bookkeeping; 0 before the first use)."""
        if self.cache is None:
            return 0
        return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.cache))

    @property
    def num_rows(self) -> int:
        return len(self.sequences)

    def lengths(self) -> list[int]:
        """Total tokens per row (prompt + generated + appended)."""
        return [len(s) for s in self.sequences]


# ------------------------------------------------------------------------- generate_from's arguments

def generate_args(rows: list[int], *, max_new_tokens: int | Sequence[int], temperature: float, top_p: float,
                  top_k: int, vocab_size: int, seed: Any, row_ids: Any, step_offset: Any, stop_after: int,
                  row_offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Checks `Sampler.generate_from`'s per-call arguments (a one-line SamplerError naming the bad
    one). Returns int64 [len(rows)] each: the token limits, seeds, row ids (default row_offset + row)
    and step offsets (default 0)."""
    limits = (np.full(len(rows), max_new_tokens, np.int64) if isinstance(max_new_tokens, (int, np.integer))
              else np.asarray(max_new_tokens))
    if limits.shape != (len(rows),) or not np.issubdtype(limits.dtype, np.integer) or (limits < 1).any():
        raise SamplerError(f"max_new_tokens={max_new_tokens} must be a positive int or one positive int per "
                           f"row of rows ({len(rows)})")
    if not temperature >= 0:
        raise SamplerError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise SamplerError(f"top_p={top_p} must be in (0, 1]")
    if top_k < 0 or top_k > vocab_size:
        raise SamplerError(f"top_k={top_k} must be in [0, {vocab_size}] (0 = off)")
    seeds = _per_row(seed, rows, "seed")
    ids = _per_row(row_ids, rows, "row_ids", default=[row_offset + r for r in rows])
    steps = _per_row(step_offset, rows, "step_offset", default=[0] * len(rows))
    if (seeds < 0).any() or (ids < 0).any() or (steps < 0).any():
        raise SamplerError("seed, row_ids and step_offset must be >= 0")
    if stop_after < 0:
        raise SamplerError(f"stop_after={stop_after} must be >= 0 (0 = wait for every row)")
    return limits.astype(np.int64), seeds, ids, steps


def _per_row(value: Any, rows: list[int], name: str, default: Sequence[int] | None = None) -> np.ndarray:
    """An int per row of `rows` from one int, a sequence of them, or None (-> default)."""
    if value is None:
        value = default
    if isinstance(value, (int, np.integer)):
        return np.full(len(rows), int(value), np.int64)
    out = np.asarray(value)
    if out.shape != (len(rows),) or not np.issubdtype(out.dtype, np.integer):
        raise SamplerError(f"{name}={value} must be an int or one int per row of rows ({len(rows)})")
    if (out >= 2 ** 31).any():
        raise SamplerError(f"{name} values must be < 2**31")
    return out.astype(np.int64)


# ----------------------------------------------------------------------------------------- buckets

def _pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _bucket(n: int, buckets: Sequence[int] | None, minimum: int) -> int:
    """Smallest bucket >= n (powers of two when `buckets` is None or exhausted)."""
    if buckets:
        for b in buckets:
            if b >= n:
                return b
    return _pow2_at_least(n, minimum)


# ------------------------------------------------------------------------------------ write plans

def write_plan(left: np.ndarray, padded_rows: int, *, chunk: Callable[[int], int], min_rows: int,
               sub_batches: bool) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
    """The extends that write the next chunk of every row with tokens left.

    left: int [B], tokens each row still has to write; padded_rows: the cache's rows (>= B);
    chunk(n): the bucketed chunk length for n tokens. Returns (chunk length T, rows written, cache
    rows computed: int32 [R] or None for all padded rows) per extend.

    An extend costs R x T positions whatever is written, so rows are grouped by their own chunk
    length (a row's 100-token observation does not make 31 rows with one pending token compute
    128 positions each) and each group runs on a power-of-two sub-batch of the cache (`rows` padded
    with rows that write nothing), when that computes fewer positions than one extend of every row
    at the longest chunk. Without `sub_batches` (a mesh: gathering rows of a batch sharded over
    devices would move them) it is that one extend.
    """
    rows = np.flatnonzero(left)

    def computed(n: int) -> int:
        r = _pow2_at_least(n, min_rows)
        return r if sub_batches and r < padded_rows else padded_rows

    def extend(t: int, written: np.ndarray) -> tuple[int, np.ndarray, np.ndarray | None]:
        r = computed(len(written))
        if r == padded_rows:
            return t, written, None
        others = np.setdiff1d(np.arange(padded_rows), written)[:r - len(written)]
        return t, written, np.sort(np.concatenate([written, others])).astype(np.int32)

    one = [(chunk(int(left.max())), rows)]
    groups: dict[int, list[int]] = {}
    for b in rows:
        groups.setdefault(chunk(int(left[b])), []).append(int(b))
    grouped = [(t, np.array(g)) for t, g in sorted(groups.items())]
    cost = lambda plan: sum(t * computed(len(g)) for t, g in plan)  # noqa: E731
    return [extend(t, g) for t, g in (grouped if sub_batches and cost(grouped) < cost(one) else one)]
