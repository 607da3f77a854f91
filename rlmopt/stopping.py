"""Harness-enforced stopping rules (docs/rlmopt.md, Calibrated stopping), `config.stop_rule`:

- "prompt" (default, the paper's practice): the skill prompt asks the agent to stop; nothing here
  stops it but the budget and the turn cap.
- "paper": the paper's three conditions, enforced: every field at least `self_stop_target` on the
  latest full validation run; at least the style's `self_stop_floor_pct` of the budget used; the
  last two evaluations each short of the running best (on the same examples) by less than
  `self_stop_min_gain`.
- "calibrated" (ours, beyond the paper): stop when no commit can pass any more. A commit needs a
  full validation run and a paired gain over the running best above k paired standard errors.
  With d_i >= 0 on m of n examples, mean/SE is at most sqrt((n-1) p / (1-p)) for p = m/n (equal
  gains maximise it; a regression only lowers it), so a commit needs a share of improved examples
  p > p* = k^2 / (n - 1 + k^2). The headroom of example i is 1 - (its composite under the running
  best), i.e. the weighted per-field headroom from the validation records. The rule stops when
  fewer than ceil(p* n) validation examples have any headroom, or when the budget left
  cannot pay for the full validation run of any candidate not yet fully run.
"""
from __future__ import annotations

import math
from typing import Any

STOP_RULES = ("prompt", "paper", "calibrated")
_EPS = 1e-9


def min_improved(n: int, k: float) -> int:
    """The fewest of n paired examples that must improve for a gain to clear k standard errors:
    the smallest m with m / n >= p* (at an exact tie the gate's strict test is decided by
    rounding, so the tie counts as possible: the rule never stops while a commit could pass)."""
    if n < 2:
        return n
    p_star = k * k / (n - 1 + k * k)
    return max(1, min(n, math.ceil(p_star * n - _EPS)))


def paper_reason(h: Any) -> str:
    cfg = h.config
    runs = [e for e in h.state.history if e.get("event") == "run"]
    full = [e for e in runs if e["n"] == len(h.val_order)]
    if full and all(v >= cfg.self_stop_target for v in full[-1]["fields"].values()):
        return f"paper rule: every field >= {cfg.self_stop_target} on the latest full validation run"
    floor = cfg.styled("self_stop_floor_pct")
    if cfg.budget and h.state.rollouts_used >= floor * cfg.budget:
        return f"paper rule: {h.state.rollouts_used} of {cfg.budget} rollouts used (>= {floor:.0%})"
    last = runs[-2:]
    if len(last) == 2 and all(e["composite"] - e.get("best_same_examples", e["composite"]) <
                              cfg.self_stop_min_gain for e in last):
        return (f"paper rule: two evaluations in a row improved the composite by less than "
                f"{cfg.self_stop_min_gain}")
    return ""


def calibrated_reason(h: Any) -> str:
    n = len(h.val_order)
    if not all((h.state.best_id, i) in h.replies for i in h.val_order):
        return ""  # the seed is not scored yet
    best = h.best_eval()
    open_ = sum(1 - c > _EPS for c in best.composites)
    need = min_improved(n, h.config.significance_k)
    if open_ < need:
        return (f"calibrated rule: {open_} of {n} validation examples have headroom left; a "
                f"commit needs at least {need} improved to clear the significance gate")
    costs = [sum((cid, i) not in h.replies for i in h.val_order) for cid in h.state.candidates]
    cheapest = min([c for c in costs if c > 0], default=n)
    if h.budget_left() < cheapest:
        return (f"calibrated rule: {h.budget_left()} rollouts left cannot pay for a full "
                f"validation run ({cheapest} needed), so no commit can pass")
    return ""


def stop_reason(h: Any) -> str:
    """Why the harness stops the agent now under `h.config.stop_rule` ("" = go on)."""
    rule = h.config.stop_rule
    if rule == "paper":
        return paper_reason(h)
    if rule == "calibrated":
        return calibrated_reason(h)
    return ""
