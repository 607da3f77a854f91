"""Statistics of a set of episodes: what the trainer logs per step and evaluation reports.

All values are means over episodes unless the name says otherwise; `em` is the exact-match rate of
the final answer (the reward's outcome term is 1), `format_ok` the rate of responses whose format
reward is 0, and `calls/<Operator>` the mean number of calls of that operator per episode.

The reward breakdown also counts the episodes whose scored answer is not the policy's (task/reward.py):
`answer_from_observation` (no assistant turn wrote an `<answer>`, an observation's was scored) and,
among them, `answer_from_warning` (WarningOp's literal `<answer>...</answer>`: -0.5 instead of -1.5).
Per operator: `observations/<Operator>`, the observations it returned per episode, and over those
observations `obs_chars/<Operator>`, their mean length in characters before truncation, and
`obs_truncated/<Operator>`, the fraction cut to the observation limit.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from workflow_r1.task import reward
from workflow_r1.rollout.episode import FINISH_REASONS, Episode


def episode_metrics(episodes: Sequence[Episode], prefix: str = "") -> dict[str, float]:
    """Flat dict of scalar statistics of `episodes` (empty input -> {})."""
    if not episodes:
        return {}
    n = len(episodes)
    em = np.array([e.reward_outcome == 1.0 for e in episodes], np.float64)
    out = {
        "reward": float(np.mean([e.reward for e in episodes])),
        "em": float(em.mean()),
        "em_stderr": float(em.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        "format_ok": float(np.mean([e.reward_format == 0.0 for e in episodes])),
        "answered": float(np.mean([e.reward_outcome != -1.0 for e in episodes])),
        "answer_from_observation": float(np.mean([e.answer_source in (reward.SOURCE_WARNING, reward.SOURCE_OBSERVATION)
                                                  for e in episodes])),
        "answer_from_warning": float(np.mean([e.answer_source == reward.SOURCE_WARNING for e in episodes])),
        "turns": float(np.mean([e.num_turns for e in episodes])),
        "calls": float(np.mean([e.operator_rounds for e in episodes])),
        "response_tokens": float(np.mean([e.response_length for e in episodes])),
        "generated_tokens": float(np.mean([e.generated_tokens for e in episodes])),
        "episodes": float(n),
    }
    calls: Counter = Counter()
    errors = 0
    for e in episodes:
        calls.update(e.operator_counts())
        errors += sum(t.error_kind is not None for t in e.turns)
    for name, count in sorted(calls.items()):
        out[f"calls/{name}"] = count / n
    observed: dict[str, list[tuple[int, bool]]] = {}
    for e in episodes:
        for t in e.turns:
            if t.observation is not None and t.operator:
                observed.setdefault(t.operator, []).append((len(t.observation), t.truncated_observation))
    for name, obs in sorted(observed.items()):
        out[f"observations/{name}"] = len(obs) / n
        out[f"obs_chars/{name}"] = float(np.mean([chars for chars, _ in obs]))
        out[f"obs_truncated/{name}"] = float(np.mean([cut for _, cut in obs]))
    out["executor_errors"] = errors / n
    finish = Counter(e.finish_reason for e in episodes)
    for reason in FINISH_REASONS:
        out[f"finish/{reason}"] = finish.get(reason, 0) / n
    return {prefix + k: v for k, v in out.items()}


def combine(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """`episode_metrics` of the union of disjoint episode sets, from each set's `episode_metrics`.

    Means are weighted by each part's "episodes" (a key missing from a part, e.g. an operator it
    never called, counts as 0 there), the per-observation means `obs_*/<Operator>` by the part's
    number of that operator's observations; "episodes" is summed; "em_stderr" is recomputed from the
    combined exact-match rate (em is 0 or 1 per episode). Used to report a multi-host step.
    """
    parts = [p for p in parts if p]
    if len(parts) <= 1:  # one host: its own statistics, unchanged
        return dict(parts[0]) if parts else {}
    n = sum(p["episodes"] for p in parts)
    keys = sorted({k for p in parts for k in p} - {"episodes", "em_stderr"})
    def weight(p: dict[str, float], key: str) -> float:
        if key.startswith(("obs_chars/", "obs_truncated/")):  # a mean over observations
            return p["episodes"] * p.get("observations/" + key.split("/", 1)[1], 0.0)
        return p["episodes"]

    out = {}
    for k in keys:
        total = sum(weight(p, k) for p in parts)
        out[k] = sum(p.get(k, 0.0) * weight(p, k) for p in parts) / total if total else 0.0
    out["episodes"] = float(n)
    out["em_stderr"] = rate_stderr(out["em"], n)
    return out


def rate_stderr(rate: float, n: float) -> float:
    """Standard error of a rate over n episodes, sqrt(p (1 - p) / (n - 1)) (0 for n <= 1): the n - 1
    form of `episode_metrics`' em_stderr, for a rate known only as a mean."""
    return math.sqrt(rate * (1 - rate) / (n - 1)) if n > 1 else 0.0


def by_source(episodes: Sequence[Episode]) -> dict[str, dict[str, float]]:
    """`episode_metrics` per data source (the question's `data_source`), plus "all"."""
    groups: dict[str, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.question.data_source, []).append(e)
    out = {name: episode_metrics(eps) for name, eps in sorted(groups.items())}
    out["all"] = episode_metrics(episodes)
    return out


def step_metrics(episodes: Sequence[Episode], stats: Any,
                 gather: Callable[[Any], list] = lambda x: [x]) -> dict[str, float]:
    """A training step's rollout metrics: `episode_metrics` of every host's episodes ("rollout/"),
    the KV cache's work summed over hosts (prompt tokens computed, the prefix-cache hit rate,
    preemptions), and this host's own timings, rounds, generation rate and KV pages at their peak
    (bytes, and slots per token held) from `stats` (a
    `RolloutStats`). gather: an object from every host, in host order (`sharding.allgather_objects`;
    default: this host alone)."""
    out = {f"rollout/{k}": v for k, v in combine(gather(episode_metrics(episodes))).items()}
    prefill, hits, lookups, preempted = (sum(c) for c in zip(*gather(
        (stats.prefill_tokens, stats.prefix_hit_tokens, stats.prefix_lookup_tokens, stats.preemptions))))
    out.update({"time/generate_s": stats.seconds_generate, "time/executor_s": stats.seconds_executor,
                "time/executor_busy_s": stats.seconds_calls,
                "time/rollout_s": stats.seconds_total, "rollout/rounds": stats.rounds,
                "rollout/tokens_per_s": stats.generated_tokens / max(stats.seconds_generate, 1e-9),
                "rollout/prefill_tokens": prefill, "rollout/prefix_hit_rate": hits / max(lookups, 1),
                "rollout/preemptions": preempted, "rollout/kv_bytes_peak": stats.kv_bytes_peak,
                "rollout/kv_overhead": stats.kv_overhead, "rollout/version_loads": stats.version_loads,
                "time/version_wait_s": stats.seconds_versions})
    return out
