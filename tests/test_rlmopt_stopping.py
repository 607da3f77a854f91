"""Harness-enforced stopping (rlmopt/stopping.py): the paper's rule and the calibrated rule."""
import asyncio

import numpy as np
import pytest

from rlmopt import gates, stopping
from rlmopt.agent import Agent
from rlmopt.lm import ScriptedLM
from rlmopt.tools import ToolSet
from tests import rlmopt_graded
from tests.rlmopt_fakes import toy_harness

RATIONALE = "adds the directive for field a so that more items are answered right"


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("k", [1.65, 1.0, 2.5])
def test_min_improved_is_the_gates_own_threshold(k):
    for n in range(2, 61):
        m = stopping.min_improved(n, k)
        passes = lambda j: (lambda d, se: d > k * se and d > 0)(*gates.paired_stats([1.0] * j + [0.0] * (n - j), [0.0] * n))
        tie = abs(k * k / (n - 1 + k * k) * n - m) < 1e-9  # m / n == p* exactly
        assert passes(m) or tie, (n, m)
        assert m == n or passes(m + 1), (n, m)
        assert m == 1 or not passes(m - 1), (n, m)  # one fewer improved example never clears it


def _imperfect(h, j):
    """A candidate that is right on both fields for all validation items but the j highest."""
    ks = sorted(int(e.inputs["x"].split()[1]) for e in h.splits.val)
    cut = ks[len(ks) - j] if j else 100
    return f"A<{cut} B<100 for {{x}}"


@pytest.mark.parametrize("open_, stops", [(2, True), (3, False)])
def test_calibrated_rule_stops_when_too_few_examples_can_improve(open_, stops):
    h = toy_harness(budget=1000, stop_rule="calibrated")
    run(h.evaluate_seed())
    assert stopping.stop_reason(h) == ""  # the seed: every example has headroom
    cand = _imperfect(h, open_)
    run(h.run_candidate(cand))
    assert h.commit_prompt(cand, RATIONALE)["accepted"]
    assert sum(c < 1 for c in h.best_eval().composites) == open_
    reason = stopping.stop_reason(h)
    assert (f"{open_} of 40 validation examples have headroom left" in reason) == stops, reason


def test_calibrated_rule_stops_when_no_full_run_is_affordable():
    h = toy_harness(budget=50, stop_rule="calibrated")
    run(h.evaluate_seed())
    assert stopping.stop_reason(h) == ""
    run(h.run_candidate("A<30 for {x}", n=10))  # 10 spent, 40 left
    assert stopping.stop_reason(h) == ""  # this candidate's full run needs 40 - 10 = 30 more
    run(h.run_candidate("A<31 for {x}", n=10))  # 20 spent, 30 left: exactly one full run (30)
    assert h.budget_left() == 30 and stopping.stop_reason(h) == ""
    run(h.run_candidate("A<32 for {x}", n=1))  # 21 spent, 29 left; the cheapest still needs 30
    assert "29 rollouts left cannot pay for a full validation run (30 needed)" in stopping.stop_reason(h)


@pytest.mark.parametrize("budget, stops", [(40, False), (39, True)])
def test_calibrated_rule_goes_on_while_exactly_one_full_run_is_affordable(budget, stops):
    h = toy_harness(budget=budget, stop_rule="calibrated")
    run(h.evaluate_seed())
    run(h.run_candidate("A<30 for {x}", n=10))
    left, needed = budget - 10, len(h.splits.val) - 10  # 30 or 29 left; 40 - 10 = 30 to finish
    assert h.budget_left() == left and needed == 30
    reason = stopping.stop_reason(h)
    if stops:
        assert f"{left} rollouts left cannot pay for a full validation run ({needed} needed)" in reason
    else:  # exactly what is left pays for the full run, so a commit can still pass
        assert reason == ""
        record = run(h.run_candidate("A<30 for {x}"))
        assert "error" not in record and h.budget_left() == 0
        assert h.state.evaluated[h.resolve("A<30 for {x}")[0]] == h.val_order


def test_paper_rule_enforces_each_of_its_three_conditions():
    h = toy_harness(budget=1000, stop_rule="paper")
    run(h.evaluate_seed())
    run(h.run_candidate("A<100 B<50 for {x}"))
    assert h.state.history[-1]["fields"]["b"] < 0.85 and stopping.stop_reason(h) == ""
    h = toy_harness(budget=1000, stop_rule="paper")
    run(h.evaluate_seed())
    run(h.run_candidate(_imperfect(h, 6)))  # field a right on 34 of 40 (exactly 0.85), b on all
    assert h.state.history[-1]["fields"] == {"a": 0.85, "b": 1.0}
    assert "every field >= 0.85" in stopping.stop_reason(h)
    h = toy_harness(budget=50, stop_rule="paper")  # thorough: 80% of 50 = 40
    run(h.evaluate_seed())
    run(h.run_candidate("A<20 for {x}"))  # a full run: 40 rollouts
    assert "40 of 50 rollouts used" in stopping.stop_reason(h)
    h = toy_harness(budget=1000, stop_rule="paper", style="lean")
    run(h.evaluate_seed())
    run(h.run_candidate("A<100 B<100 for {x}", n=5))  # a big gain on 5 examples
    run(h.run_candidate("A<3 for {x}", n=5))
    assert stopping.stop_reason(h) == ""  # one short try after a gain is no stall
    run(h.run_candidate("A<4 for {x}", n=5))  # two tries in a row below +0.02 on their examples
    assert "two evaluations in a row" in stopping.stop_reason(h)


