"""Before / after evaluations compared question by question (workflow_r1/eval/compare.py), against
NumPy, and a run's curves drawn from its metrics (workflow_r1/eval/curves.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workflow_r1.eval import compare, curves


def _row(qid, em, fmt, ops):
    return {"id": qid, "reward_outcome": 1.0 if em else 0.0, "reward_format": 0.0 if fmt else -0.5,
            "operators": ops, "operator_rounds": sum(ops.values())}


def test_paired_changes_equal_numpy_and_ignore_question_order():
    rng = np.random.default_rng(0)
    n = 40
    b_em, a_em = rng.random(n) < 0.3, rng.random(n) < 0.6
    b_fmt, a_fmt = rng.random(n) < 0.5, rng.random(n) < 0.9
    b_s, a_s = rng.integers(0, 3, n), rng.integers(0, 2, n)
    before = [_row(f"q{i}", b_em[i], b_fmt[i], {"Search": int(b_s[i]), "Custom": 1} if i % 3 else {}) for i in range(n)]
    after = [_row(f"q{i}", a_em[i], a_fmt[i], {"Search": int(a_s[i])}) for i in range(n)][::-1]  # another order
    rows = {r.name: r for r in compare.paired(before, after)}
    listed = np.arange(n) % 3 != 0  # the rows whose operators were given
    for name, b, a in (("EM", b_em, a_em), ("format valid", b_fmt, a_fmt), ("calls: Search", b_s * listed, a_s)):
        d = a.astype(float) - b.astype(float)
        r = rows[name]
        assert (r.before, r.after, r.n) == pytest.approx((b.mean(), a.mean(), n))
        assert r.diff == pytest.approx(d.mean()) and r.diff_stderr == pytest.approx(d.std(ddof=1) / np.sqrt(n))
        assert r.z == pytest.approx(d.mean() / (d.std(ddof=1) / np.sqrt(n)))
    custom = np.array([1 if i % 3 else 0 for i in range(n)])
    assert rows["calls: Custom"].diff == pytest.approx(-custom.mean())
    total_b = np.array([b_s[i] + 1 if i % 3 else 0 for i in range(n)])
    assert rows["operator calls"].diff == pytest.approx((a_s - total_b).mean())
    table = compare.markdown(list(rows.values()), after_step=16)
    assert table.count("\n| ") == len(rows) + 1 and "after (step 16)" in table and "| EM | " in table


def test_different_questions_are_refused():
    with pytest.raises(ValueError, match="different questions"):
        compare.paired([_row("a", 1, 1, {})], [_row("b", 1, 1, {})])


def test_curves_read_each_steps_last_record_and_draw_a_png(tmp_path):
    records = [{"step": 0, "eval/em": 0.2, "eval/format_ok": 0.5},
               {"step": 1, "rollout/reward": -1.0, "rollout/calls/Search": 0.5, "time/step_s": 9.0},
               {"step": 2, "rollout/reward": 0.1, "rollout/calls/Search": 0.9, "eval/em": 0.6, "time/step_s": 8.0},
               {"step": 1, "rollout/reward": -0.5, "rollout/calls/Search": 0.7, "time/step_s": 9.5}]  # rewritten on resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = curves.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["rollout/reward"] == -0.5
    out = curves.plot(rows, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
