"""Asynchronous training (`train.max_staleness` = k >= 1, workflow_r1/pipeline.py).

What is checked against what:
- the pipeline alone, with a stand-in rollout whose durations are random: step t's batch is rolled
  out by version max(0, t - 1 - k) whatever the timing, never before that version exists, the
  steps come out in order, and a stop ends a wait for a version with the data position recorded;
- the trainer on the tiny preset at k = 1: the staleness schedule in its metrics and trajectories
  (steps 1, 2, 3 rolled out by versions 0, 0, 1), the behaviour/proximal gap that staleness opens,
  and a run stopped by SIGTERM during step 2's update (with step 3's rollout in flight), restarted
  from its checkpoint, ending with the uninterrupted run's metrics, questions and step-3 arrays bit
  for bit (the versions the next batches read are saved beside the state and rolled out again);
- resuming with another max_staleness than the checkpoint's is one line.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from tests.test_train import _assert_resumed_exactly, _metrics, _trainer


# ------------------------------------------------------------------------------------------------
# The pipeline alone
# ------------------------------------------------------------------------------------------------

class _Data:
    """A question iterator's interface: batch i is [i]."""

    def __init__(self):
        self.step, self.epoch = 0, 0

    def get_state(self):
        return {"step": self.step}

    def next(self):
        self.step += 1
        return [self.step - 1]


@pytest.mark.parametrize("k,partial", [(1, False), (2, False), (3, False), (1, True), (3, True)])
def test_each_batch_is_rolled_out_by_its_version_whatever_the_timing(k, partial):
    """A stand-in rollout plays 4 turns a batch, loading a turn's version when it is not the one
    held (as the engine does): turn j of step t by max(0, t - 1 - k), or (partial) by
    min(t - 1, max(0, t - 1 - k) + j), each loaded only once published."""
    from workflow_r1.pipeline import RolloutPipeline, Versions, behaviour_version

    rng, versions, data, held, published = random.Random(k), Versions(), _Data(), [], {0}
    lock = threading.Lock()

    def use_version(params, weights):
        with lock:
            held.append(int(params.split()[-1]))  # "params <version>"
            assert held[-1] in published  # the sampler's version had been published

    def roll_out(questions, step, first, last, load):
        played = []
        for j in range(4):
            if min(last, first + j) != held[-1]:
                load(min(last, first + j))
            played.append(held[-1])
            time.sleep(rng.uniform(0, 0.005))
        return [(step, played, questions)], None

    versions.publish(0, "params 0", copy=False)
    pipe = RolloutPipeline(first_step=1, last_step=12, max_staleness=k, versions=versions, data=data,
                           roll_out=roll_out, use_version=use_version, partial=partial).start()
    for step in range(1, 13):
        item, _ = pipe.take(step)
        first = max(0, step - 1 - k)
        assert item.step == step and item.version == behaviour_version(step, k) == first
        turns = [min(step - 1, first + j) if partial else first for j in range(4)]
        assert item.episodes == [(step, turns, [step - 1])] and pipe.position(step) == {"step": step - 1}
        time.sleep(rng.uniform(0, 0.02))  # the update
        with lock:
            versions.publish(step, f"params {step}", copy=False)
            published.add(step)
    pipe.stop()
    # Loaded once each, in order (partial with k > 1 goes back to an older version for turn 0).
    assert pipe.position(13) == {"step": 12} and (held == sorted(set(held)) or (partial and k > 1))


def test_a_stop_ends_a_wait_for_a_version_and_records_where_the_data_stands():
    from workflow_r1.pipeline import RolloutPipeline, Versions

    versions, data = Versions(), _Data()
    versions.publish(0, "params 0", copy=False)
    pipe = RolloutPipeline(first_step=1, last_step=9, max_staleness=1, versions=versions, data=data,
                           roll_out=lambda q, s, *versions: ([s], None), use_version=lambda p, w: None).start()
    assert pipe.take(1)[0].episodes == [1] and pipe.take(2)[0].episodes == [2]
    time.sleep(0.05)  # step 3 waits for version 1, which never comes
    assert data.step == 2
    pipe.stop()
    item, _ = pipe.take(3)
    assert item.abandoned and pipe.position(3) == {"step": 2}


