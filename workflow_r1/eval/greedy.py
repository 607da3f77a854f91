"""Greedy rollouts over a question set, summarised per data source, sliced over hosts.

Multi-host: host i of n rolls out the contiguous slice `host_slice(len(questions), i, n)` of the
questions; the episodes of every host are then gathered (`sharding.allgather_objects`) and
concatenated in host order, which is question order, so every host holds the same merged result
and host 0 writes it.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from workflow_r1 import bounds, sharding, storage
from workflow_r1.rollout.engine import RolloutEngine
from workflow_r1.rollout.episode import Episode
from workflow_r1.rollout.stats import by_source


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` config section (evaluation during training, and `python -m workflow_r1.evaluate`).

    every_steps: evaluate every this many training steps (0 = only after the last step).
    at_start: also evaluate before the first step (the untrained policy's baseline).
    max_questions: evaluate on at most this many questions of the evaluation set (0 = all).
    batch_size: questions rolled out together on one host (rows of one sampler batch).
    """

    every_steps: int = 0
    at_start: bool = False
    max_questions: int = 0
    batch_size: int = 32

    def __post_init__(self):
        bounds.check("eval.every_steps", self.every_steps, 0, bounds.MAX_COUNT, note=" (0: only after the last step)")
        bounds.check("eval.max_questions", self.max_questions, 0, bounds.MAX_COUNT, note=" (0: all)")
        bounds.check("eval.batch_size", self.batch_size, 1, 1 << 16)


@dataclasses.dataclass
class EvalResult:
    """metrics: data source (and "all") -> statistics; episodes in question order; seconds: wall time."""

    metrics: dict[str, dict[str, float]]
    episodes: list[Episode]
    seconds: float

    def flat(self, prefix: str = "eval/") -> dict[str, float]:
        """The statistics as one flat dict: eval/em, eval/nq/em, ..."""
        out = {}
        for source, stats in self.metrics.items():
            head = prefix if source == "all" else f"{prefix}{source}/"
            out.update({head + k: v for k, v in stats.items()})
        return out

    def write(self, path: storage.PathLike) -> None:
        """Every episode as one JSON line (question, gold, reward, finish, operators, conversation);
        `path` may be a URI."""
        storage.write_text(path, "".join(json.dumps(e.summary(), ensure_ascii=False) + "\n" for e in self.episodes))


def host_slice(n: int, index: int, count: int) -> slice:
    """The contiguous share of `n` items of host `index` out of `count`: sizes differ by at most one,
    and the slices of hosts 0..count-1 tile range(n) in order."""
    if not 0 <= index < count:
        raise ValueError(f"host index {index} is outside 0..{count - 1}")
    return slice(n * index // count, n * (index + 1) // count)


def evaluate_slice(engine: RolloutEngine, questions: Sequence[Any], *, batch_size: int = 32,
                   process_index: int = 0, process_count: int = 1,
                   progress: Callable[[int, float], None] | None = None, done: Sequence[Episode] = (),
                   on_batch: Callable[[list[Episode]], None] | None = None) -> list[Episode]:
    """Greedy rollouts (one sample each) of this host's slice of `questions`, `batch_size` at a time.

    `progress(done_questions, running_em)` is called after every batch (this host's counts).
    done: episodes of the slice's first questions from an interrupted run (`stream.EpisodeStream`):
      those questions are not rolled out again. on_batch: called with each batch's new episodes.
    """
    mine = questions[host_slice(len(questions), process_index, process_count)]
    episodes: list[Episode] = list(done)
    for start in range(len(episodes), len(mine), batch_size):
        eps, _ = engine.run(mine[start:start + batch_size], n=1, greedy=True)
        episodes.extend(eps)
        if on_batch is not None:
            on_batch(eps)
        if progress is not None and episodes:
            progress(min(start + batch_size, len(mine)),
                     sum(e.reward_outcome == 1.0 for e in episodes) / len(episodes))
    return episodes


def merge(per_host: Sequence[Sequence[Episode]], seconds: float = 0.0) -> EvalResult:
    """One result from every host's episodes, given in host order (so in question order)."""
    episodes = [e for host in per_host for e in host]
    return EvalResult(by_source(episodes), episodes, seconds)


def evaluate(engine: RolloutEngine, questions: Sequence[Any], *, batch_size: int = 32,
             progress: Callable[[int, float], None] | None = None, done: Sequence[Episode] = (),
             on_batch: Callable[[list[Episode]], None] | None = None) -> EvalResult:
    """Greedy rollouts of every question (one sample each): each host rolls out its slice, then the
    episodes of all hosts are merged on every host (one process: no collective). `done` and
    `on_batch` are this host's, as in `evaluate_slice`."""
    t0 = time.perf_counter()
    episodes = evaluate_slice(engine, questions, batch_size=batch_size, process_index=jax.process_index(),
                              process_count=jax.process_count(), progress=progress, done=done, on_batch=on_batch)
    return merge(sharding.allgather_objects(episodes), time.perf_counter() - t0)
