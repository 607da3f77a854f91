"""The harness rules with a deterministic fake task LM: splits, budget accounting, the commit
rules (floor, significance, guards), the diagnose gate, final selection, record and resume."""
import asyncio
import json
import re

import pytest

from rlmopt import gates, metrics
from rlmopt.selection import finalize, pareto_frontier, pick, polish_variants
from rlmopt.task import split
from rlmopt.tools import ToolSet
from rlmopt.lm import FunctionLM
from tests.rlmopt_fakes import toy_harness, toy_task

RATIONALE = "adds the directive for field a so that more items are answered right"


def run(coro):
    return asyncio.run(coro)


def test_splits_are_seeded_disjoint_and_order_free():
    task = toy_task()
    s1, s2 = split(task, 7), split(toy_task(), 7)
    assert [e.id for e in s1.val] == [e.id for e in s2.val]
    ids = [e.id for part in (s1.train, s1.val, s1.test) for e in part]
    assert len(ids) == len(set(ids)) == 100 and s1.sizes() == {"train": 20, "val": 40, "test": 40}
    task.examples.reverse()
    assert [e.id for e in split(task, 7).test] == [e.id for e in s1.test]
    assert [e.id for e in split(task, 8).test] != [e.id for e in s1.test]


def test_metrics_against_hand_values():
    assert metrics.exact_match("The Cat!", "cat") == 1.0
    assert metrics.token_f1("red big cat", "big cat") == pytest.approx(0.8)
    assert metrics.label_match("True. Because it is.", "true") == 1.0
    assert metrics.label_match("untrue", "true") == 0.0
    assert metrics.set_match(["x", "y"], ["y", "z", "w"]) == pytest.approx(2 / 5)
    assert metrics.set_match([], []) == 1.0
    assert metrics.span_match("it was Paris, France", "paris") == 1.0
    assert metrics.constraint_pass("hello world", [{"type": "contains", "value": "hello"},
                                                   {"type": "max_words", "value": 1}]) == 0.5
    gold = [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]
    pred = json.dumps([{"name": "f", "arguments": {"x": 2}}])
    assert metrics.sequence_match(json.dumps(gold), gold) == 1.0 and metrics.sequence_match(pred, gold) == 0
    assert metrics.tool_precision(pred, gold) == 1.0 and metrics.tool_recall(pred, gold) == 0.5
    assert metrics.argument_match(pred, gold) == pytest.approx(0.0)
    assert metrics.tool_precision("[]", []) == 1.0 and metrics.tool_precision(pred, []) == 0.0
    assert metrics.json_valid("not json", gold) == 0.0
    assert metrics.final_state_equal('{"a": 1}', {"a": 1}) == 1.0
    assert metrics.composite({"a": 1.0, "b": 0.0}, {"a": 3, "b": 1}) == pytest.approx(0.75)


def test_budget_charges_only_run_candidate_task_lm_calls():
    h = toy_harness(budget=50)
    run(h.evaluate_seed())
    assert h.state.rollouts_used == 0 and h.meter.calls["task"] == 40  # seed is free
    fb = run(h.run_candidate("A<50 for {x}", n=10))
    assert h.state.rollouts_used == 10 and fb["budget_left"] == 40 and fb["n"] == 10
    run(h.run_candidate("A<50 for {x}", n=10))  # cached: no task-LM call, no charge
    assert h.state.rollouts_used == 10
    fb = run(h.run_candidate("A<60 for {x}"))
    assert h.state.rollouts_used == 50
    refused = run(h.run_candidate("A<70 for {x}", n=1))
    assert "budget" in refused["error"] and h.state.rollouts_used == 50


def test_feedback_record_has_fields_and_mismatches():
    h = toy_harness()
    run(h.evaluate_seed())
    fb = run(h.run_candidate("A<50 for {x}"))
    assert set(fb["fields"]) == {"a", "b"} and fb["fields"]["b"] == 0.0
    assert fb["composite"] == pytest.approx((fb["fields"]["a"] + fb["fields"]["b"]) / 2)
    assert fb["mismatches"] and "MISMATCHES" in fb["summary"] and "composite=" in fb["summary"]


