"""The trainer end to end on the tiny preset: a random model over the byte tokenizer, rolled out
through the real HTTP executor (fake LLM, BM25 search), updated, checkpointed and resumed.

What is checked against what:
- resume: a run of 2 steps + a restarted run of 1 step == an uninterrupted run of 3 steps (the same
  questions and the same loss to 1e-6), and a SIGKILLed run restarted from its work directory
  continues exactly like the uninterrupted one;
- preemption: a run sent SIGTERM during a rollout, restarted, sent SIGTERM during an update and
  restarted again saves each time, exits 0 with one line, and ends with the uninterrupted run's
  metrics and checkpoint (parameters and optimizer state) bit for bit;
- the work directory holds what the README promises (metrics, TensorBoard, checkpoints, HF export);
- on the synthetic operator task (real gradients: rewards differ inside the groups), a SIGKILLed run
  restarted from its work directory ends with the uninterrupted run's parameters and optimizer
  state bit for bit, and `train.filter_groups` keeps the right groups and survives a step that
  keeps none;
- bad input (a wrong config key, a missing data file, an unreachable executor URL) is one line on
  stderr with exit status 2, before any work.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = f"{ROOT}/configs/gsspo.py:tiny"
# 2 questions x 2 samples per step and small budgets. The prompt set says every policy text in a few
# words: over the byte-level tokenizer each byte is a token, and the concise set's prompt alone is 3,800
# positions of every prefill and update (1,050 with tests/short_prompts). These tests check the
# trainer's mechanics, not the wording.
SMALL = [f"env.prompt_set={ROOT}/tests/short_prompts",
         "rollout.prompts_per_step=2", "rollout.max_response_tokens=256", "rollout.max_turn_tokens=32",
         "data.eval_holdout=2", "eval.max_questions=2", "checkpoint.async_save=False", "log_trajectories=4",
         # The tests' 8 simulated devices as data 4 x tensor 2: 4 rows per micro-batch, one per data shard.
         "mesh.tensor=2",
         # A random policy's rewards are all equal (zero advantages); an entropy bonus makes every update
         # move the parameters, so resuming must restore the optimizer state to match.
         "train.entropy_coef=0.01"]


def _trainer(workdir, steps, extra=()):
    from workflow_r1 import configlib, run_config, trainer

    cfg = configlib.load(CONFIG, [f"steps={steps}", *SMALL, *extra])
    return trainer.Trainer(run_config.Run.from_config(cfg), workdir)


def _metrics(workdir):
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _questions(workdir, step):
    lines = (pathlib.Path(workdir) / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(line)["id"] for line in lines]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    t = _trainer(workdir, 3)
    t.train()
    t.finish()
    return workdir


def test_two_steps_write_metrics_checkpoints_and_export(uninterrupted):
    w = uninterrupted
    m = _metrics(w)
    assert [r["step"] for r in m] == [1, 2, 3]
    for key in ("rollout/reward", "rollout/em", "rollout/format_ok", "rollout/calls", "rollout/turns",
                "rollout/response_tokens", "train/loss", "train/grad_norm", "train/clipfrac", "train/kl_ref",
                "train/entropy", "train/sampler_mismatch", "time/generate_s", "time/executor_s", "time/update_s",
                "time/weight_sync_s",
                "rollout/answer_from_warning", "rollout/answer_from_observation",
                "rollout/tokens_per_s"):
        assert key in m[0], key
    assert m[0]["train/updates"] == 1 and m[2]["train/updates"] == 3
    assert all(abs(r["train/loss"]) > 1e-4 and r["train/grad_norm"] > 1e-4 for r in m)
    assert m[1]["train/kl_ref"] > 0  # the policy moved away from the reference
    assert "eval/em" in m[2]
    assert sorted(p.name for p in (w / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2", "3"]
    assert any((w / "tensorboard").iterdir())
    assert (w / "hf" / "config.json").exists() and (w / "hf" / "model.safetensors").exists()
    assert json.loads((w / "config.json").read_text())["train"]["granularity"] == "subsequence"
    # The sampler and the trainer score the same tokens with the same weights: on-policy, the
    # mismatch is numerical noise (the first mini-batch's old log-probs are the trainer's own).
    assert m[0]["train/sampler_mismatch"] < 1e-3


def test_resume_continues_with_identical_data_and_loss(uninterrupted, tmp_path):
    t = _trainer(tmp_path, 2)
    t.train()
    t.finish()
    t = _trainer(tmp_path, 3)  # same work directory: resumes after step 2
    assert t.step == 2
    t.train()
    t.finish()
    full, resumed = _metrics(uninterrupted), _metrics(tmp_path)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
        assert b["rollout/reward"] == pytest.approx(a["rollout/reward"], abs=1e-9)
    assert _questions(tmp_path, 3) == _questions(uninterrupted, 3)


def test_a_run_killed_before_its_first_checkpoint_is_rewritten_not_appended(tmp_path):
    # What a kill during step 1's asynchronous save leaves: the metrics and trajectories of steps the
    # (unfinished) checkpoints never recorded. The restarted run starts at step 1 and owns those steps.
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in (0, 1, 2)))
    (tmp_path / "trajectories").mkdir()
    for s in (1, 2):
        (tmp_path / "trajectories" / f"step_{s:06d}.jsonl").write_text('{"id": "stale"}\n')
    t = _trainer(tmp_path, 1, ["checkpoint.export_hf=False", "profile_steps=1"])
    assert t.step == 0
    t.train()
    t.close()
    assert [r["step"] for r in _metrics(tmp_path)] == [1]
    # The pod metrics ride along: throughput per device (no MFU on CPU) and the trace asked for.
    assert _metrics(tmp_path)[0]["perf/tokens_per_s_per_device"] > 0 and "perf/mfu" not in _metrics(tmp_path)[0]
    assert list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert "x" not in _metrics(tmp_path)[0]
    assert sorted(p.name for p in (tmp_path / "trajectories").iterdir()) == ["step_000001.jsonl"]
    assert "stale" not in _questions(tmp_path, 1)


def test_an_overlong_question_is_dropped_without_being_tokenized():
    from workflow_r1 import envs
    from workflow_r1.data.questions import Question
    from workflow_r1.task.config import EnvConfig
    from workflow_r1.model import tokenizer as tokenizer_lib

    tok = tokenizer_lib.byte_level()
    # The byte tokenizer's longest entry is <|endoftext|>: 13 bytes (a byte is at most 2 in its alphabet).
    assert tokenizer_lib.max_token_bytes(tok) == 13
    env, tokenized = EnvConfig(prompt_set="concise"), []

    def encode_prompt(question):  # the engine's: a Question (or its text)
        text = getattr(question, "question", question)
        tokenized.append(len(text))
        ids = tokenizer_lib.chat_ids(tok, env.messages(text))
        return None, ids

    limit = 4096
    q = lambda i, text: Question(str(i), text, ("a",), "nq")  # noqa: E731
    questions = [q(0, "short?"), q(1, "x" * (10 << 20)), q(2, "y" * (limit * 13 - 100)), q(3, "z" * 3000)]
    kept = envs.fitting(questions, encode_prompt, tok, limit, "training")
    assert [k.id for k in kept] == ["0"]  # 2 and 3 are tokenized and found too long; 1 is never tokenized
    assert max(tokenized) < (10 << 20) and len(tokenized) == 3


def test_a_disk_too_small_for_the_run_fails_before_any_work(tmp_path, free_disk):
    from workflow_r1 import checkpointing

    free_disk(1 << 20)
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"not enough disk space for the run's next checkpoint and its final export in ") as e:
        _trainer(tmp_path / "w", 1)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "w").exists()


def _cli(workdir, *args, timeout=600, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}  # the same 8 devices as in-process
    cmd = [sys.executable, "-m", "workflow_r1.train", f"--config={CONFIG}", f"--workdir={workdir}",
           *[f"--config.{o}" for o in SMALL], *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _local_checkpointing() -> list[str]:
    """The `local` preset's checkpoint section as flags (asynchronous saves every step, the newest kept):
    the kill test runs the tiny model with the defaults a user's local run has."""
    from workflow_r1 import configlib

    section = configlib.load(f"{ROOT}/configs/gsspo.py:local").checkpoint
    assert section.every_steps >= 1 and section.async_save  # a killed local run can resume at all
    return [f"--config.checkpoint.{k}={v}" for k, v in section.items()]