def test_a_failed_rollout_is_raised_in_the_trainers_thread():
    from workflow_r1.pipeline import RolloutPipeline, Versions

    versions = Versions()
    versions.publish(0, None, copy=False)

    def roll_out(questions, step, *versions):
        raise RuntimeError("executor down")

    pipe = RolloutPipeline(first_step=1, last_step=3, max_staleness=1, versions=versions, data=_Data(),
                           roll_out=roll_out, use_version=lambda p, w: None).start()
    with pytest.raises(RuntimeError, match="executor down"):
        pipe.take(1)
    pipe.stop()


def test_the_executors_busy_time_is_the_union_of_its_calls():
    from workflow_r1.rollout.paged import covered_seconds

    assert covered_seconds([]) == 0.0
    assert covered_seconds([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.75)]) == 4.0  # [0, 3] and [5, 6]


def test_the_versions_a_checkpoint_saves_are_those_the_next_batches_read():
    from workflow_r1.pipeline import behaviour_version, versions_ahead

    assert versions_ahead(5, 0) == []
    assert versions_ahead(5, 1) == [4] and behaviour_version(6, 1) == 4
    assert versions_ahead(5, 3) == [2, 3, 4]
    assert versions_ahead(1, 3) == [0]  # steps 2..4 all read the initial policy


# ------------------------------------------------------------------------------------------------
# The trainer at k = 1
# ------------------------------------------------------------------------------------------------

ASYNC = ["train.max_staleness=1", "checkpoint.every_steps=3"]


def _run_3_steps(workdir, overrides):
    t = _trainer(workdir, 3, overrides)
    t.train()
    t.finish()
    return workdir


def _sigterm_in_step_2s_update_then_resume(workdir, monkeypatch, overrides):
    """Runs 3 steps with SIGTERM sent as step 2's update starts (step 3's rollout in flight): the run
    stops having saved step 2 alone and logged steps 1 and 2. Then restarts from that checkpoint."""
    import gc

    from workflow_r1 import preemption
    from workflow_r1.rl.learner import Learner

    real_update, sent = Learner.update, []

    def update(self, batch, step=None):
        if step == 2 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_update(self, batch, step)

    monkeypatch.setattr(Learner, "update", update)
    stopped = _trainer(workdir, 3, overrides)
    stopped.train()
    stopped.close()
    ckpts = stopped.checkpointer.directory
    assert stopped.preempted == preemption.stop_line("SIGTERM", 2, 2, ckpts)
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2]
    assert [r["step"] for r in _metrics(workdir)] == [1, 2]
    monkeypatch.setattr(Learner, "update", real_update)
    del stopped
    gc.collect()
    trainer = _trainer(workdir, 3, overrides)
    assert trainer.step == 2 and sorted(trainer.versions.get([1])) == [1]
    trainer.train()
    trainer.finish()
    assert not trainer.preempted


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run_3_steps(tmp_path_factory.mktemp("async"), ASYNC)