def _commit(h, text, **kw):
    run(h.run_candidate(text))
    return h.commit_prompt(text, kw.get("rationale", RATIONALE))


def test_floor_rejects_a_field_regression_and_is_auto_on_for_small_sets():
    h = toy_harness()
    run(h.evaluate_seed())
    assert _commit(h, "B<100 for {x}")["accepted"]  # b perfect
    # a perfect but b lost: composite rises (0.5 -> 0.5 + ...) yet b regresses past the floor
    r = _commit(h, "A<100 B%2 for {x}")
    assert not r["accepted"] and any("regression floor: field b" in x for x in r["reasons"])
    ok = toy_harness(commit_policy="allow_field_regression")
    run(ok.evaluate_seed())
    _commit(ok, "B<100 for {x}")
    assert _commit(ok, "A<100 B%2 for {x}")["accepted"]  # floor off on 40 records
    small = toy_harness(task=toy_task(30, (5, 15, 10)), commit_policy="allow_field_regression")
    run(small.evaluate_seed())
    _commit(small, "B<100 for {x}")
    r = _commit(small, "A<100 B%2 for {x}")
    assert not r["accepted"] and any("regression floor" in x for x in r["reasons"])


def test_significance_gate_rejects_noise_and_accepts_a_real_gain():
    h = toy_harness()
    run(h.evaluate_seed())
    val_items = sorted(int(i[1:]) for i in h.val_order)
    one = val_items[0] + 1  # exactly one validation item becomes right on field a
    r = _commit(h, f"A<{one} for {{x}}")
    assert not r["accepted"] and any("significance gate" in x for x in r["reasons"])
    assert h.state.best_id == h.state.seed_id
    r = _commit(h, "A<100 for {x}")
    assert r["accepted"] and h.state.best_id == r["candidate_id"] and h.state.commits == [r["candidate_id"]]
    mean, se = gates.paired_stats([1, 0, 1, 1], [0, 0, 1, 0])
    assert mean == pytest.approx(0.5) and se == pytest.approx(0.2886751, rel=1e-6)


def test_guards_placeholder_length_rationale_and_full_validation():
    h = toy_harness(max_candidate_chars=200)
    run(h.evaluate_seed())
    r = _commit(h, "A<100 for the item")  # drops {x}
    assert any("placeholder guard" in x for x in r["reasons"])
    r = _commit(h, "A<100 for {x}" + " pad" * 100)
    assert any("length guard" in x for x in r["reasons"])
    r = _commit(h, "A<100 for {x}", rationale="better")
    assert any("rationale guard" in x for x in r["reasons"])
    run(h.run_candidate("A<99 for {x}", n=5))
    r = h.commit_prompt("A<99 for {x}", RATIONALE)
    assert any("whole validation split" in x for x in r["reasons"]) and not r["accepted"]


def test_diagnose_gate_warns_refuses_without_charge_releases_and_resets():
    sub = FunctionLM(lambda p: "root cause: the code table is missing; rule: add it")
    h = toy_harness(sub_lm=sub)
    tools = ToolSet(h)
    run(h.evaluate_seed())
    # three near-best candidates (all score 0 like the seed)
    assert "warning" not in run(h.run_candidate("noise one {x}"))
    assert "warning" in run(h.run_candidate("noise two {x}"))
    assert "warning" in run(h.run_candidate("noise three {x}"))
    used = h.state.rollouts_used
    r1, r2 = run(h.run_candidate("noise four {x}")), run(h.run_candidate("noise four {x}"))
    assert "REFUSED" in r1["error"] and "REFUSED" in r2["error"] and h.state.rollouts_used == used
    third = run(h.run_candidate("noise four {x}"))  # let through after two refusals
    assert "composite" in third and h.state.rollouts_used == used + 40
    assert "REFUSED" in run(h.run_candidate("noise five {x}"))["error"]  # re-armed
    out = run(tools.call("synthesize_failures", [], {"field": "a"}))
    assert "root cause" in out["analysis"] and h.gate.near_count == 0
    assert "composite" in run(h.run_candidate("noise five {x}"))
    # a large score change resets the count
    h.gate.near_count = 2
    run(h.run_candidate("A<100 B<100 {x}"))
    assert h.gate.near_count == 0
    # off without a sub-LM
    h2 = toy_harness()
    run(h2.evaluate_seed())
    for k in range(5):
        assert "error" not in run(h2.run_candidate(f"noise {k} {{x}}"))