def test_sigkill_mid_step_then_restart_matches_uninterrupted(uninterrupted, tmp_path):
    proc = _cli(tmp_path, "--config.steps=3", *_local_checkpointing())
    metrics, first = tmp_path / "metrics.jsonl", tmp_path / "checkpoints" / "1"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        # Saves are asynchronous: step 1's checkpoint is final once orbax has renamed its directory.
        if metrics.exists() and metrics.read_text().count("\n") >= 1 and first.is_dir():
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(1.0)  # inside step 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _cli(tmp_path, "--config.steps=3", *_local_checkpointing())
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    assert "resuming at step" in out
    full, resumed = _metrics(uninterrupted), _metrics(tmp_path)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(full[1:], resumed[1:]):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
    assert _questions(tmp_path, 2) == _questions(uninterrupted, 2)


class _Stderr:
    """A child's stderr read as it comes (tqdm redraws its bars with carriage returns, not lines)."""

    def __init__(self, proc):
        import threading

        self.text, self._proc = "", proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for chunk in iter(lambda: os.read(self._proc.stderr.fileno(), 4096), b""):
            self.text += chunk.decode(errors="replace")

    def wait_for(self, marker, timeout=600):
        deadline = time.time() + timeout
        while marker not in self.text and self._proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert marker in self.text and self._proc.poll() is None, self.text[-3000:]

    def finish(self, timeout=600):
        out = self._proc.stdout.read()
        self._proc.wait(timeout=timeout)
        self._thread.join(timeout=60)
        return out


