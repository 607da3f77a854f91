"""The harness's acceptance rules (docs/rlmopt.md, Commit rules and Diagnose gate).

Commit rules, checked in this order by `commit_reasons`; each failing rule adds one reason:
- placeholder guard: every template variable of the seed survives;
- length guard: no empty component, at most `max_candidate_chars` characters in all;
- rationale guard: a rationale of at least `min_rationale_words` words;
- per-field regression floor: s_f(p) >= b_f - field_floor for every field (always on under
  commit_policy no_field_regression, else on for validation sets of <= small_dataset_records);
- significance gate: the mean paired per-example composite gain over the running best exceeds
  significance_k paired standard errors (with zero spread: any positive gain).

`DiagnoseGate` refuses evaluations after repeated near-best results until a diagnosis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from rlmopt.config import RLMOptConfig
from rlmopt.task import placeholders


def paired_stats(new: Sequence[float], old: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error) of the paired differences new_i - old_i."""
    if len(new) != len(old) or not new:
        raise ValueError("paired_stats needs two equally long, non-empty score lists")
    diffs = [a - b for a, b in zip(new, old)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(var / n)


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of `values` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


def floor_active(config: RLMOptConfig, n_records: int) -> bool:
    return config.commit_policy == "no_field_regression" or n_records <= config.small_dataset_records


def guard_reasons(candidate: Mapping[str, str], seed: Mapping[str, str], rationale: str | None,
                  config: RLMOptConfig) -> list[str]:
    """The placeholder, length and rationale guards (no scores needed); rationale=None (a claim,
    which has none) skips the rationale guard."""
    reasons = []
    missing = placeholders(seed) - placeholders(candidate)
    if missing:
        reasons.append(f"placeholder guard: template variable(s) {sorted('{' + m + '}' for m in missing)} "
                       "of the seed are missing; keep them in the text")
    empty = [name for name, text in candidate.items() if not text.strip() and seed.get(name, "").strip()]
    if empty:
        reasons.append(f"length guard: component(s) {empty} are empty")
    total = sum(len(t) for t in candidate.values())
    if total > config.max_candidate_chars:
        reasons.append(f"length guard: {total} characters exceed max_candidate_chars="
                       f"{config.max_candidate_chars}; shorten the candidate")
    if rationale is not None and len(rationale.split()) < config.min_rationale_words:
        reasons.append(f"rationale guard: give a rationale of at least {config.min_rationale_words} "
                       "words saying what changed and why it should help")
    return reasons


def score_reasons(cand_fields: Mapping[str, float], best_fields: Mapping[str, float],
                  cand_examples: Sequence[float], best_examples: Sequence[float],
                  config: RLMOptConfig, n_records: int) -> list[str]:
    """The per-field floor and the significance gate on full-validation scores.

    cand_examples/best_examples: per-example composite scores on the same validation examples.
    """
    reasons = []
    if floor_active(config, n_records):
        for f, b in best_fields.items():
            if cand_fields[f] < b - config.field_floor - 1e-12:
                reasons.append(f"regression floor: field {f} drops {b:.3f} -> {cand_fields[f]:.3f}, "
                               f"more than field_floor={config.field_floor}")
    gain, se = paired_stats(cand_examples, best_examples)
    if not (gain > config.significance_k * se and gain > 0):
        reasons.append(f"significance gate: paired gain {gain:+.3f} does not exceed "
                       f"{config.significance_k} x paired SE {se:.3f} = {config.significance_k * se:.3f}")
    return reasons


@dataclass
class DiagnoseGate:
    """Counts consecutive evaluations within `band_k` standard errors of the running best.

    - after each evaluation (`observe`): near-best -> count += 1, else (a large change) count = 0;
      a warning is returned at count >= 2;
    - before an evaluation (`admit`): at count >= 3 the call is refused (no budget charged),
      except that after two refusals in a row one evaluation is let through and the refusal
      counter starts again;
    - `diagnosed` (a successful synthesize_failures) resets the count;
    - disabled (always admits, never warns) when `enabled` is False (no sub-LM).
    """

    band_k: float = 1.5
    enabled: bool = True
    near_count: int = 0
    refusals_in_row: int = 0

    def admit(self) -> str | None:
        """None to admit, else the refusal message."""
        if not self.enabled or self.near_count < 3:
            self.refusals_in_row = 0
            return None
        if self.refusals_in_row >= 2:
            self.refusals_in_row = 0
            return None
        self.refusals_in_row += 1
        return (f"REFUSED (no budget charged): {self.near_count} consecutive candidates scored "
                "within the noise band of the running best without a diagnosis. Call "
                "synthesize_failures(field) on the weakest field first, then test a new hypothesis.")

    def observe(self, score: float, best_score: float, best_se: float) -> str | None:
        """Records one evaluation; returns a warning when the agent is circling the best."""
        if not self.enabled:
            return None
        if abs(score - best_score) <= self.band_k * best_se + 1e-12:
            self.near_count += 1
        else:
            self.near_count = 0
        if self.near_count >= 2:
            return (f"WARNING: {self.near_count} consecutive candidates within {self.band_k} SE of "
                    "the running best; diagnose (synthesize_failures) before more small edits.")
        return None

    def diagnosed(self) -> None:
        self.near_count = 0
        self.refusals_in_row = 0
