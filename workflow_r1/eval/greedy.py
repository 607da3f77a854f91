"""Greedy rollouts over a question set, summarised per data source."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from workflow_r1.rollout.engine import RolloutEngine
from workflow_r1.rollout.episode import Episode
from workflow_r1.rollout.stats import by_source


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` config section (evaluation during training).

    every_steps: evaluate every this many training steps (0 = only after the last step).
    at_start: also evaluate before the first step (the untrained policy's baseline).
    max_questions: evaluate on at most this many questions of the evaluation set (0 = all).
    batch_size: questions rolled out together (rows of one sampler batch).
    """

    every_steps: int = 0
    at_start: bool = False
    max_questions: int = 0
    batch_size: int = 32

    def __post_init__(self):
        if self.every_steps < 0 or self.max_questions < 0 or self.batch_size < 1:
            raise ValueError("eval: every_steps >= 0, max_questions >= 0 and batch_size >= 1 are required")


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

    def write(self, path: str | pathlib.Path) -> None:
        """Every episode as one JSON line (question, gold, reward, finish, operators, conversation)."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for e in self.episodes:
                f.write(json.dumps(e.summary(), ensure_ascii=False) + "\n")


def evaluate(engine: RolloutEngine, questions: Sequence[Any], *, batch_size: int = 32,
             progress: Callable[[int, float], None] | None = None) -> EvalResult:
    """Greedy rollouts of every question (one sample each), `batch_size` questions at a time.

    `progress(done_questions, running_em)` is called after every batch.
    """
    t0 = time.perf_counter()
    episodes: list[Episode] = []
    for start in range(0, len(questions), batch_size):
        eps, _ = engine.run(questions[start:start + batch_size], n=1, greedy=True)
        episodes.extend(eps)
        if progress is not None and episodes:
            progress(start + len(questions[start:start + batch_size]),
                     sum(e.reward_outcome == 1.0 for e in episodes) / len(episodes))
    return EvalResult(by_source(episodes), episodes, time.perf_counter() - t0)
