"""The harness rules with a deterministic fake task LM: splits, budget accounting, the commit
rules (floor, significance, guards), the diagnose gate, final selection, record and resume."""
import asyncio
import json
import re

import numpy as np
import pytest

from rlmopt import gates, metrics
from rlmopt.config import RLMOptConfig
from rlmopt.selection import DEMO_HEADER, finalize, pareto_frontier, pick, polish_variants
from rlmopt.task import split
from rlmopt.tools import ToolSet
from rlmopt.lm import FunctionLM
from tests.rlmopt_fakes import sealed_patterns, toy_harness, toy_items, toy_task

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


# -- the gates at their boundaries ----------------------------------------------------------------

def _commit_fields(h, text):
    """(full-validation fields, commit result) of `text` against the running best."""
    fb = run(h.run_candidate(text))
    return fb["fields"], h.commit_prompt(text, RATIONALE)


def test_floor_tolerance_allows_a_drop_of_field_floor_and_refuses_one_more_record():
    h = toy_harness()  # commit_policy no_field_regression: the floor is on; 40 validation records
    run(h.evaluate_seed())
    assert _commit(h, "B<100 for {x}")["accepted"]  # b = 1.0
    first = h.val_order[:3]
    # Field a goes to 1.0 (a significant gain); field b loses 3 records: 0.075 > field_floor 0.05.
    fields, r = _commit_fields(h, f"A<100 B!{toy_items(h, first)} for {{x}}")
    assert fields == {"a": 1.0, "b": pytest.approx(37 / 40)}
    assert not r["accepted"] and len(r["reasons"]) == 1
    assert r["reasons"][0].startswith("regression floor: field b drops 1.000 -> 0.925")
    # Two records: a drop of exactly field_floor (s_b >= b_b - 0.05 holds) is accepted.
    fields, r = _commit_fields(h, f"A<100 B!{toy_items(h, first[:2])} for {{x}}")
    assert fields == {"a": 1.0, "b": pytest.approx(38 / 40)} and r["accepted"], r["reasons"]


@pytest.mark.parametrize("n_val, floor_on", [(20, True), (21, False)])
def test_floor_switches_on_by_itself_up_to_small_dataset_records(n_val, floor_on):
    h = toy_harness(task=toy_task(40, (5, n_val, 10)), commit_policy="allow_field_regression")
    assert h.config.small_dataset_records == 20 and gates.floor_active(h.config, n_val) is floor_on
    assert gates.floor_active(RLMOptConfig(), n_val)  # always on under no_field_regression
    run(h.evaluate_seed())
    assert _commit(h, "B<100 for {x}")["accepted"]
    fields, r = _commit_fields(h, f"A<100 B!{toy_items(h, h.val_order[:3])} for {{x}}")  # b drops 0.15
    assert fields["a"] == 1.0 and fields["b"] == pytest.approx(1 - 3 / n_val)
    assert r["accepted"] is not floor_on and len(r["reasons"]) == floor_on
    assert all(x.startswith("regression floor: field b") for x in r["reasons"])


@pytest.mark.parametrize("n_val, gained, significance_k, ratio, accepted", [
    (10, 2, None, 1.5, False),  # 1.5 SE: under the default 1.65
    (9, 3, None, 2.0, True),    # 2.0 SE: over it
    (9, 3, 2.58, 2.0, False),   # the same 2.0 SE under a 2.58-SE threshold
])
def test_significance_gate_at_1_5_and_2_0_standard_errors(n_val, gained, significance_k, ratio, accepted):
    kw = {} if significance_k is None else {"significance_k": significance_k}
    h = toy_harness(task=toy_task(30, (5, n_val, 10)), **kw)
    run(h.evaluate_seed())  # the seed scores 0 everywhere
    text = f"A={toy_items(h, h.val_order[:gained])} for {{x}}"  # field a right on `gained` records
    fields, r = _commit_fields(h, text)
    # The paired differences are 0.5 on the gained records and 0 elsewhere; their mean in SEs:
    d = np.array([0.5] * gained + [0.0] * (n_val - gained))
    assert d.mean() / (d.std(ddof=1) / np.sqrt(n_val)) == pytest.approx(ratio)
    assert fields == {"a": pytest.approx(gained / n_val), "b": 0.0}
    assert r["accepted"] is accepted
    if not accepted:
        assert len(r["reasons"]) == 1 and r["reasons"][0].startswith("significance gate")


def test_standard_errors_use_the_n_minus_1_standard_deviation():
    rng = np.random.default_rng(0)
    new, old = rng.random(7), rng.random(7)
    d = new - old
    mean, se = gates.paired_stats(list(new), list(old))
    assert mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / np.sqrt(7))
    assert gates.standard_error(list(new)) == pytest.approx(new.std(ddof=1) / np.sqrt(7))
    assert gates.standard_error([0.3]) == 0.0 and gates.paired_stats([0.5], [0.25]) == (0.25, 0.0)