def test_pareto_pick_is_the_composite_best_on_the_frontier():
    assert pareto_frontier([{"a": 1, "b": 0}, {"a": 0, "b": 1}, {"a": 0, "b": 0.5}]) == [0, 1]

    class E:
        def __init__(self, a, b, w=(0.5, 0.5)):
            self.fields = {"a": a, "b": b}
            self.composite = w[0] * a + w[1] * b
    evals = [E(0.2, 0.2), E(0.9, 0.1), E(0.4, 0.5), E(0.3, 0.5)]
    assert pick(evals) == 1  # 0.5 beats 0.45; E(0.3, 0.5) is dominated
    assert pick([E(0.5, 0.5), E(0.5, 0.5)]) == 0  # ties go to the earliest (the seed)


def test_polish_variants_compete_and_final_never_below_seed():
    # a rewrite under half the source length is discarded, although it would score best
    sub = FunctionLM(lambda p: "{x} B<100")
    h = toy_harness(sub_lm=sub)
    run(h.evaluate_seed())
    _commit(h, "A<100 for {x}. Answer with a JSON object holding the fields a and b, nothing else.")
    labels = [label for label, _ in run(polish_variants(h))]
    assert labels == ["polish:seed_statement", "polish:demos3", "polish:demos8", "polish:demos15"]
    h.sub_lm.lm.fn = lambda p: p.split("-----\n", 1)[1] + " B<100 and keep it all"
    variants = dict(run(polish_variants(h)))
    assert "polish:rewrite" in variants and "B<100" in variants["polish:rewrite"]["system_prompt"]
    result = run(finalize(h))
    assert result.chosen_label == "polish:rewrite" and result.val.composite == 1.0
    assert {p["label"] for p in result.pool} >= {"seed", "commit1", "polish:demos3"}
    assert result.val.composite >= result.seed_val.composite and result.test.split == "test"


def test_run_directory_resumes_without_task_lm_calls(tmp_path):
    h = toy_harness(run_dir=tmp_path, budget=200)
    run(h.evaluate_seed())
    _commit(h, "A<100 for {x}")
    used, best = h.state.rollouts_used, h.state.best_id
    h2 = toy_harness(run_dir=tmp_path, budget=200)
    assert h2.state.rollouts_used == used and h2.state.best_id == best
    calls = h2.meter.calls["task"]
    run(h2.evaluate_seed())
    fb = run(h2.run_candidate("A<100 for {x}"))
    assert h2.meter.calls["task"] == calls and fb["composite"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="holds another run"):
        toy_harness(run_dir=tmp_path, budget=200, seed=8)


def test_judge_rationales_join_the_feedback():
    from rlmopt.config import RLMOptConfig
    from rlmopt.harness import Harness
    from tests.rlmopt_fakes import toy_lm
    judge = FunctionLM(lambda p: "the output is a placeholder, not the item's code")
    h = Harness(toy_task(), toy_lm(), RLMOptConfig(budget=100), judge_lm=judge)
    fb = run(h.run_candidate("A<50 for {x}"))
    assert len(fb["judge"]) == 3 and "judge on" in fb["summary"] and len(judge.prompts) == 3
    assert h.meter.calls["judge"] == 3 and h.state.rollouts_used == 40  # the judge is not charged


def test_record_has_the_schema_keys(tmp_path):
    from rlmopt import record
    h = toy_harness(run_dir=tmp_path)
    run(h.evaluate_seed())
    _commit(h, "A<100 for {x}")
    rec = record.build_record(h, run(finalize(h)), method="rlmopt", task_lm="fake", optimizer_lm="fake")
    record.write(tmp_path, rec)
    loaded = json.loads((tmp_path / "record.json").read_text())
    for key in ("method", "bench", "seed", "task_lm", "rollouts_used", "wall_clock_s", "val_score",
                "test_score", "per_example_test", "cost_usd_estimate", "extra"):
        assert key in loaded
    assert set(loaded["extra"]) >= {"api_calls", "prompt_tokens", "completion_tokens", "total_tokens"}
    assert len(loaded["per_example_test"]) == 40 and loaded["rollouts_used"] == 40
    assert "| seed |" in (tmp_path / "summary.md").read_text()