@pytest.mark.parametrize("target, wrong, stops", [(0.85, 6, True), (0.85, 7, False),
                                                  (0.5, 20, True), (0.5, 21, False)])
def test_paper_rule_stops_with_every_field_exactly_at_the_target(target, wrong, stops):
    h = toy_harness(budget=1000, stop_rule="paper", self_stop_target=target)
    run(h.evaluate_seed())
    cut = _imperfect(h, wrong).split()[0]  # "A<K": a right on all but the `wrong` highest items
    run(h.run_candidate(f"{cut} B{cut[1:]} for {{x}}"))  # and b on the same ones
    share = (40 - wrong) / 40  # 34/40 == 0.85 and 20/40 == 0.5 exactly; one fewer is below
    assert h.state.history[-1]["fields"] == {"a": share, "b": share}
    assert (share == target) == stops and h.state.rollouts_used == 40  # far from the 80% floor
    reason = stopping.stop_reason(h)
    assert (reason == f"paper rule: every field >= {target} on the latest full validation run") == stops
    assert stops or reason == ""


def test_the_agent_loop_obeys_the_rule():
    h = toy_harness(budget=1000, stop_rule="calibrated", block_timeout_s=20)
    run(h.evaluate_seed())
    code = f'```python\nc = "A<100 B<100 for {{x}}"\nrun_candidate(c)\nprint(commit_prompt(c, "{RATIONALE}"))\n```'
    lm = ScriptedLM([code, "```python\nprint('still here')\n```"])
    state = run(Agent(h, ToolSet(h), lm, log=lambda s: None).run())
    assert state.iteration == 1 and state.stop_reason.startswith("calibrated rule: 0 of 40")


def _bound_reference(h):
    """The ucb rule's bound from the history and the cached scores, with NumPy (every try of the
    graded script is a new candidate's full validation run: 40 rollouts)."""
    k, n = h.config.significance_k, len(h.val_order)
    comp = lambda c, ids=h.val_order: np.array(h.scores(c, ids).composites)
    chain = [h.state.seed_id] + h.state.commits
    runs, starts, since = 0, [0], []
    for e in h.state.history:
        if e["event"] == "run":
            runs, since = runs + 1, since + [e["candidate"]]
        elif e["event"] == "commit" and e["accepted"]:
            starts, since = starts + [40 * runs], []
    used = 40 * runs
    ucb = lambda d: d.mean() + k * d.std(ddof=1) / np.sqrt(len(d))
    rates = [max(0.0, ucb(comp(chain[-1]) - comp(chain[j - 1]))) / (used - starts[j - 1])
             for j in range(1, len(chain))]
    rates.append(max([0.0] + [ucb(comp(c) - comp(chain[-1])) for c in since]) / (used - starts[-1]))
    d = comp(chain[-1]) - comp(chain[-2])
    assert h.state.rollouts_used == used and len(d) == n
    return min(rates) * h.budget_left(), k * d.std(ddof=1) / np.sqrt(n)


@pytest.mark.parametrize("seed", [1, 7])  # 1: the window since the last commit binds; 7: an older one
def test_ucb_rule_stops_a_graded_plateau_early_at_no_held_out_loss(seed):
    """On the graded task (token F1) every example keeps headroom, so the calibrated rule runs
    the plateau script to the budget; the ucb rule stops once the bound on what the budget left
    can buy falls below the gate, and its final pick scores the same on the held-out split
    (paired difference not below -k paired SE)."""
    cal, ucb = run(rlmopt_graded.compare(800, seed, "plateau"))
    assert cal["spent"] == 800 and "calibrated rule: 0 rollouts left" in cal["stop"]
    assert ucb["spent"] < 800 and ucb["stop"].startswith("ucb rule: the "), ucb["stop"]
    assert ucb["commits"] == cal["commits"] >= 5
    assert ucb["diff"] >= -1.65 * ucb["diff_se"], ucb
    # the stop: the bound against a NumPy reference, below the gate, while the calibrated rule
    # alone would go on; one try earlier the bound was still above the gate
    h = ucb["harness"]
    bound, gate = stopping.improvement_bound(h)
    assert np.allclose((bound, gate), _bound_reference(h)) and bound < gate
    assert stopping.calibrated_reason(h) == "" and f"at most {bound:.4f}" in ucb["stop"]
    tries = ucb["spent"] // 40 - 1
    short = dict(rlmopt_graded.SCRIPTS, plateau=rlmopt_graded.SCRIPTS["plateau"][:tries])
    h, why = run(rlmopt_graded.search("ucb", 800, seed, "plateau", short))
    bound, gate = stopping.improvement_bound(h)
    assert why == "" and bound >= gate and np.allclose((bound, gate), _bound_reference(h))


def test_ucb_rule_is_the_calibrated_rule_before_the_first_commit():
    h = toy_harness(budget=50, stop_rule="ucb")
    run(h.evaluate_seed())
    run(h.run_candidate("A<30 for {x}", n=10))
    run(h.run_candidate("A<31 for {x}", n=10))
    run(h.run_candidate("A<32 for {x}", n=1))  # as in the calibrated test: 29 left, 30 needed
    assert stopping.improvement_bound(h) is None
    assert stopping.stop_reason(h).startswith("ucb rule: 29 rollouts left cannot pay")