def test_the_staleness_schedule_is_in_the_metrics_and_the_trajectories(uninterrupted):
    import json

    metrics = _metrics(uninterrupted)
    assert [r["async/behaviour_version"] for r in metrics] == [0, 0, 1]
    assert [r["async/staleness"] for r in metrics] == [0, 1, 1]
    assert metrics[1]["async/staleness_tokens/1"] == sum(
        json.loads(line)["generated_tokens"]
        for line in (uninterrupted / "trajectories" / "step_000002.jsonl").read_text().splitlines())
    for step, version in ((1, 0), (2, 0), (3, 1)):
        rows = (uninterrupted / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert {json.loads(line)["policy_version"] for line in rows} == {version}
    # One version behind, the recorded behaviour log-probs are no longer the learner's own.
    assert metrics[1]["train/sampler_mismatch"] > 100 * metrics[0]["train/sampler_mismatch"]
    assert all(r["time/learner_wait_s"] >= 0 and r["train/updates"] == r["step"] for r in metrics)
    # The executor is busy (a tool call in flight) for part of a rollout at most.
    assert all(0 <= r["time/executor_busy_s"] <= r["time/rollout_s"] for r in metrics)


def test_sigterm_during_an_update_with_the_next_rollout_in_flight_resumes_exactly(uninterrupted, tmp_path,
                                                                                   monkeypatch):
    _sigterm_in_step_2s_update_then_resume(tmp_path, monkeypatch, ASYNC)
    _assert_resumed_exactly(uninterrupted, tmp_path)


# ------------------------------------------------------------------------------------------------
# The trainer at k = 1 with partial rollouts
# ------------------------------------------------------------------------------------------------

# A warning observation (about 280 byte tokens) fits the response budget once: two turns an episode.
PARTIAL = [*ASYNC, "train.partial_rollouts=True", "rollout.max_response_tokens=384", "rollout.max_turn_tokens=16"]


@pytest.fixture(scope="module")
def uninterrupted_partial(tmp_path_factory):
    return _run_3_steps(tmp_path_factory.mktemp("partial"), PARTIAL)


def test_partial_rollouts_give_each_turn_its_version(uninterrupted_partial):
    """Steps 1, 2, 3 start their episodes on versions 0, 0, 1, and turn j of step t is by version
    min(t - 1, first + j): step 2's later turns by version 1, step 3's by version 2 (on-policy)."""
    import json

    metrics = _metrics(uninterrupted_partial)
    assert [r["async/behaviour_version"] for r in metrics] == [0, 0, 1]
    seen = 0
    for step, first in ((1, 0), (2, 0), (3, 1)):
        rows = [json.loads(line) for line in
                (uninterrupted_partial / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        tokens = {0: 0, 1: 0}
        for r in rows:
            assert r["policy_version"] == first
            assert r["turn_versions"] == [min(step - 1, first + j) for j in range(r["turns"])]
            seen += r["turns"] > 1 and step > 1
        m = metrics[step - 1]
        assert m["async/staleness_tokens/0"] + m["async/staleness_tokens/1"] == sum(r["generated_tokens"] for r in rows)
        assert m["async/versions_per_episode"] == pytest.approx(
            sum(len(set(r["turn_versions"])) for r in rows) / len(rows))
        assert (m["rollout/version_loads"] > 0) == any(r["turns"] > 1 for r in rows) if step > 1 else True
    assert seen > 0   # some episode of steps 2 and 3 really spans two versions
    assert metrics[1]["async/staleness"] < 1 and metrics[0]["async/staleness_tokens/1"] == 0


def test_partial_rollouts_resume_exactly_after_sigterm_during_an_update(uninterrupted_partial, tmp_path,
                                                                        monkeypatch):
    """SIGTERM during step 2's update, step 3's rollout in flight (its first turns on version 1, its
    later ones waiting for version 2): the restart equals the uninterrupted run bit for bit."""
    _sigterm_in_step_2s_update_then_resume(tmp_path, monkeypatch, PARTIAL)
    _assert_resumed_exactly(uninterrupted_partial, tmp_path)


def test_resuming_with_another_max_staleness_is_one_line(uninterrupted, tmp_path):
    import shutil

    from workflow_r1.checkpointing import CheckpointError

    shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=r"holds policy version 2 for asynchronous training: it was saved with "
                                              r"another train.max_staleness; resume with the value it was saved with"):
        _trainer(tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"has no saved policy version 1: it was saved with another "
                                              r"train.max_staleness"):
        _trainer(tmp_path, 4, ["train.max_staleness=2"])


def test_every_device_method_of_the_engines_policy_takes_the_lock():
    """The engine's calls and ragged steps (and its page allocation) run under the lock the
    trainer's device work takes (`pipeline.Serialized`); other attributes pass through."""
    from workflow_r1 import pipeline
    from workflow_r1.rollout import engine

    lock = threading.Lock()

    class Policy:
        name = "policy"

        def __getattr__(self, method):
            return lambda *a, **k: (method, lock.locked())

    serialized = pipeline.Serialized(Policy(), lock)
    methods = [m for m in ("new_pages", "generate_paged", "step_paged") if m in engine.Policy.__doc__]
    assert len(methods) == 3
    assert [getattr(serialized, m)() for m in methods] == [(m, True) for m in methods]
    assert serialized.name == "policy" and not lock.locked()
