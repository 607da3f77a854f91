"""The loss ablation: the operator task's reward against the workflow reward on equivalent texts, its
environment through the rollout engine (scripted turns -> tokens, masks, rewards, EM statistics), a
short trainer run writing the run directory, the PNG, the table and the JSON, the table's
statistics on known numbers, and reading a train.py run's metrics."""
from __future__ import annotations

import json

import numpy as np
import pytest

from workflow_r1.envs import operators as ot
from workflow_r1.rollout import scripted
from workflow_r1 import metrics
from workflow_r1.ablation import report, runs
from workflow_r1.task.reward import compute_reward

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


class ScriptedPolicy(scripted.ScriptedPolicy):
    """A `rollout.engine.Policy` that plays fixed turns per row (two tokens each) with log-prob -0.25."""

    def __init__(self, scripts):
        super().__init__()
        self.scripts = scripts

    def turn(self, row, k, sequence):
        return list(self.scripts[row][k])

    def logprobs(self, row, k, ids):
        return np.full(len(ids), -0.25, np.float32)


def _operator_rollout(scripts, kinds):
    from workflow_r1.data.questions import Question
    from workflow_r1.rollout import RolloutConfig, RolloutEngine

    cfg = RolloutConfig(prompts_per_step=len(kinds), n=1, **ot.ROLLOUT)
    engine = RolloutEngine(ScriptedPolicy(scripts), cfg, ot.OperatorTaskEnvironment(cfg))
    questions = [Question(id=str(i), question=str(k), golden_answers=("RIGHT",), data_source="operators")
                 for i, k in enumerate(kinds)]
    return engine.run(questions)[0]


T = 15  # a thought token that is neither an operator nor ANSWER


