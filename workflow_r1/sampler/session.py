"""What the sampler hands out and keeps per batch: a `Session` of rows over several turns, the
`SampleOutput` of one generation, its error type, and the bucketing of compiled lengths (powers of
two) that keeps the number of compiled programs small.

Shapes: B rows of a session; token ids are int lists on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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
    reset_rows: [rows] bool, rows given a new sequence by `Sampler.reset` whose device cache the
      next `generate_from` empties.
    """

    sequences: list[list[int]]
    cached: np.ndarray
    cache: qwen2.KVCache | None = None
    row_offset: int = 0
    reset_rows: np.ndarray | None = None

    def __post_init__(self):
        if self.reset_rows is None:
            self.reset_rows = np.zeros(len(self.sequences), bool)

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
