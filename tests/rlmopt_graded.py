"""A graded synthetic task and a scripted search on it, for the stopping rules (rlmopt/stopping.py,
docs/rlmopt.md, Calibrated stopping).

Example k asks for the eight tokens `w<k>t0 ... w<k>t7` and is scored by token F1, so a reply
with m of them scores 2m / (8 + m): scores are graded and almost every example keeps some
headroom, the case where the calibrated rule runs to the budget. The fake task LM reads a quality
directive `Q=<q>` and a wording directive `V=<v>` from the prompt: token j of example k is in its
reply when u(k, j) < q + 0.12 (u'(k, j, v) - 0.5), u and u' uniform hashes. A higher q is better
on average, two wordings of one q differ by example-level noise, and everything is deterministic.

`search` drives the harness the way a scripted agent does (before each try the stop rule is
asked; a try is a full validation run and a commit request), and `compare` runs the same script
under two rules and scores both final picks on the held-out split.
`python -m tests.rlmopt_graded` prints the comparison table of docs/rlmopt.md.
"""
from __future__ import annotations

import asyncio
import hashlib
import re

from rlmopt import gates, stopping
from rlmopt.config import RLMOptConfig
from rlmopt.harness import Harness
from rlmopt.lm import FunctionLM
from rlmopt.selection import finalize
from rlmopt.task import Example, Field, Task

TOKENS = 8
RATIONALE = "raises the quality directive so that the model names more of the tokens"
# (q, v) of each try. plateau: diminishing gains, then rewordings of the last q (24 tries, more
# than a budget of 800 pays for); creep: the same start, then gains of 0.01 every other try.
_START = [(0.30, 1), (0.50, 2), (0.62, 3), (0.70, 4), (0.75, 5), (0.78, 6), (0.80, 7)]
SCRIPTS = {
    "plateau": _START + [(0.80, v) for v in range(8, 25)],
    "creep": _START + [(0.81, 8), (0.82, 9), (0.82, 10), (0.83, 11), (0.83, 12), (0.84, 13),
                       (0.84, 14), (0.85, 15), (0.85, 16), (0.85, 17), (0.86, 18), (0.86, 19),
                       (0.86, 20), (0.87, 21), (0.87, 22), (0.87, 23), (0.88, 24)],
}


def _u(*key) -> float:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def graded_task(n: int = 100, split_sizes=(20, 40, 40)) -> Task:
    examples = [Example(f"g{k:03d}", {"x": f"item {k}"},
                        {"answer": " ".join(f"w{k}t{j}" for j in range(TOKENS))}) for k in range(n)]
    return Task("graded", "name the item's eight tokens", examples, [Field("answer", "token_f1")],
                {"system_prompt": "Answer for {x}."}, max_tokens=64, split_sizes=split_sizes)


def _reply(prompt: str) -> str:
    k = int(re.search(r"item (\d+)", prompt).group(1))
    q = re.search(r"Q=([0-9.]+)", prompt)
    v = re.search(r"V=(\d+)", prompt)
    q, v = (float(q.group(1)) if q else 0.1), (int(v.group(1)) if v else 0)
    toks = [f"w{k}t{j}" for j in range(TOKENS) if _u(k, j) < q + 0.12 * (_u(k, j, v) - 0.5)]
    return " ".join(toks) or "no idea"


def graded_lm() -> FunctionLM:
    return FunctionLM(_reply)


def candidate(q: float, v: int) -> str:
    return f"Q={q:.2f} V={v} Answer for {{x}}."


async def search(rule: str, budget: int, seed: int, script: str,
                 scripts: dict = SCRIPTS) -> tuple[Harness, str]:
    """The scripted search under `rule` (the script named `script` of `scripts`); returns the
    harness and why it stopped ("" when the script ran out)."""
    h = Harness(graded_task(), graded_lm(), RLMOptConfig(budget=budget, seed=seed, stop_rule=rule,
                                                       polish_variants=False))
    await h.evaluate_seed()
    why = ""
    for q, v in scripts[script]:
        why = stopping.stop_reason(h) or ("budget spent" if h.budget_left() <= 0 else "")
        if why:
            break
        c = candidate(q, v)
        await h.run_candidate(c)
        h.commit_prompt(c, RATIONALE)
    return h, why


async def compare(budget: int, seed: int, script: str,
                  rules=("calibrated", "ucb")) -> list[dict]:
    """One row per rule: rollouts spent, commits, validation and held-out composite of the final
    pick (its standard error), the held-out paired difference against the first rule's pick,
    and the harness after its final stage ("harness")."""
    rows, base = [], None
    for rule in rules:
        h, why = await search(rule, budget, seed, script)
        final = await finalize(h)
        test = final.test.composites
        base = base or test
        diff, se = gates.paired_stats(test, base)
        rows.append({"rule": rule, "seed": seed, "script": script, "spent": h.state.rollouts_used,
                     "commits": len(h.state.commits), "val": final.val.composite,
                     "test": final.test.composite, "test_se": gates.standard_error(test),
                     "diff": diff, "diff_se": se, "stop": why or "the script ran out",
                     "harness": h})
    return rows


def main(budget: int = 800, seeds=(1, 2, 3, 4, 5, 7)) -> None:
    print("| script | split seed | calibrated: rollouts, commits, held-out (s.e.) | ucb: rollouts, "
          "commits, held-out (s.e.) | ucb minus calibrated, held-out (paired s.e.) |")
    print("|---|---|---|---|---|")
    for script in SCRIPTS:
        for seed in seeds:
            cal, ucb = asyncio.run(compare(budget, seed, script))
            print(f"| {script} | {seed} | " + " | ".join(
                f"{r['spent']}, {r['commits']}, {r['test']:.3f} ({r['test_se']:.3f})"
                for r in (cal, ucb)) + f" | {ucb['diff']:+.3f} ({ucb['diff_se']:.3f}) |")


if __name__ == "__main__":
    main()