def _saved_state(workdir, step):
    """Checkpoint `step`'s array tree (parameters, optimizer state, update count) as numpy arrays."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
    with ocp.StandardCheckpointer() as c:
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), c.metadata(path).item_metadata.tree)
        tree = c.restore(path, target)
    return jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, tree))[0]


def _assert_resumed_exactly(uninterrupted, workdir):
    """`workdir`'s 3-step run, preempted and resumed, is the uninterrupted one: its metrics, its
    questions per step and step 3's saved arrays (parameters, optimizer state, count), bit for bit."""
    import jax
    import numpy as np

    full, resumed = _metrics(uninterrupted), _metrics(workdir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
        assert b["rollout/reward"] == a["rollout/reward"]
    assert [_questions(workdir, s) for s in (1, 2, 3)] == [_questions(uninterrupted, s) for s in (1, 2, 3)]
    a, b = _saved_state(uninterrupted, 3), _saved_state(workdir, 3)
    assert [p for p, _ in a] == [p for p, _ in b] and len(a) > 0
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_sigterm_mid_rollout_and_mid_update_saves_exits_0_and_resumes_exactly(uninterrupted, tmp_path):
    """A preemptible slice's SIGTERM, at the two kinds of safe point: during step 2's rollout the run
    abandons the step and saves step 1; restarted, during step 2's update it finishes step 2 and saves
    it. Regular saves come only every 3 steps, so each resume starts from the preemption's own save."""

    flags = ["--config.steps=3", "--config.checkpoint.every_steps=3", "--config.checkpoint.async_save=True",
             "--config.checkpoint.keep=3"]
    ckpts = tmp_path / "checkpoints"
    for marker, line in [("step 2 rollout", f"preempted: SIGTERM during step 2; abandoned its rollout; step 1 is "
                          f"saved in {ckpts}; rerun the same command to resume at step 2"),
                         ("step 2 update", f"preempted: SIGTERM during step 2; finished it and saved it in {ckpts}; "
                          "rerun the same command to resume at step 3")]:
        proc = _cli(tmp_path, *flags)
        err = _Stderr(proc)
        err.wait_for(marker)
        proc.send_signal(signal.SIGTERM)
        out = err.finish()
        assert proc.returncode == 0, err.text[-3000:]
        assert [ln for ln in out.splitlines() if ln.startswith("preempted")] == [line], out
        assert out.strip().splitlines()[-1] == line and "Traceback" not in err.text
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [1, 2]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    done = _cli(tmp_path, *flags)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err[-3000:]
    assert "resuming at step 3" in out and "preempted" not in out
    _assert_resumed_exactly(uninterrupted, tmp_path)


def test_a_preemption_notice_is_a_flag_until_the_watch_ends():
    """SIGTERM inside `Watch` sets the flag the safe points read; a second one is the default action
    again; the handler before the watch comes back after it."""
    from workflow_r1 import preemption

    before = signal.getsignal(signal.SIGTERM)
    with preemption.Watch() as w:
        assert not w.requested() and not w.reached() and w.name() == "a preemption notice"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs the handler between bytecodes
        assert w.requested() and w.reached() and w.name() == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before
    assert preemption.stop_line("SIGTERM", 1, 0, "/w/c") == ("preempted: SIGTERM during step 1; abandoned its rollout; "
                                                             "nothing to save yet; rerun the same command to resume at "
                                                             "step 1")


def _limit_file_size(limit):
    """A child's preexec_fn: files it writes may not exceed `limit` bytes (a write past that fails with
    EFBIG, as one on a full disk fails with ENOSPC; SIGXFSZ is ignored so the write returns the error)."""
    import resource

    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_a_checkpoint_write_that_fails_mid_run_is_one_line(tmp_path):
    # The tiny model's checkpoint files are larger than 64 KB, everything else the run writes is smaller:
    # the asynchronous save fails in orbax's writer threads, not in the pre-save free-space check.
    proc = _cli(tmp_path, "--config.steps=1", "--config.checkpoint.async_save=True", "--config.data.eval_holdout=0",
                "--config.checkpoint.export_hf=False", preexec_fn=_limit_file_size(64 << 10))
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: a checkpoint could not be written to {tmp_path / 'checkpoints'} ("), err[-3000:]
    assert "no step is on disk yet; free space (or fix the file system) and rerun the same command" in last
    assert [r["step"] for r in _metrics(tmp_path)] == [1]


@pytest.mark.parametrize("override,message", [
    ("--config.train.clip_low=0.1", "error: config key train.clip_low unknown; did you mean train.clip_eps_low?"),
    ("--config.data.train_files=/nope/q.jsonl", "error: data file /nope/q.jsonl"),
    ("--config.executor.url=http://127.0.0.1:9", "error: executor http://127.0.0.1:9 is unreachable"),
    ("--config.steps=-1", "error: config: steps must be >= 0 (0: `epochs` passes over the training questions), got -1"),
    ("--config.epochs=0", "error: config: epochs must be >= 1, got 0"),
    ("--config.profile_steps=2,x", "error: config: profile_steps must be comma-separated step numbers >= 1"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, override, message):
    proc = _cli(tmp_path / "w", override)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


def test_a_run_without_an_evaluation_set_warns_at_its_start(tmp_path):
    """No data.eval_files and data.eval_holdout 0 (the paper preset's defaults): one warning line naming
    the keys, printed before any work (here the run then stops at its missing data file)."""
    proc = _cli(tmp_path / "w", "--config.data.eval_holdout=0", "--config.data.train_files=/nope/q.jsonl")
    out, err = proc.communicate(timeout=300)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 2, err
    assert lines[0].startswith("warning: this run evaluates nothing (data.eval_files is empty and "
                               "data.eval_holdout is 0); set --config.data.eval_files=") and \
        lines[1].startswith("error: data file /nope/q.jsonl"), err
    proc = _cli(tmp_path / "w", "--config.data.train_files=/nope/q.jsonl")  # the tiny preset holds 4 out: quiet
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "warning" not in err, err


# ---------------------------------------------------------------------------------------------------
# The synthetic operator task (env.kind=operators; tests/test_learning.py): a 16-token tiny model
# whose random rewards differ inside most groups, so the updates carry real gradients.
# 8 questions x 4 samples, 2 mini-batches, a checkpoint every step.
OPERATORS = ["rollout.prompts_per_step=8", "rollout.n=4", "train.micro_batch_size=16", "eval.max_questions=8",
             "eval.batch_size=8", "log_trajectories=-1", "tensorboard=False", "checkpoint.every_steps=1",
             "checkpoint.async_save=False"]


def _operator_overrides(steps, extra=()):
    from workflow_r1.ablation import runs

    return runs.operator_overrides(0, steps, [*OPERATORS, *extra])


def _operator_trainer(workdir, steps, extra=()):
    from workflow_r1 import configlib, run_config, trainer
    from workflow_r1.ablation import runs

    cfg = configlib.load(runs.spec("gsspo", "operators"), _operator_overrides(steps, extra))
    return trainer.Trainer(run_config.Run.from_config(cfg), workdir)


def _rewards(workdir, step):
    lines = (pathlib.Path(workdir) / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return [json.loads(line)["reward"] for line in lines]


# Pairs: groups of 2 agree on their reward often enough for the filter to drop some.
FILTER = ["train.filter_groups=True", "rollout.n=2", "train.micro_batch_size=8"]


def test_filter_groups_keeps_the_varied_groups_and_a_step_that_keeps_none_skips_its_update(tmp_path, monkeypatch):
    import numpy as np

    from workflow_r1.rl import dynamic_sampling

    real, calls = dynamic_sampling.varied_groups, []

    def varied(rewards, n):  # step 2 keeps no group
        calls.append(1)
        return real(rewards, n) & (len(calls) != 2)

    monkeypatch.setattr(dynamic_sampling, "varied_groups", varied)
    t = _operator_trainer(tmp_path, 3, FILTER)
    t.train()
    t.close()
    m = _metrics(tmp_path)
    assert [r["step"] for r in m] == [1, 2, 3]
    fractions = []
    for r in (m[0], m[2]):  # the kept fraction is that of the groups whose logged rewards differ
        groups = np.array(_rewards(tmp_path, r["step"])).reshape(-1, 2)
        fractions.append(np.mean(groups.max(1) > groups.min(1)))
        assert r["train/kept_group_fraction"] == pytest.approx(fractions[-1])
        assert r["train/grad_norm"] > 0
    assert 0 < min(fractions) < 1, fractions  # the filter had something to drop and something to keep
    assert m[1]["train/kept_group_fraction"] == 0 and "train/loss" not in m[1]
    assert [r["train/updates"] for r in m] == [2, 2, 4]  # 2 mini-batches a step; step 2 none
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2, 3]
    t = _operator_trainer(tmp_path, 4, FILTER)  # resumes after the skipped step
    assert t.step == 3 and int(t.state.step) == 4
    t.train()
    t.close()
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]


def test_refill_rounds_roll_out_fresh_questions_until_enough_groups_vary(tmp_path, monkeypatch):
    """train.refill_rounds (DAPO's over-sampling): step 1's first batch keeps no group, so the step
    rolls out the next questions (fresh ones, with their own seed) until 8 groups vary or 2 refills
    are spent, and trains on at most 8 groups; the data position moves past every refill batch."""
    import numpy as np

    from workflow_r1.rl import dynamic_sampling
    from workflow_r1.rl import train_state

    with pytest.raises(ValueError, match="refill_rounds refills the groups that filter_groups drops"):
        train_state.TrainConfig(refill_rounds=1)
    real, calls = dynamic_sampling.varied_groups, []

    def varied(rewards, n):  # the first rollout of step 1 keeps no group
        calls.append(1)
        return real(rewards, n) & (len(calls) != 1)

    monkeypatch.setattr(dynamic_sampling, "varied_groups", varied)
    t = _operator_trainer(tmp_path, 2, [*FILTER, "train.refill_rounds=2"])
    t.train()
    drawn = t.data.step
    t.close()
    m = _metrics(tmp_path)
    refills = [r["train/refill_rounds"] for r in m]
    assert 1 <= refills[0] <= 2 and drawn == 2 + sum(refills)  # one batch per step, one per refill
    ids = [json.loads(line)["id"] for line in
           (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    assert len(ids) == 8 * 2 * (1 + refills[0]) and len(set(ids)) == 8 * (1 + refills[0])  # fresh questions
    groups = np.array(_rewards(tmp_path, 1)).reshape(-1, 2)
    varied_after_first = np.mean(np.r_[np.zeros(8, bool), (groups.max(1) > groups.min(1))[8:]])
    assert m[0]["train/kept_group_fraction"] == pytest.approx(varied_after_first)  # over every group rolled out
    assert m[0]["train/grad_norm"] > 0 and m[0]["train/updates"] == 2


def _operator_cli(workdir, steps):
    from workflow_r1.ablation import runs

    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}  # the same 8 devices as in-process
    cmd = [sys.executable, "-m", "workflow_r1.train", f"--config={runs.spec('gsspo', 'operators')}", f"--workdir={workdir}",
           *[f"--config.{o}" for o in _operator_overrides(steps)]]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_with_nonzero_gradients_then_restart_restores_params_and_optimizer_state_exactly(tmp_path):
    """Issue #29 item 12: on the operator task every update has a real gradient (rewards differ inside
    the groups), so a resume that restored the weights but not the AdamW moments (or the data
    position, or the update count) would end elsewhere. The killed-then-resumed run's final
    checkpoint must equal the uninterrupted run's, parameters and optimizer state, bit for bit."""
    import jax
    import numpy as np

    from workflow_r1 import checkpointing

    steps = 4
    t = _operator_trainer(tmp_path / "full", steps)
    initial = [np.array(x) for x in jax.tree.leaves(t.state.params)]
    t.train()
    t.finish()
    template = t.state

    killed = tmp_path / "killed"
    proc = _operator_cli(killed, steps)
    metrics, deadline = killed / "metrics.jsonl", time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:  # step 1 is checkpointed (sync save)
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = metrics.read_text().count("\n")
    assert 1 <= done < steps  # killed before the end, after step 1's checkpoint
    t = _operator_trainer(killed, steps)  # the restart (in this process: its programs are compiled already)
    assert t.step in (done, done + 1)  # a kill between a step's save and its metrics line: one more
    t.train()
    t.finish()
    assert [r["step"] for r in _metrics(killed)] == list(range(1, steps + 1))

    def final(workdir):
        with checkpointing.Checkpointer(workdir / "checkpoints") as c:
            state, _ = c.restore(template, steps)
        return state

    a, b = final(tmp_path / "full"), final(killed)
    assert int(a.step) == int(b.step) == 2 * steps  # 2 mini-batch updates a step
    for what in ("params", "opt_state"):
        leaves_a, leaves_b = jax.tree.leaves(getattr(a, what)), jax.tree.leaves(getattr(b, what))
        assert len(leaves_a) == len(leaves_b) > 0
        for x, y in zip(leaves_a, leaves_b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)
    # The gradients were real: every update had a non-zero norm, the weights moved, the moments are set.
    assert all(r["train/grad_norm"] > 1e-3 for r in _metrics(killed))
    assert any(not np.array_equal(x, np.asarray(y)) for x, y in zip(initial, jax.tree.leaves(a.params)))
    assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(a.opt_state) if np.ndim(x)) > 0


def test_the_run_prints_its_evaluation_before_and_after_training():
    import numpy as np

    from workflow_r1.eval.report import evaluation_line

    fmt = np.array([1.0, 0.0, 1.0, 1.0])  # 4 episodes, 3 well formed
    before = {"eval/em": 0.0, "eval/em_stderr": 0.0, "eval/format_ok": 0.25, "eval/calls": 1.75, "eval/episodes": 4.0}
    after = {"eval/em": 0.25, "eval/em_stderr": 0.25, "eval/format_ok": fmt.mean(), "eval/calls": 1.5,
             "eval/episodes": 4.0}
    line = evaluation_line(before, after)
    se = fmt.std(ddof=1) / np.sqrt(len(fmt))  # the standard error of a rate, n - 1 as for EM
    assert line.startswith("evaluation on 4 questions (greedy): EM 0.000 ± 0.000, format 0.25 ± 0.25")
    assert "before training; EM 0.250 ± 0.250" in line and f"format 0.75 ± {se:.2f}" in line
    assert line.endswith("operator calls 1.50 per episode after")
    assert evaluation_line({}, after).startswith("evaluation on 4 questions (greedy): EM 0.250")


def test_sigterm_inside_the_engines_rollout_abandons_it_and_resumes_exactly(uninterrupted, tmp_path, monkeypatch):
    """The notice arrives at a controlled point inside step 2's rollout: as the engine ends the first
    turn of the step (rules.end_turn, other rows still generating). The engine stops at the next
    finished episode, before its last, step 1 is saved, and the restarted run ends with the
    uninterrupted run's metrics, questions and step-3 checkpoint bit for bit."""
    import gc


    from workflow_r1 import preemption
    from workflow_r1.rollout import paged, rules

    real_end_turn, real_run, sent, stopped = rules.end_turn, paged.PagedRollout.run, [], []

    def end_turn(*args, **kwargs):
        if trainer.step == 1 and not sent:  # step 2's first turn
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # the Watch's handler sets the flag
        return real_end_turn(*args, **kwargs)

    def run(self):  # the engine's loop: did the notice stop it before its last episode?
        try:
            return real_run(self)
        except preemption.Preempted:
            stopped.append(self.finished)
            raise

    flags = ["checkpoint.every_steps=3"]
    trainer = _trainer(tmp_path, 3, flags)
    monkeypatch.setattr(rules, "end_turn", end_turn)
    monkeypatch.setattr(paged.PagedRollout, "run", run)
    trainer.train()
    trainer.close()
    ckpts = trainer.checkpointer.directory
    assert trainer.preempted == preemption.stop_line("SIGTERM", 2, 1, ckpts)
    assert sent and len(stopped) == 1 and stopped[0] < 4  # inside the engine, before its 4th (last) episode
    assert sorted(int(p.name) for p in pathlib.Path(ckpts).iterdir() if p.name.isdigit()) == [1]
    assert [r["step"] for r in _metrics(tmp_path)] == [1]
    monkeypatch.setattr(rules, "end_turn", real_end_turn)
    monkeypatch.setattr(paged.PagedRollout, "run", real_run)
    del trainer
    gc.collect()  # one trainer's memory at a time (the tiny run peaks at a few GB)
    trainer = _trainer(tmp_path, 3, flags)
    assert trainer.step == 1
    trainer.train()
    trainer.finish()
    assert not trainer.preempted
    _assert_resumed_exactly(uninterrupted, tmp_path)
