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
- "ucb" (ours): the calibrated rule, plus a stop when even an optimistic forecast of what the
  budget left can still buy falls below what one commit must gain. On graded scores nearly every
  example keeps some headroom, so the calibrated rule alone runs to the budget. Let b_0 (the seed),
  b_1, ..., b_m be the accepted commits, r_j the rollouts used when b_j was committed (r_0 = 0),
  U the rollouts used now and B the budget left. Assuming diminishing returns (the running best's
  composite is a concave function of the rollouts spent), the rate of improvement from here on is
  at most the average rate over any window that ends now, so for every j in 1..m

      rate <= (D_j + k S_j) / (U - r_{j-1}),   D_j, S_j = paired mean and SE of b_m - b_{j-1},

  D_j + k S_j being the upper confidence bound of the gain the window bought (k =
  significance_k, one-sided). The remaining improvement is at most B times the smallest of these
  bounds. A commit must gain more than k times its paired SE, which this rule takes to be the
  last accepted commit's (SE of b_m - b_{m-1}); when the bound on the remaining improvement is
  below that, no commit is expected to pass and the rule stops. Before the first commit it adds
  nothing to the calibrated rule.
"""
from __future__ import annotations

import math
from typing import Any

from rlmopt.gates import paired_stats

STOP_RULES = ("prompt", "paper", "calibrated", "ucb")
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


def commit_times(h: Any) -> tuple[list[int], list[str]]:
    """(rollouts used when each accepted commit was made, in commit order: the charges of the
    evaluations the history holds before it; the candidates run since the last commit)."""
    used, times, since = 0, [], []
    for e in h.state.history:
        if e.get("event") == "run":
            used += e.get("charged", 0)
            since.append(e["candidate"])
        elif e.get("event") == "commit" and e.get("accepted"):
            times.append(used)
            since = []
    return times, since


def improvement_bound(h: Any) -> tuple[float, float] | None:
    """(upper confidence bound of the composite gain the budget left can still buy, the gain one
    more commit must exceed: k x the last commit's paired SE); None before the first commit.
    Composite gains are per-example means over the validation split."""
    chain = [h.state.seed_id] + list(h.state.commits)
    if len(chain) < 2 or not all((c, i) in h.replies for c in chain for i in h.val_order):
        return None
    k = h.config.significance_k
    scores = [h.scores(c, h.val_order).composites for c in chain]
    times, since = commit_times(h)
    starts = [0] + times  # r_0 .. r_m
    used = h.state.rollouts_used
    rates = []
    for j in range(1, len(chain)):
        spent = used - starts[j - 1]
        if spent > 0:  # a window that spent nothing bounds nothing
            gain, se = paired_stats(scores[-1], scores[j - 1])
            rates.append(max(0.0, gain + k * se) / spent)
    if used - starts[-1] > 0:  # the window since the last commit bought at most its best try
        best = dict(zip(h.val_order, scores[-1]))
        ucbs = []
        for cid in dict.fromkeys(since):
            ids = [i for i in h.state.evaluated.get(cid, []) if (cid, i) in h.replies]
            if ids:
                gain, se = paired_stats(h.scores(cid, ids).composites, [best[i] for i in ids])
                ucbs.append(gain + k * se)
        rates.append(max([0.0] + ucbs) / (used - starts[-1]))
    if not rates:  # every commit was of a candidate run before (cached): no window spent anything
        return None
    _, se_last = paired_stats(scores[-1], scores[-2])
    return min(rates) * h.budget_left(), k * se_last


def ucb_reason(h: Any) -> str:
    reason = calibrated_reason(h)
    if reason:
        return reason.replace("calibrated rule", "ucb rule", 1)
    bound = improvement_bound(h)
    if bound is not None and bound[0] < bound[1]:
        return (f"ucb rule: the {h.budget_left()} rollouts left can buy a composite gain of at "
                f"most {bound[0]:.4f} (upper confidence bound at the rate so far), below the "
                f"{bound[1]:.4f} a commit must exceed")
    return ""


def stop_reason(h: Any) -> str:
    """Why the harness stops the agent now under `h.config.stop_rule` ("" = go on)."""
    rule = h.config.stop_rule
    if rule == "paper":
        return paper_reason(h)
    if rule == "calibrated":
        return calibrated_reason(h)
    if rule == "ucb":
        return ucb_reason(h)
    return ""
