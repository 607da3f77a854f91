"""Evaluation: exact EM of a scripted policy through the real rollout engine and executor, the host
slicing and merge, the Direct / CoT baselines, the report files, checkpoint resolution, and the
`python -m workflow_r1.evaluate` entry point on the tiny preset.

The scripted policy reads the question out of each row's prompt and plays that question's script,
so a row's answer does not depend on batching or on which host rolls it out; the expected EM of
each data source is counted by hand from the scripts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from workflow_r1.data.questions import Question, write_questions
from workflow_r1.task.config import EnvConfig
from workflow_r1.eval import baselines, evaluate, greedy, report
from workflow_r1.executor import ExecutorClient, FakeBackend, start_in_thread
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.rollout import RolloutConfig, RolloutEngine, scripted
from workflow_r1.envs.workflow import WorkflowEnvironment

ROOT = pathlib.Path(__file__).resolve().parents[1]
THINK = "<think>I know this.</think>\n"
CALL = "<think>Ask an operator.</think>\n<tool>AnswerGenerate: {q}</tool>"


class QuestionScriptedPolicy(scripted.ScriptedPolicy):
    """Plays scripts[question text][turn] for the episode whose prompt contains that question."""

    def __init__(self, tokenizer, scripts):
        super().__init__()
        self.tok, self.scripts = tokenizer, scripts
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.prompts: list[str] = []
        self.question: dict[int, str] = {}

    def turn(self, row, k, sequence):
        if k == 0:
            self.prompts.append(self.tok.decode(sequence))
            self.question[row] = next(q for q in self.scripts if q in self.prompts[-1])
        script = self.scripts[self.question[row]]
        return self.tok.encode(script[min(k, len(script) - 1)], add_special_tokens=False) + [self.eos]

    def generate_paged(self, *args, temperature, **kw):
        assert temperature == 0.0, "evaluation must be greedy"
        return super().generate_paged(*args, temperature=temperature, **kw)


def _q(i, source, text, gold):
    return Question(id=f"{source}_{i}", question=text, golden_answers=(gold,), data_source=source)


# (question, its script, correct?) : 2 of 3 right on nq, 1 of 3 on hotpotqa.
CASES = [
    (_q(0, "nq", "capital of France?", "Paris"), [THINK + "<answer>Paris</answer>"], True),
    (_q(1, "nq", "capital of Italy?", "Rome"), [CALL.format(q="capital of Italy?"),
                                                  THINK + "<answer>the Rome</answer>"], True),
    (_q(2, "nq", "capital of Spain?", "Madrid"), [THINK + "<answer>Lisbon</answer>"], False),
    (_q(3, "hotpotqa", "largest planet?", "Jupiter"), [CALL.format(q="largest planet?"),
                                                       THINK + "<answer>Jupiter</answer>"], True),
    (_q(4, "hotpotqa", "smallest planet?", "Mercury"), ["no tags at all"], False),
    (_q(5, "hotpotqa", "red planet?", "Mars"), [THINK + "<answer>Venus</answer>"], False),
]
QUESTIONS = [q for q, _, _ in CASES]


@pytest.fixture(scope="module")
def executor():
    handle = start_in_thread(FakeBackend())
    client = ExecutorClient(handle.url, timeout_s=30)
    yield client
    client.close()
    handle.stop()


def _engine(executor, scripts=None):
    tok = tokenizer_lib.byte_level()
    policy = QuestionScriptedPolicy(tok, scripts or {q.question: s for q, s, _ in CASES})
    cfg = RolloutConfig(prompts_per_step=1, n=1, max_prompt_tokens=8192, max_response_tokens=4096,
                        max_assistant_turns=3)
    env = WorkflowEnvironment.of(tok, executor.execute_many_sync, EnvConfig(max_operator_calls=2), cfg)
    return RolloutEngine(policy, cfg, env), policy


def test_scripted_policy_gives_the_exact_em(executor):
    engine, _ = _engine(executor)
    seen = []
    result = evaluate(engine, QUESTIONS, batch_size=4, progress=lambda done, em: seen.append((done, em)))
    m = result.metrics
    assert [e.question.id for e in result.episodes] == [q.id for q in QUESTIONS]
    assert m["nq"]["em"] == pytest.approx(2 / 3) and m["hotpotqa"]["em"] == pytest.approx(1 / 3)
    assert m["all"]["em"] == pytest.approx(0.5)
    # Standard error of a mean of 0/1 outcomes: sqrt(p (1 - p) n / (n - 1)) / sqrt(n).
    assert m["all"]["em_stderr"] == pytest.approx(math.sqrt(0.25 * 6 / 5) / math.sqrt(6))
    # Every scripted response is well formed except the tagless one.
    assert m["all"]["format_ok"] == pytest.approx(5 / 6)
    assert m["all"]["calls/AnswerGenerate"] == pytest.approx(2 / 6)
    assert m["nq"]["turns"] == pytest.approx(4 / 3)
    assert seen == [(4, 0.75), (6, 0.5)]  # after each batch: questions done, running EM
    flat = result.flat("eval/")
    assert flat["eval/em"] == pytest.approx(0.5) and flat["eval/nq/em"] == pytest.approx(2 / 3)


class _Interrupted(Exception):
    pass


def test_an_interrupted_evaluation_resumes_from_its_streamed_episodes(executor, tmp_path):
    from workflow_r1.eval import stream

    full = evaluate(_engine(executor)[0], QUESTIONS, batch_size=2)
    path, fp = tmp_path / "out" / "stream.host0.jsonl", {"method": "workflow", "checkpoint": "c"}
    s = stream.EpisodeStream(path, fp, QUESTIONS)
    assert s.done == []

    def append_then_die(eps):  # the first two batches reach the disk, then the run is killed
        s.append(eps)
        if len(path.read_text().splitlines()) == 1 + 4:
            raise _Interrupted

    with pytest.raises(_Interrupted):
        evaluate(_engine(executor)[0], QUESTIONS, batch_size=2, on_batch=append_then_die)
    s.close()
    with path.open("a") as f:
        f.write('{"group": 0, "sam')  # a torn line of the batch being written when the kill came
    s = stream.EpisodeStream(path, fp, QUESTIONS)
    assert [e.question.id for e in s.done] == [q.id for q in QUESTIONS[:4]]
    engine, policy = _engine(executor)
    resumed = evaluate(engine, QUESTIONS, batch_size=2, done=s.done, on_batch=s.append)
    # Only the last two questions were rolled out again, and the result is the uninterrupted one.
    assert sorted({q for q in QUESTIONS[4:] for t in policy.prompts if q.question in t}, key=QUESTIONS.index) \
        == QUESTIONS[4:]
    assert not any(q.question in t for q in QUESTIONS[:4] for t in policy.prompts)
    assert resumed.metrics == full.metrics
    assert [e.summary() for e in resumed.episodes] == [e.summary() for e in full.episodes]
    # Every field read back as written (but the executor's wall time, which differs between runs).
    untimed = lambda eps: [{**stream.episode_record(e), "seconds_executor": 0} for e in eps]  # noqa: E731
    assert untimed(resumed.episodes) == untimed(full.episodes)
    assert [stream.episode_record(e) for e in resumed.episodes[:4]] == [stream.episode_record(e) for e in s.done]
    s.close()
    # Another evaluation (or other questions at those positions) never reuses the stream.
    assert stream.EpisodeStream(path, {**fp, "checkpoint": "other"}, QUESTIONS).done == []
    s = stream.EpisodeStream(path, fp, QUESTIONS)  # the foreign header replaced the file: nothing left
    assert s.done == []
    s.append(full.episodes)
    s.close()
    assert len(stream.EpisodeStream(path, fp, QUESTIONS[:1] + QUESTIONS[2:]).done) == 1


@pytest.mark.parametrize("count", [2, 3, 4, 7])
def test_host_slices_merge_to_the_single_host_result(executor, count):
    engine, _ = _engine(executor)
    whole = evaluate(engine, QUESTIONS, batch_size=2)
    per_host = [greedy.evaluate_slice(engine, QUESTIONS, batch_size=2, process_index=i, process_count=count)
                for i in range(count)]
    assert sorted(len(h) for h in per_host)[-1] - sorted(len(h) for h in per_host)[0] <= 1
    merged = greedy.merge(per_host)
    assert [e.question.id for e in merged.episodes] == [e.question.id for e in whole.episodes]
    assert merged.metrics == whole.metrics


def test_host_slice_tiles_the_range():
    for n in range(0, 12):
        for count in range(1, 6):
            parts = [list(range(n))[greedy.host_slice(n, i, count)] for i in range(count)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="host index 2"):
        greedy.host_slice(5, 2, 2)


@pytest.mark.parametrize("method", ["direct", "cot"])
def test_baselines_answer_in_one_turn_without_operators(method):
    tok = tokenizer_lib.byte_level()
    answer = {"direct": "<answer>Paris</answer>", "cot": "<think>France's capital.</think>\n<answer>Paris</answer>"}
    scripts = {"capital of France?": [answer[method]],
               # a tool call is not followed: the baseline has one turn and no operators
               "capital of Italy?": [CALL.format(q="capital of Italy?")],
               "capital of Spain?": ["Madrid"]}  # no answer tags: the whole reply is the answer
    policy = QuestionScriptedPolicy(tok, scripts)
    cfg = RolloutConfig(prompts_per_step=1, n=1, max_prompt_tokens=4096, max_response_tokens=256,
                        max_turn_tokens=8)
    engine = baselines.baseline_engine(method, policy, tok, cfg)
    result = evaluate(engine, QUESTIONS[:3], batch_size=3)
    assert [e.num_turns for e in result.episodes] == [1, 1, 1]
    assert [e.finish_reason for e in result.episodes] == ["answer", "turn_cap", "turn_cap"]
    assert result.metrics["all"]["em"] == pytest.approx(2 / 3)
    assert [e.reward_outcome for e in result.episodes] == [1.0, 0.0, 1.0]
    assert result.metrics["all"]["calls"] == 0.0
    # Its own prompt: the question, no operator list, and the turn may use the whole budget (> 8 tokens).
    assert "Question: capital of France?" in policy.prompts[0] and "AnswerGenerate" not in policy.prompts[0]
    assert len(result.episodes[0].response_ids) > 8
    # direct has no <think>, so its format term is the penalty; cot's well-formed answer is valid.
    assert result.episodes[0].reward_format == (0.0 if method == "cot" else -0.5)


def test_baseline_answer_extraction():
    assert baselines.baseline_answer("<think>x</think> <answer> Paris </answer> then <answer>Rome</answer>") == "Rome"
    assert baselines.baseline_answer("<think>France's capital is Paris.</think>\n Paris ") == "Paris"
    assert baselines.baseline_answer(" George Orwell\n") == "George Orwell"
    assert baselines.baseline_answer("<think>no idea</think>") == ""
    assert baselines.score_baseline("<think>hm</think>", ["Paris"]).outcome == -1.0  # nothing to score
    assert baselines.score_baseline("the Paris", ["Paris"]).outcome == 1.0  # normalised as the reward does


def test_report_files_and_table(executor, tmp_path):
    engine, _ = _engine(executor)
    result = evaluate(engine, QUESTIONS, batch_size=6)
    out = report.write_report(tmp_path / "ev", result, {"method": "workflow", "checkpoint": "ckpt"})
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [q.id for q in QUESTIONS]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions"] == 6 and summary["metrics"]["nq"]["em"] == pytest.approx(2 / 3)
    table = (out / "results.md").read_text()
    main_table = table.split("\n\n")[1]  # after the title; the per-operator table follows
    rows = {line.split("|")[1].strip(): line for line in main_table.splitlines() if line.startswith("| ")}
    assert "0.667 ± 0.333" in rows["nq"] and "| 3 |" in rows["nq"]
    assert "0.500 ± 0.224" in rows["**all**"]
    assert "AnswerGenerate" in table


def test_a_uri_out_gets_the_report_and_the_stream_stays_local(executor, tmp_path, monkeypatch):
    """--out=gs://...: the report files go to the bucket; the episode stream, which appends, goes to a
    local directory named after the URI (never a local `gs:` path)."""
    import tempfile

    from tests.gcs_emulator import emulated_gcs
    from workflow_r1.eval import job, stream

    monkeypatch.chdir(tmp_path)
    engine, _ = _engine(executor)
    result = evaluate(engine, QUESTIONS, batch_size=6)
    with emulated_gcs(tmp_path / "gcs"):
        report.write_report("gs://bkt/ev", result, {"method": "workflow"})
    assert json.loads((tmp_path / "gcs" / "bkt" / "ev" / "summary.json").read_text())["questions"] == 6
    assert str(job.default_out("gs://bkt/run/hf", "workflow")) == "gs://bkt/run/hf/eval-workflow"
    local = stream.stream_path("gs://bkt/ev")
    assert local.is_relative_to(tempfile.gettempdir()) and "gs:" not in str(local)
    assert local == stream.stream_path("gs://bkt/ev") != stream.stream_path("gs://bkt/other")  # one per --out
    assert stream.stream_path(tmp_path / "ev") == tmp_path / "ev" / "stream.host0.jsonl"
    assert not (tmp_path / "gs:").exists()


def test_policy_source_restores_a_run_directory(tmp_path):
    import jax

    from workflow_r1 import checkpointing, policy
    from workflow_r1.eval import policy_source
    from workflow_r1.rl import train_state

    model_cfg = policy.ModelConfig(preset="tiny-chat", seed=3)
    train_cfg = train_state.TrainConfig()
    state = train_state.create_train_state(policy.load(model_cfg)[0], train_cfg)
    # Trained weights differ from the initial ones the run's model config gives: only a restore matches.
    state = state.replace(params=jax.tree.map(lambda x: x + 0.5, state.params))
    with checkpointing.Checkpointer(tmp_path / "run" / "checkpoints",
                                    checkpointing.CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(5, state, {"step": 5}, force=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps(
        {"model": dataclasses.asdict(model_cfg), "train": {"learning_rate": 1e-3}}))
    # The evaluation config names another architecture (the 256-token tiny preset): the run's own
    # config.json must decide what is restored.
    model, _, what = policy_source.load(str(tmp_path / "run"), policy.ModelConfig(preset="tiny"))
    assert what.endswith("step 5")
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(__import__("flax").nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(policy_source.CheckpointNotFound, match="neither config.json"):
        policy_source.load(str(tmp_path), model_cfg)


def test_entry_point_direct_on_the_tiny_preset(tmp_path):
    data = write_questions(QUESTIONS[:2], tmp_path / "qs.jsonl")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_r1.evaluate", f"--config={ROOT}/configs/gsspo.py:tiny",
         "--method=direct", f"--data={data}", f"--out={tmp_path / 'out'}", "--config.eval.batch_size=2",
         "--config.rollout.max_response_tokens=8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["method"] == "direct" and summary["questions"] == 2
    assert set(summary["metrics"]) == {"nq", "all"}
    assert len((tmp_path / "out" / "episodes.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "out" / "stream.host0.jsonl").exists()  # streamed, then in the report
    assert "| **all** | 2 |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "workflow_r1.evaluate", f"--config={ROOT}/configs/gsspo.py:tiny",
                          f"--checkpoint={tmp_path / 'missing'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --checkpoint=")
    for flag, key in (("--batch_size=2", "eval.batch_size"), ("--max_questions=5", "eval.max_questions")):
        gone = subprocess.run([sys.executable, "-m", "workflow_r1.evaluate", flag], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)  # the config key does it
        value = flag.split("=")[1]
        assert gone.returncode == 2 and gone.stderr.strip() == \
            f"error: {flag.split('=')[0]} is gone; write --config.{key}={value} instead", gone.stderr