def test_operator_environment_tokens_masks_and_rewards():
    from workflow_r1.rollout import pack, padded_length

    right = [int(ot.TARGET_OPERATOR[k]) for k in range(4)]
    scripts = [
        [(T, right[0]), (T, ot.ANSWER)],                        # call the right operator, answer: optimum
        [(T, ot.ANSWER)],                                        # answer at once: an empty answer
        [(T, right[0]), (T, 9), (T, ot.ANSWER)],                 # right call, a malformed turn, answer
        [(T, ot.OPERATORS[0] if right[3] != ot.OPERATORS[0] else ot.OPERATORS[1]), (T, ot.ANSWER)],  # wrong call
        [(T, right[0]), (T, right[0]), (T, right[0])],           # never answers: the turn cap ends it
    ]
    kinds = [0, 1, 0, 3, 0]
    episodes = _operator_rollout(scripts, kinds)
    answers = [ot.answer_of(e)[0] for e in episodes]
    assert answers == [ot.RIGHT, ot.NOTHING, ot.RIGHT, ot.WRONG, -1]
    ref = ot.score(np.array(answers), np.array([False, False, True, False, False]))
    np.testing.assert_array_equal([e.reward for e in episodes], ref["reward"])
    assert [e.finish_reason for e in episodes] == ["answer", "answer", "answer", "answer", "turn_cap"]
    length = padded_length(episodes, 4)
    assert length == ot.LENGTH
    batch = pack(episodes, np.zeros(len(episodes), np.float32), pad_id=ot.PAD, length=length)
    tokens, loss = np.asarray(batch.tokens), np.asarray(batch.loss_mask)
    # Row 0: [BOS, q] [T, op] [OBS, RIGHT] [T, ANSWER], then pads carrying no loss.
    np.testing.assert_array_equal(tokens[0], [ot.BOS, ot.KINDS[0], T, right[0], ot.OBS, ot.RIGHT, T, ot.ANSWER,
                                              0, 0, 0, 0])
    np.testing.assert_array_equal(loss[0], [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(loss[1], [0, 0, 1, 1] + [0] * 8)  # answered at once: everything after is padding
    np.testing.assert_array_equal(tokens[2][4:8], [ot.OBS, ot.RIGHT, T, 9])
    np.testing.assert_array_equal(tokens[2][8:10], [ot.OBS, ot.NOTHING])  # the malformed turn's warning
    np.testing.assert_array_equal(tokens[3][5], ot.WRONG)
    np.testing.assert_array_equal(loss[4], [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1])  # the third call gets no observation
    for b, e in enumerate(episodes):  # padding: pad token, no attention, no loss, no log-prob
        end = len(e.prompt_ids) + e.response_length
        assert np.all(tokens[b, end:] == ot.PAD) and np.all(loss[b, end:] == 0)
        assert np.all(np.asarray(batch.input_mask)[b, end:] == 0)
        np.testing.assert_array_equal(np.asarray(batch.sampler_logprobs)[b], np.where(loss[b] == 1, -0.25, 0.0))


def test_em_standard_error_uses_n_minus_1():
    from workflow_r1.rollout import episode_metrics

    # 2 of 5 right: s.e. of the mean = sqrt(p (1 - p) / (n - 1)) with the unbiased variance.
    scripts = [[(T, int(ot.TARGET_OPERATOR[0])), (T, ot.ANSWER)]] * 2 + [[(T, ot.ANSWER)]] * 3
    m = episode_metrics(_operator_rollout(scripts, [0] * 5))
    assert m["em"] == pytest.approx(0.4)
    assert m["em_stderr"] == pytest.approx(np.sqrt(0.4 * 0.6 / 4), rel=1e-12)


def test_short_ablation_runs_the_trainer_and_writes_png_table_and_json(tmp_path):
    small = ["rollout.prompts_per_step=8", "rollout.n=4", "eval.max_questions=32", "train.micro_batch_size=16",
             "checkpoint.every_steps=2", "train.grad_diagnostics_every=2"]
    results = runs.run_operators(["grpo"], seeds=1, steps=3, overrides=small, runs_dir=tmp_path / "abl" / "runs")
    run_dir = tmp_path / "abl" / "runs" / "grpo-seed0"
    # A trainer run directory: config, metrics, TensorBoard, checkpoints, trajectories, evaluation.
    assert {"config.json", "metrics.jsonl", "tensorboard", "checkpoints", "trajectories", "eval",
            "summary.json"} <= {p.name for p in run_dir.iterdir()}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    assert json.loads((run_dir / "config.json").read_text())["env"]["kind"] == "operators"
    paths = report.write(results, tmp_path, "abl")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    table = paths["md"].read_text().splitlines()
    assert table[2].startswith("| GRPO (token) | ")
    saved = json.loads(paths["json"].read_text())
    run = saved["variants"]["grpo"]["seeds"]["0"]
    assert len(run["curve"]) == 3 and {"reward", "em", "format_ok", "calls"} <= set(run["curve"][0])
    # The same-batch gradients of the logged step: their own figure, and a table row with numbers.
    assert [d["step"] for d in run["diagnostics"]] == [2]
    assert {k for _, keys in report.GRADIENTS for k, _ in keys} <= set(run["diagnostics"][0])
    assert paths["gradients_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table[-1].startswith("| GRPO (token) | ") and "nan" not in table[-1] and len(table) == 15
    assert run["final"]["episodes"] == 32
    # The train section is the config file's loss with the task's optimiser.
    assert saved["variants"]["grpo"]["train"]["granularity"] == "token"
    assert saved["variants"]["grpo"]["train"]["learning_rate"] == 3e-3
    # A finished run is read back, not repeated.
    again = runs.run_operators(["grpo"], seeds=1, steps=3, overrides=small, runs_dir=tmp_path / "abl" / "runs")
    assert again["variants"]["grpo"]["seeds"]["0"] == results["variants"]["grpo"]["seeds"]["0"]


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


def test_rise_table_pools_the_window_steps_of_every_seed():
    def run(rewards):
        return {"curve": [{"reward": r, "format_ok": 0.5, "em": 0.0, "calls": 1.0} for r in rewards]}

    results = {"variants": {"gsspo": {"label": "GSsPO", "seeds": {"0": run([0, 1, 2, 3, 9]), "1": run([1, 0, 3, 4])}}}}
    s = report.window_stats(results["variants"]["gsspo"]["seeds"], "reward", window=2)  # runs cut to 4 steps
    start, end = np.array([0, 1, 1, 0]), np.array([2, 3, 3, 4])  # steps 1-2 and 3-4 of both seeds
    se = [x.std(ddof=1) / 2 for x in (start, end)]
    assert (s["window"], s["start"], s["end"]) == (2, 0.5, 3.0)
    np.testing.assert_allclose([s["start_se"], s["end_se"], s["rise"]], [*se, 2.5 / np.hypot(*se)], rtol=1e-12)
    rows = report.rise_table(results, window=10).splitlines()  # 10 > half the run: windows of 2
    assert "reward, steps 1-2" in rows[0] and "reward, steps 3-4" in rows[0]
    assert rows[2].split("|")[2:5] == [" +0.500 ± 0.289 ", " +3.000 ± 0.408 ", " +5.0 "]
    assert "calls / episode, steps 3-4" in rows[0] and len(rows[2].split("|")) == 2 + 3 * 3 + 1
    assert rows[2].split("|")[8:10] == [" +1.000 ± 0.000 "] * 2  # the calls, not the format rate (0.5)
    assert np.isnan(report.window_stats(results["variants"]["gsspo"]["seeds"], "format_ok")["rise"])  # no spread


def test_gradients_table_means_over_steps_then_seeds():
    results = _fake_results()
    for seed, cos in (("0", [0.2, 0.4]), ("1", [0.6, 0.8])):
        results["variants"]["gsspo"]["seeds"][seed]["diagnostics"] = [
            {"step": 4 * (i + 1), "cos_token_sequence": c} for i, c in enumerate(cos)]
    assert report.has_diagnostics(results)
    rows = report.gradients_table(results).splitlines()
    assert len(rows) == 3 and rows[2].startswith("| GSsPO | ")  # GRPO logged none; seed 2 of GSsPO neither
    # Per seed the mean over steps (0.3, 0.7); over the seeds mean 0.5, sd 0.2 sqrt(2), s.e. 0.2.
    assert rows[2].split("|")[2].strip() == "0.500 ± 0.200"


def test_read_workflow_run(tmp_path):
    lines = [{"step": 0, "eval/em": 0.1}, {"step": 1, "rollout/reward": -1.0, "rollout/em": 0.0,
                                           "rollout/format_ok": 0.5, "rollout/calls": 2.0},
             {"step": 2, "rollout/reward": 0.5, "rollout/em": 0.5, "rollout/format_ok": 1.0, "rollout/calls": 1.0,
              "eval/em": 0.25, "eval/em_stderr": 0.1, "eval/episodes": 8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = runs.read_workflow_run(tmp_path)
    assert [r["reward"] for r in run["curve"]] == [-1.0, 0.5] and run["curve"][0]["calls"] == 2.0
    assert run["final"] == {"em": 0.25, "em_stderr": 0.1, "episodes": 8} and "diagnostics" not in run
    lines[2]["diag/cos_token_sequence"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert runs.read_workflow_run(tmp_path)["diagnostics"] == [{"step": 2, "cos_token_sequence": 0.5}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[1]) + "\n")
    with pytest.raises(ValueError, match="did not finish"):
        runs.read_workflow_run(tmp_path)


def test_read_workflow_run_keeps_each_questions_em_and_the_table_pairs_them(tmp_path):
    """The first and last evaluations' per-question EM (reward_outcome 1: right) are read back, and
    the table pairs them by question: before -> after within a loss, and after against the
    reference loss's after, pooled over seeds (hand-computed here)."""
    lines = [{"step": 0, "eval/em": 0.25}, {"step": 1, "rollout/reward": 0.0, "rollout/em": 0.0,
                                            "rollout/format_ok": 1.0, "rollout/calls": 1.0},
             {"step": 1, "eval/em": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    metrics.write_step_rows(tmp_path / "eval", 0, [{"id": q, "reward_outcome": o} for q, o in
                                                   (("a", 1.0), ("b", 0.0), ("c", -1.0), ("d", 0.0))])
    metrics.write_step_rows(tmp_path / "eval", 1, [{"id": q, "reward_outcome": o} for q, o in
                                                   (("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 0.0))])
    final = runs.read_workflow_run(tmp_path)["final"]
    assert final["before"] == {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0}
    assert final["after"] == {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}
    other = {**final, "after": {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}}
    results = {"reference": "gsspo", "variants": {
        "gsspo": {"label": "GSsPO", "seeds": {"2": {"final": final}}},
        "grpo": {"label": "GRPO", "seeds": {"2": {"final": other}}}}}
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in report.question_table(results).splitlines()[2:]}
    d = np.array([0, 1, 1, 0.0])  # GSsPO: after - before
    assert rows["GSsPO"][:5] == ["4", "0.250", "0.750", f"+0.500 ± {d.std(ddof=1) / 2:.3f}",
                                 f"{0.5 / (d.std(ddof=1) / 2):+.1f}"] and rows["GSsPO"][5] == "—"
    v = np.array([-1, 0, -1, 0.0])  # GRPO after - GSsPO after
    assert rows["GRPO"][5:] == [f"-0.500 ± {v.std(ddof=1) / 2:.3f}", f"{-0.5 / (v.std(ddof=1) / 2):+.1f}"]
