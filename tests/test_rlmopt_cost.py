"""Cost accounting: LM calls and prompt / completion / cached tokens per role in record.json,
summary.md and the compare table, priced from a user's JSON table (rlmopt/cost.py)."""
import asyncio
import json

import pytest

from rlmopt import compare, cost
from rlmopt.config import RLMOptConfig
from rlmopt.lm import Completion, ScriptedLM
from rlmopt.pipeline import optimise
from tests.rlmopt_fakes import _toy_reply, toy_task

PRICES = {"task": {"prompt": 0.5, "completion": 2.0, "cached": 0.05},
          "optimizer": {"prompt": 3.0, "completion": 15.0}}


class ReportingLM:
    """The toy task LM, reporting usage as an OpenAI-compatible server would: 100 prompt tokens,
    40 of them from the prompt cache, 5 completion tokens per call; counts its own calls."""

    name = "reporting"

    def __init__(self):
        self.n = 0

    async def complete(self, prompt, max_tokens):
        self.n += 1
        return Completion(_toy_reply(prompt), "stop", 5, prompt_tokens=100, cached_tokens=40)


def _run(tmp_path, prices):
    task_lm = ReportingLM()
    opt = ScriptedLM(["```python\nfinal()\n```"])
    rec = asyncio.run(optimise(toy_task(), RLMOptConfig(budget=10, polish_variants=False),
                               method="rlmopt", task_lm=task_lm, optimizer_lm=opt, sub_lm=None,
                               judge_lm=None, run_dir=tmp_path, names={"task": "t", "optimizer": "o"},
                               log=lambda s: None, prices=prices))
    return rec, task_lm, opt


def test_record_counts_tokens_per_role_and_prices_them(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PRICES))
    prices = cost.load_prices(tmp_path / "p.json")
    rec, task_lm, opt = _run(tmp_path / "run", prices)
    n = task_lm.n  # seed on validation + seed on test: 80 calls
    assert n == 80
    opt_prompt = sum(len(p) // 4 for p in opt.prompts)  # no usage reported: characters / 4
    opt_completion = len(opt.replies[0]) // 4
    roles = rec["extra"]["by_role"]
    assert roles["task"] == {"calls": n, "prompt_tokens": 100 * n, "completion_tokens": 5 * n,
                             "cached_tokens": 40 * n, "estimated_prompt_calls": 0,
                             "cost_usd": pytest.approx(n * (60 * 0.5 + 40 * 0.05 + 5 * 2.0) / 1e6)}
    assert roles["optimizer"]["prompt_tokens"] == opt_prompt
    assert roles["optimizer"]["estimated_prompt_calls"] == 1 and roles["optimizer"]["cached_tokens"] == 0
    opt_usd = (opt_prompt * 3.0 + opt_completion * 15.0) / 1e6
    assert roles["optimizer"]["cost_usd"] == pytest.approx(opt_usd)
    assert rec["cost_usd_estimate"] == pytest.approx(roles["task"]["cost_usd"] + opt_usd)
    assert rec["extra"]["cached_tokens"] == 40 * n
    assert rec["extra"]["cache_hit_rate"] == pytest.approx(40 * n / (100 * n + opt_prompt))
    saved = json.loads((tmp_path / "run" / "record.json").read_text())
    assert saved["cost_usd_estimate"] == pytest.approx(rec["cost_usd_estimate"])
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert f"| task | {n} | {100 * n} | {40 * n} | {5 * n} | " in summary
    assert f"Estimated cost: {rec['cost_usd_estimate']:.4g} USD" in summary
    # the counts survive a resume (the meter is part of state.json)
    again, task_lm2, _ = _run(tmp_path / "run", prices)
    assert task_lm2.n == 0 and again["extra"]["by_role"]["task"]["cached_tokens"] == 40 * n


def test_an_unpriced_role_leaves_the_total_null_and_default_covers_it(tmp_path):
    rec, _, _ = _run(tmp_path / "a", cost.check_prices({"task": PRICES["task"]}))
    assert rec["cost_usd_estimate"] is None and rec["extra"]["unpriced_roles"] == ["optimizer"]
    assert rec["extra"]["by_role"]["task"]["cost_usd"] is not None
    assert "no price for ['optimizer']" in (tmp_path / "a" / "summary.md").read_text()
    rec, _, _ = _run(tmp_path / "b", cost.check_prices({"default": {"prompt": 1, "completion": 1}}))
    roles = rec["extra"]["by_role"]
    assert rec["cost_usd_estimate"] == pytest.approx(
        sum(r["prompt_tokens"] + r["completion_tokens"] for r in roles.values()) / 1e6)
    rec, _, _ = _run(tmp_path / "c", None)
    assert rec["cost_usd_estimate"] is None and rec["extra"]["prices"] is None


@pytest.mark.parametrize("table, message", [
    ({"task": {"prompt": 1}}, "needs \"prompt\" and \"completion\""),
    ({"task": {"prompt": 1, "completion": -2}}, "non-negative number"),
    ({"task": {"prompt": 1, "completion": 2, "cache": 1}}, "unknown key"),
    ([1, 2], "expected a JSON object"),
])
def test_a_bad_price_table_is_refused_in_one_line(table, message):
    with pytest.raises(ValueError, match=message):
        cost.check_prices(table)


def test_compare_table_has_the_mean_cost_and_per_role_rows():
    def rec(seed, usd, calls):
        return {"seed": seed, "task_lm": "t", "test_score": 0.5, "val_score": 0.5,
                "rollouts_used": 1, "wall_clock_s": 1.0, "per_example_test": {"q": 0.5},
                "cost_usd_estimate": usd,
                "extra": {"api_calls": calls, "calls_by_role": {"task": calls}, "total_tokens": 10,
                          "by_role": {"task": {"calls": calls, "prompt_tokens": 10 * calls,
                                               "cached_tokens": 0, "completion_tokens": calls,
                                               "cost_usd": usd}}}}
    md = compare.table({"rlmopt": [rec(7, 0.25, 4), rec(8, 0.75, 6)],
                        "baseline": [rec(7, None, 2), rec(8, None, 2)]}, "t")
    assert "| 10 | 0.5 | 1.0 |" in md  # rlmopt: mean cost (0.25 + 0.75) / 2
    assert "| rlmopt | task | 5 | 50 | 0 | 5 | 0.5 |" in md
    assert "| baseline | task | 2 | 20 | 0 | 2 | - |" in md