def test_multi_component_candidates_edit_one_component_and_demos_go_to_demonstrations():
    task = toy_task()
    task.seed_candidate = {"system_prompt": "Answer for {x}.", "demonstrations": ""}
    h = toy_harness(task=task)
    run(h.evaluate_seed())
    fb = run(h.run_candidate({"demonstrations": "A<100"}))  # system_prompt kept from the best
    cand = h.state.candidates[fb["candidate_id"]]
    assert cand == {"system_prompt": "Answer for {x}.", "demonstrations": "A<100"}
    assert fb["fields"]["a"] == 1.0
    assert h.commit_prompt(fb["candidate_id"], RATIONALE)["accepted"]
    variants = dict(run(polish_variants(h)))
    demo3 = variants["polish:demos3"]
    assert demo3["system_prompt"] == "Answer for {x}." and demo3["demonstrations"].startswith("A<100")
    assert demo3["demonstrations"].count("Output: ") == 3
    assert "error" in run(ToolSet(h).call("run_candidate", [{"nope": "x"}]))


def test_a_failed_task_lm_call_scores_wrong_and_is_asked_again_after_a_resume(tmp_path):
    from rlmopt.lm import BackendError
    from tests.rlmopt_fakes import _toy_reply

    def flaky(prompt):  # items 1 and 10-19 time out
        if re.search(r"item 1\d?\b", prompt):
            raise BackendError("llm_timeout", "no reply")
        return _toy_reply(prompt)
    h = toy_harness(run_dir=tmp_path)
    h.task_lm.lm = FunctionLM(flaky)
    run(h.evaluate_seed())
    fb = run(h.run_candidate("A<100 for {x}."))
    failed = [i for i in h.val_order if h.replies[(fb["candidate_id"], i)].startswith("[task LM error")]
    assert failed and fb["fields"]["a"] == pytest.approx(1 - len(failed) / 40)
    stored = (tmp_path / "replies.jsonl").read_text()
    assert "task LM error" not in stored and stored.count("\n") == 80 - 2 * len(failed)
    assert h.meter.calls["task"] == 80  # failed calls are counted too
    h2 = toy_harness(run_dir=tmp_path)
    fb2 = run(h2.run_candidate("A<100 for {x}."))
    assert h2.meter.calls["task"] == 80 + 2 * len(failed) and fb2["fields"]["a"] == 1.0


def test_refused_commits_and_oversized_candidates_stay_out_of_the_saved_state(tmp_path):
    """20 refused commits of 100 kB candidates and an oversized run_candidate leave state.json
    as it was (give or take their history lines) and charge nothing."""
    h = toy_harness(run_dir=tmp_path)
    run(h.evaluate_seed())
    before = (tmp_path / "state.json").stat().st_size
    big = "A<50 for {x} " + "z" * 100_000
    for k in range(20):
        r = h.commit_prompt(big + str(k), RATIONALE)
        assert not r["accepted"] and any("length guard" in x for x in r["reasons"]), r
    r = h.commit_prompt("A<50 for {x}", RATIONALE)  # refused: not evaluated on validation
    assert not r["accepted"] and r["candidate_id"] not in h.state.candidates
    out = run(h.run_candidate(big))
    assert "max_candidate_chars" in out["error"] and h.state.rollouts_used == 0, out
    h.save()
    assert len(h.state.candidates) == 1  # the seed
    assert (tmp_path / "state.json").stat().st_size < before + 22 * 1000
    fb = run(h.run_candidate("A<50 for {x}"))  # an evaluated candidate is kept, and committable
    assert fb["candidate_id"] in h.state.candidates and h.commit_prompt(fb["candidate_id"],
                                                                         RATIONALE)["accepted"]
