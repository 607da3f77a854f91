"""The loss ablation: the operator task's reward against the workflow reward on equivalent texts,
a short run of two losses with one seed writing the PNG, the table and the JSON, the table's
statistics on known numbers, and reading a train.py run's metrics."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workflow_r1.ablation import operator_task as ot
from workflow_r1.ablation import report, runs
from workflow_r1.env.reward import compute_reward

# (final answer token or -1, malformed) -> the same episode as a workflow response text.
THINK = "<think>t</think>"
CASES = {
    (ot.RIGHT, False): THINK + "<tool>x</tool><info>i</info>" + THINK + "<answer>gold</answer>",
    (ot.WRONG, False): THINK + "<tool>x</tool><info>i</info>" + THINK + "<answer>other</answer>",
    (ot.NOTHING, False): THINK + "<answer> </answer>",
    (ot.RIGHT, True): "garbage" + THINK + "<tool>x</tool><info>i</info>" + "<answer>gold</answer>",
    (ot.WRONG, True): "<answer>other</answer>",
    (-1, False): THINK + "<tool>x</tool><info>i</info>",
    (-1, True): "nothing",
}


def test_operator_task_reward_is_the_workflow_reward():
    keys = list(CASES)
    s = ot.score(np.array([a for a, _ in keys]), np.array([m for _, m in keys]))
    for i, key in enumerate(keys):
        ref = compute_reward(CASES[key], ["gold"])
        assert (s["reward"][i], s["outcome"][i]) == (ref.total, ref.outcome), key
        assert s["format_ok"][i] == (ref.format == 0.0) and s["em"][i] == (ref.outcome == 1.0), key


def test_short_ablation_writes_png_table_and_json(tmp_path):
    results = runs.run_operators(["grpo"], seeds=1, steps=3, overrides=[],
                                 task_overrides={"questions": 8, "group": 4, "eval_questions": 32})
    paths = report.write(results, tmp_path, "abl")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    table = paths["md"].read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| GRPO (token) | ")
    saved = json.loads(paths["json"].read_text())
    run = saved["variants"]["grpo"]["seeds"]["0"]
    assert len(run["curve"]) == 3 and {"reward", "em", "format_ok", "calls"} <= set(run["curve"][0])
    assert run["final"]["episodes"] == 32
    # The train section is the config file's loss with the task's optimiser.
    assert saved["variants"]["grpo"]["train"]["granularity"] == "token"
    assert saved["variants"]["grpo"]["train"]["learning_rate"] == 3e-3


def _fake_results():
    def run(em, rewards):
        return {"curve": [{"reward": r, "em": 0.0, "format_ok": 1.0, "calls": 1.0} for r in rewards],
                "final": {"em": em, "em_stderr": 0.0, "episodes": 100}}

    return {"reference": "gsspo", "variants": {
        "gsspo": {"label": "GSsPO", "seeds": {"0": run(0.5, [0, 1]), "1": run(0.7, [0, 1]), "2": run(0.9, [0, 1])}},
        "grpo": {"label": "GRPO", "seeds": {"0": run(0.4, [0, 0]), "1": run(0.7, [0, 0]), "2": run(0.7, [0, 0])}}}}


def test_table_means_standard_errors_and_paired_differences():
    rows = {line.split("|")[1].strip(): line.split("|") for line in report.table(_fake_results()).splitlines()[2:]}
    assert rows["GSsPO"][2].strip() == f"0.700 ± {0.2 / np.sqrt(3):.3f}"
    # GRPO - GSsPO per seed: -0.1, 0.0, -0.2 -> mean -0.1, s.e. 0.1 / sqrt(3).
    assert rows["GRPO"][4].strip() == f"-0.100 ± {0.1 / np.sqrt(3):.3f}"
    assert rows["GSsPO"][4].strip() == "—"
    assert rows["GSsPO"][5].strip() == "0.500" and rows["GRPO"][5].strip() == "0.000"
    np.testing.assert_allclose(report.smooth(np.array([[1.0, 3.0, 5.0, 7.0]]), 2), [[1.0, 2.0, 4.0, 6.0]])


def test_read_workflow_run(tmp_path):
    lines = [{"step": 0, "eval/em": 0.1}, {"step": 1, "rollout/reward": -1.0, "rollout/em": 0.0,
                                           "rollout/format_ok": 0.5, "rollout/calls": 2.0},
             {"step": 2, "rollout/reward": 0.5, "rollout/em": 0.5, "rollout/format_ok": 1.0, "rollout/calls": 1.0,
              "eval/em": 0.25, "eval/em_stderr": 0.1, "eval/episodes": 8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = runs.read_workflow_run(tmp_path)
    assert [r["reward"] for r in run["curve"]] == [-1.0, 0.5] and run["curve"][0]["calls"] == 2.0
    assert run["final"] == {"em": 0.25, "em_stderr": 0.1, "episodes": 8}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ValueError, match="did not finish"):
        runs.read_workflow_run(tmp_path)
