"""A policy that plays scripted turns through the engine's `Policy` seam, holding no KV: simulations
without a model (rlmopt's policy-prompt task) and tests of the engine's rules.

A subclass gives `turn(row_id, k, sequence)`: the token ids of the whole k-th assistant turn of the
episode with that row id (its end-of-turn token included), from the episode's tokens when the turn
starts (prompt, earlier turns, observations); and optionally `logprobs(row_id, k, ids)` (default 0).
A call returns each turn cut at the call's limit; a turn cut by a call's burst continues at the
next call (`step_offset`), so a script plays the same under any schedule of calls. Turns are
counted per rollout (`new_pages` starts one).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from workflow_r1.sampler.session import SampleOutput


@dataclasses.dataclass(frozen=True)
class NoPages:
    """The KV pages of a policy that computes nothing."""

    nbytes: int = 0
    bytes_per_page: int = 0


@dataclasses.dataclass(frozen=True)
class Call:
    """One `generate_paged` call as a scripted policy saw it (one entry per sequence)."""

    row_ids: list[int]
    limits: list[int]
    seeds: list[int]
    step_offsets: list[int]
    temperature: float


class ScriptedPolicy:
    """Base class: plays `turn` (see the module docstring); records every call in `calls` and the
    seed each turn was opened with in `turn_seeds[(row_id, k)]`."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.turn_seeds: dict[tuple[int, int], int] = {}
        self._open: dict[int, tuple[list[int], np.ndarray]] = {}   # row id -> the open turn's ids, log-probs
        self._started: dict[int, int] = {}                          # row id -> turns opened

    def turn(self, row_id: int, k: int, sequence: list[int]) -> list[int]:
        raise NotImplementedError

    def logprobs(self, row_id: int, k: int, ids: list[int]) -> np.ndarray:
        return np.zeros(len(ids), np.float32)

    def new_pages(self, num_pages: int, page_size: int) -> NoPages:
        """Called once per rollout (`RolloutEngine.run`): row ids start again, so do the turns."""
        self._open.clear()
        self._started.clear()
        return NoPages()

    def generate_paged(self, pages: Any, tables: list[list[int]], sequences: list[list[int]], cached: list[int],
                       max_new_tokens: list[int], *, seed: list[int], row_ids: list[int], step_offset: list[int],
                       temperature: float = 0.0, **_: Any) -> tuple[SampleOutput, Any, list[int]]:
        self.calls.append(Call(list(row_ids), list(max_new_tokens), list(seed), list(step_offset), temperature))
        out = SampleOutput([], [], [])
        after = []
        for seq, limit, s, rid, offset in zip(sequences, max_new_tokens, seed, row_ids, step_offset):
            if offset == 0:  # a new turn opens
                k = self._started.get(rid, 0)
                self._started[rid] = k + 1
                ids = [int(t) for t in self.turn(rid, k, list(seq))]
                self._open[rid] = (ids, np.asarray(self.logprobs(rid, k, ids), np.float32))
                self.turn_seeds[(rid, k)] = int(s)
            ids, lps = self._open[rid]
            part = ids[offset:offset + limit]
            out.tokens.append(part)
            out.logprobs.append(lps[offset:offset + limit])
            out.finish_reason.append("eos" if offset + limit >= len(ids) else "length")
            after.append(len(seq) + len(part) - 1)
        return out, pages, after

    def step_paged(self, pages: Any, tables: list[list[int]], sequences: list[list[int]], cached: list[int],
                   counts: list[int], *, seed: list[int], row_ids: list[int], step_offset: list[int],
                   temperature: float = 0.0, **_: Any) -> tuple[SampleOutput, Any, list[int]]:
        """A ragged step: a sequence whose pending tokens end here plays its turn's next token (a
        call of limit 1); the others write a chunk and play nothing."""
        ends = [i for i, (seq, c, n) in enumerate(zip(sequences, cached, counts)) if c + n == len(seq)]
        out = SampleOutput([[] for _ in sequences], [np.zeros(0, np.float32) for _ in sequences],
                           ["paused"] * len(sequences))
        if ends:
            pick = lambda xs: [xs[i] for i in ends]  # noqa: E731
            played, _, _ = self.generate_paged(pages, pick(tables), pick(sequences), pick(cached), [1] * len(ends),
                                               seed=pick(seed), row_ids=pick(row_ids),
                                               step_offset=pick(step_offset), temperature=temperature)
            for j, i in enumerate(ends):
                out.tokens[i], out.logprobs[i] = played.tokens[j], played.logprobs[j]
                out.finish_reason[i] = played.finish_reason[j]
        return out, pages, [c + n for c, n in zip(cached, counts)]
