"""Work directories that are URIs: `gs://` end to end against a GCS emulator on this machine.

The emulator (tests/gcs_emulator.py) serves a local directory as GCS to both clients a run uses:
TensorStore's own GCS driver (orbax's arrays) and etils.epath over fsspec (every other file). So a
trainer given `--workdir=gs://bkt/run` must leave its files under the emulator's `bkt/run/`, write
nothing to a local `gs:` directory, and resume from there exactly as it does from a local one.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

from tests.gcs_emulator import emulated_gcs
from workflow_r1 import storage


def test_a_uri_stays_a_uri_and_a_local_path_is_made_absolute(tmp_path, monkeypatch):
    uri = storage.path("gs://bkt/run")
    assert str(uri / "checkpoints") == "gs://bkt/run/checkpoints"
    assert str(storage.path("gs://bkt/run", absolute=True)) == "gs://bkt/run"
    assert storage.is_remote("gs://bkt/run") and storage.is_remote("s3://b/x")
    monkeypatch.chdir(tmp_path)
    assert not storage.is_remote("runs/x")
    assert str(storage.path("runs/x", absolute=True)) == str(tmp_path / "runs" / "x")
    assert str(storage.path("runs/x")) == "runs/x"


def test_write_text_and_staged_reach_the_bucket_and_leave_nothing_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "gcs"
    with emulated_gcs(root):
        storage.write_text("gs://bkt/a/config.json", '{"x": 1}')
        with storage.staged("gs://bkt/a/hf") as local:
            assert not storage.is_remote(local)
            (local / "sub").mkdir()
            (local / "sub" / "w.bin").write_bytes(b"\0" * 1000)
            (local / "t.txt").write_text("t")
            before = pathlib.Path(local)
        assert not before.exists()  # the staging directory is gone
        assert storage.path("gs://bkt/a/hf/sub/w.bin").read_bytes() == b"\0" * 1000
        with pytest.raises(RuntimeError), storage.staged("gs://bkt/a/broken") as local:
            (local / "half").write_text("x")
            raise RuntimeError("the writer failed")
        assert not storage.path("gs://bkt/a/broken/half").exists()  # a failed block copies nothing
    assert json.loads((root / "bkt" / "a" / "config.json").read_text()) == {"x": 1}
    assert (root / "bkt" / "a" / "hf" / "t.txt").read_text() == "t"
    assert not (tmp_path / "gs:").exists()


def test_metrics_on_a_uri_are_rewritten_whole_and_resume_like_local_ones(tmp_path):
    from tests.test_metrics import read_events, read_jsonl, scalars
    from workflow_r1 import metrics

    root = tmp_path / "gcs"
    with emulated_gcs(root):
        with metrics.MetricWriter("gs://bkt/m", enabled=True) as w:
            for s in range(1, 6):
                w.write(s, {"x": float(s)})
                w.flush()
                assert len(read_jsonl(root / "bkt" / "m" / "metrics.jsonl")) == s  # visible after each flush
        with metrics.MetricWriter("gs://bkt/m", enabled=True, resume_from=3) as w:  # restarted at step 3
            assert [r["step"] for r in read_jsonl(root / "bkt" / "m" / "metrics.jsonl")] == [1, 2]
            for s in (3, 4):
                w.write(s, {"x": 10.0 * s})
    records = read_jsonl(root / "bkt" / "m" / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    events = read_events(root / "bkt" / "m" / "tensorboard")  # both writers' files, copied whole
    assert scalars(events)["x"] == [(s, float(s)) for s in range(1, 6)] + [(3, 30.0), (4, 40.0)]


# The synthetic operator task (tests/test_train.py): real gradients, no executor, seconds a step.
OPERATORS = ["rollout.prompts_per_step=8", "rollout.n=4", "train.micro_batch_size=16", "eval.max_questions=8",
             "eval.batch_size=8", "log_trajectories=4", "checkpoint.every_steps=1", "checkpoint.async_save=True",
             "checkpoint.export_hf=True"]


def _run(workdir, steps, extra=()):
    from workflow_r1 import configlib, run_config, trainer
    from workflow_r1.ablation import runs

    cfg = configlib.load(runs.spec("gsspo", "operators"), runs.operator_overrides(0, steps, [*OPERATORS, *extra]))
    t = trainer.Trainer(run_config.Run.from_config(cfg), workdir)
    first = t.step
    t.train()
    t.finish()
    return first


def _lines(text):
    return [json.loads(line) for line in text.splitlines()]


def test_the_trainer_runs_and_resumes_on_a_gs_workdir_like_on_a_local_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "local"
    _run(local, 3, ["wandb_project=wr1-test", "wandb_mode=offline"] if importlib.util.find_spec("wandb") else [])
    root = tmp_path / "gcs"
    with emulated_gcs(root):
        assert _run("gs://bkt/run", 2, ["profile_steps=2"]) == 0
        assert _run("gs://bkt/run", 3) == 2  # resumed from the bucket's checkpoint of step 2
    run = root / "bkt" / "run"
    assert not (tmp_path / "gs:").exists()  # nothing went to a local path named after the URI
    remote, full = _lines((run / "metrics.jsonl").read_text()), _lines((local / "metrics.jsonl").read_text())
    assert [r["step"] for r in remote] == [r["step"] for r in full] == [1, 2, 3]
    for a, b in zip(full, remote):  # the same run: the resumed one continues from the restored state
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-6)
        assert b["rollout/reward"] == pytest.approx(a["rollout/reward"], abs=1e-9)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == sorted(
        p.name for p in (local / "checkpoints").iterdir() if p.name.isdigit())
    assert (run / "checkpoints" / "3" / "commit_success.txt").exists()  # orbax wrote it the GCS way
    events = sorted((run / "tensorboard").iterdir())
    assert len(events) == 2 and all(e.stat().st_size > 100 for e in events)  # one file per process
    assert sorted(os.listdir(run / "trajectories")) == sorted(os.listdir(local / "trajectories"))
    assert sorted(os.listdir(run / "eval")) == ["step_000002.jsonl", "step_000003.jsonl"]  # each run's last step
    assert (run / "eval" / "step_000003.jsonl").read_text() == (local / "eval" / "step_000003.jsonl").read_text()
    assert json.loads((run / "config.json").read_text())["steps"] == 3
    assert sorted(os.listdir(run / "hf")) == sorted(os.listdir(local / "hf"))
    assert (run / "hf" / "model.safetensors").read_bytes() == (local / "hf" / "model.safetensors").read_bytes()
    assert list((run / "profile").rglob("*.xplane.pb"))  # the step-2 trace, copied when it ended
    if importlib.util.find_spec("wandb"):  # the trainer's optional wandb writer logged what metrics.jsonl holds
        from tests.test_metrics import wandb_history

        logged = {r["_step"]: r for r in wandb_history(local)}
        assert sorted(logged) == [1, 2, 3]
        assert all(logged[r["step"]]["train/loss"] == pytest.approx(r["train/loss"]) for r in full)