def test_diagnose_gate_band_is_1_5_standard_errors_of_the_best_with_n_minus_1():
    h = toy_harness(sub_lm=FunctionLM(lambda p: "root cause: x; rule: y"))
    run(h.evaluate_seed())
    first = h.val_order[:6]
    wrong = toy_items(h, first[:3])
    assert _commit(h, f"A!{wrong} B!{wrong} for {{x}}")["accepted"]
    assert h.gate.near_count == 0
    # On the first 6 validation records the best scores 0, 0, 0, 1, 1, 1: band = 1.5 SE with the
    # n-1 sd is 0.335; with the n sd it would be 0.306. A candidate right on 5 of the 6 is 1/3 away.
    best = np.array([0, 0, 0, 1, 1, 1.0])
    band = 1.5 * best.std(ddof=1) / np.sqrt(6)
    assert 1.5 * best.std(ddof=0) / np.sqrt(6) < 1 / 3 < band
    assert gates.standard_error(h.scores(h.state.best_id, first).composites) == pytest.approx(band / 1.5)
    r1 = run(h.run_candidate(f"A={toy_items(h, first[1:])} B={toy_items(h, first[1:])} for {{x}}", n=6))
    others = first[:1] + first[2:]
    r2 = run(h.run_candidate(f"A={toy_items(h, others)} B={toy_items(h, others)} for {{x}}", n=6))
    assert r1["composite"] == r2["composite"] == pytest.approx(5 / 6)
    assert "warning" not in r1 and "warning" in r2 and h.gate.near_count == 2  # both near-best
    # All 6 right: 1/2 away, outside the band: the count starts again.
    r3 = run(h.run_candidate("A<100 B<100 for {x}", n=6))
    assert r3["composite"] == 1.0 and "warning" not in r3 and h.gate.near_count == 0


def test_final_selection_registers_no_candidate_holding_a_test_record():
    """The polish stage and final selection see the test split only to score the pick and the
    seed: no candidate the harness registers (commits, the claim, every polish variant), and no
    prompt the sub-LM is shown, holds a test id, input or gold, and the demos are training records."""
    sub = FunctionLM(lambda p: p.split("-----\n", 1)[1] + " and keep every rule")  # a full rewrite
    h = toy_harness(sub_lm=sub, polish_demos=(3, 8, 15, 20))  # 20: the whole training split
    run(h.evaluate_seed())
    assert _commit(h, "A<100 for {x}")["accepted"]
    run(h.run_candidate("A<60 for {x}"))
    assert run(ToolSet(h).call("final", ["A<60 for {x}"]))["finished"]
    result = run(finalize(h))
    labels = {p["label"] for p in result.pool}
    assert labels == {"seed", "commit1", "claimed", "polish:seed_statement", "polish:demos3",
                      "polish:demos8", "polish:demos15", "polish:demos20", "polish:rewrite"}
    assert {p["candidate_id"] for p in result.pool} <= set(h.state.candidates)
    forbidden = sealed_patterns(h)
    shown = [json.dumps(c) for c in h.state.candidates.values()] + sub.prompts
    for text in shown:
        for pat in forbidden:
            assert not pat.search(text), f"{pat.pattern} in {text[:200]!r}"
    demos20 = h.state.candidates[next(p["candidate_id"] for p in result.pool if p["label"] == "polish:demos20")]
    shown_items = set(re.findall(r"item \d+", demos20["system_prompt"]))
    assert shown_items == {e.inputs["x"] for e in h.splits.train}
    # Only the pick and the seed were ever run on the test split.
    on_test = {cid for cid, i in h.replies if h.split_of[i] == "test"}
    assert on_test == {result.chosen_id, h.state.seed_id}


def test_guards_at_their_boundaries():
    cfg = RLMOptConfig(max_candidate_chars=40, min_rationale_words=5)
    seed = {"system_prompt": "Answer for {x}.", "demonstrations": ""}
    five = "one two three four five"
    # 40 characters in all (the limit), five words of rationale (the minimum), and a component
    # left as empty as the seed's: no guard objects.
    ok = {"system_prompt": "Answer for {x}." + "!" * 25, "demonstrations": ""}
    assert sum(map(len, ok.values())) == 40 and gates.guard_reasons(ok, seed, five, cfg) == []
    over = gates.guard_reasons({**ok, "system_prompt": ok["system_prompt"] + "!"}, seed, five, cfg)
    assert len(over) == 1 and over[0].startswith("length guard: 41 characters exceed")
    short = gates.guard_reasons(ok, seed, "one two three four", cfg)
    assert len(short) == 1 and short[0].startswith("rationale guard")
    emptied = gates.guard_reasons({"system_prompt": " \n", "demonstrations": "{x}"}, seed, five, cfg)
    assert emptied == ["length guard: component(s) ['system_prompt'] are empty"]


def test_polish_works_on_the_running_best_and_replaces_its_demo_block():
    """Polish variants are built from the running best, not from the agent's claim; a best that
    already holds a demo block gets it replaced, not stacked."""
    sub = FunctionLM(lambda p: p.split("-----\n", 1)[1] + " and keep every rule")
    h = toy_harness(sub_lm=sub)
    run(h.evaluate_seed())
    best = f"A<100 for {{x}}\n\n{DEMO_HEADER}\n\nstale example\nOutput: stale"
    assert _commit(h, best)["accepted"]
    run(h.run_candidate("A<60 for {x}"))
    assert run(ToolSet(h).call("final", ["A<60 for {x}"]))["finished"]  # the claim, which polish must not touch
    variants = dict(run(polish_variants(h)))
    assert set(variants) == {"polish:seed_statement", "polish:demos3", "polish:demos8", "polish:demos15",
                             "polish:rewrite"}
    assert all(v["system_prompt"].count("A<100 for {x}") == 1 and "A<60" not in v["system_prompt"]
               for v in variants.values())
    assert sub.prompts[-1].endswith("-----\n" + best)
    for k in (3, 8, 15):
        text = variants[f"polish:demos{k}"]["system_prompt"]
        assert text.count(DEMO_HEADER) == 1 and "stale" not in text and text.count("Output: ") == k


def test_polish_rewrite_is_kept_from_half_the_source_length_and_with_every_template_variable():
    reply = {"text": ""}
    h = toy_harness(sub_lm=FunctionLM(lambda p: reply["text"]))  # the seed is the running best
    source = h.best["system_prompt"]
    half = -(-len(source) // 2)  # the shortest length >= len(source) / 2

    def rewrite(text):
        reply["text"] = text
        return dict(run(polish_variants(h))).get("polish:rewrite")

    assert rewrite("{x}" + "r" * (half - 3)) == {"system_prompt": "{x}" + "r" * (half - 3)}
    assert rewrite("{x}" + "r" * (half - 4)) is None  # one character under half the source
    assert rewrite("r" * len(source) * 2) is None  # long enough, but {x} is gone
    assert rewrite("{x} {y}" + "r" * len(source)) is not None  # a variable added is kept


def test_pool_labels_a_candidate_by_its_first_role():
    h = toy_harness(polish_variants=False)
    run(h.evaluate_seed())
    commit = _commit(h, "A<100 for {x}")["candidate_id"]
    run(ToolSet(h).call("final", [commit]))  # the claim is the commit
    result = run(finalize(h))
    assert [(p["label"], p["candidate_id"]) for p in result.pool] == [("seed", h.state.seed_id),
                                                                       ("commit1", commit)]
    assert result.chosen_label == "commit1"


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


def test_claims_are_capped_and_must_be_paid_for_like_commits(tmp_path):
    """final(candidate=...) with 20 oversized candidates and with one never evaluated on the whole
    validation split: each is refused, the search goes on, nothing joins state.json (the final
    stage would score a claim on validation for free). A claim evaluated by run_candidate (charged)
    is accepted and ends the search."""
    h = toy_harness(run_dir=tmp_path)
    run(h.evaluate_seed())
    tools = ToolSet(h)
    before = (tmp_path / "state.json").stat().st_size
    big = "A<50 for {x} " + "z" * 100_000
    for k in range(20):
        out = run(tools.call("final", [big + str(k)]))
        assert "max_candidate_chars" in out["error"] and not tools.finished, out
    out = run(tools.call("final", ["A<50 for {x}"]))
    assert "not evaluated on the whole validation split" in out["error"], out
    half = run(h.run_candidate("A<60 for {x}", n=3))
    out = run(tools.call("final", [half["candidate_id"]]))
    assert "not evaluated on the whole validation split" in out["error"], out
    assert "missing" in run(tools.call("final", ["A<50 for nothing"]))["error"]  # placeholder guard
    assert not tools.finished and h.state.claimed_id is None and h.state.rollouts_used == 3
    assert set(h.state.candidates) == {h.state.seed_id, half["candidate_id"]}
    assert (tmp_path / "state.json").stat().st_size < before + 24 * 1000
    fb = run(h.run_candidate("A<50 for {x}"))
    assert run(tools.call("final", ["A<50 for {x}"])) == {"finished": True,
                                                          "claimed": fb["candidate_id"]}
    assert tools.finished and h.state.claimed_id == fb["candidate_id"]
