"""Work directories that are URIs: `gs://` end to end against a GCS emulator on this machine.

The emulator (tests/gcs_emulator.py) serves a local directory as GCS to both clients a run uses:
TensorStore's own GCS driver (orbax's arrays) and etils.epath over fsspec (every other file). So a
trainer given `--workdir=gs://bkt/run` must leave its files under the emulator's `bkt/run/`, write
nothing to a local `gs:` directory, and resume from there exactly as it does from a local one.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
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


# --------------------------------------------------------------------------------------------------
# Inputs read from gs://: question files, prompt sets, HF checkpoints (model.checkpoint), evaluation
# --------------------------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _one_line(fn, *texts):
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and all(t in message for t in texts), message
    return message


def test_questions_prompt_sets_and_hf_checkpoints_are_read_from_gs_like_local_ones(tmp_path, monkeypatch):
    import fsspec.implementations.local
    import jax
    from flax import nnx

    from workflow_r1 import checkpointing, policy
    from workflow_r1.data import DataError, bundled_questions, load_questions, read_questions, write_questions
    from workflow_r1.model import checkpoint as hf_checkpoint
    from workflow_r1.model import tokenizer as tokenizer_lib
    from workflow_r1.eval import policy_source
    from workflow_r1.rl import train_state
    from workflow_r1.task import prompt_sets

    monkeypatch.chdir(tmp_path)
    root, downloads = tmp_path / "gcs", tmp_path / "tmp"
    downloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(downloads))  # where storage.fetched downloads to
    questions = bundled_questions()[:5]
    write_questions(questions, root / "bkt" / "data" / "q.jsonl")
    write_questions(questions, root / "bkt" / "data" / "q.parquet")
    shutil.copytree(ROOT / "tests" / "short_prompts", root / "bkt" / "prompts")
    # A tiny model's HF directory: its safetensors, config.json and tokenizer files.
    cfg = policy.ModelConfig(preset="tiny-chat", seed=5)
    model, tokenizer = policy.load(cfg)
    hf_checkpoint.save(model, root / "bkt" / "model")
    tokenizer.save_pretrained(str(root / "bkt" / "model"))
    with emulated_gcs(root):
        assert read_questions("gs://bkt/data/q.jsonl") == read_questions("gs://bkt/data/q.parquet") == questions
        assert load_questions("gs://bkt/data/q.jsonl,bundled") == questions + bundled_questions()
        assert prompt_sets.load("gs://bkt/prompts") == dataclasses.replace(
            prompt_sets.load(str(root / "bkt" / "prompts")), name="gs://bkt/prompts")
        remote_cfg = dataclasses.replace(cfg, preset="", checkpoint="gs://bkt/model")
        remote, remote_tokenizer = policy.load(remote_cfg)
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(remote)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert remote_tokenizer.encode("gs:// at last") == tokenizer.encode("gs:// at last")
        assert tokenizer_lib.chat_ids(remote_tokenizer, "hi") == tokenizer_lib.chat_ids(tokenizer, "hi")
        # --checkpoint in the bucket: an HF directory, and a run directory (orbax steps + config.json).
        exported, _, what = policy_source.load("gs://bkt/model", policy.ModelConfig(preset="tiny"))
        assert what == "HF checkpoint gs://bkt/model"
        state = train_state.create_train_state(model, train_state.TrainConfig())
        state = state.replace(params=jax.tree.map(lambda x: x + 0.5, state.params))  # not the initial weights
        with checkpointing.Checkpointer("gs://bkt/run/checkpoints", checkpointing.CheckpointConfig(async_save=False)) as c:
            c.save(3, state, {"step": 3}, force=True)
        storage.write_text("gs://bkt/run/config.json", json.dumps({"model": dataclasses.asdict(cfg)}))
        restored, _, what = policy_source.load("gs://bkt/run", policy.ModelConfig(preset="tiny"))  # the run's model
        assert what == "gs://bkt/run/checkpoints step 3"
        for a, b, c in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(exported)),
                           jax.tree.leaves(nnx.state(restored)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(a) + 0.5, np.asarray(c))
        # Missing inputs: one line naming the URI as given (never the mangled gs:/bkt).
        _one_line(lambda: policy_source.load("gs://bkt/nope", cfg), "--checkpoint=gs://bkt/nope: no such directory")
        _one_line(lambda: read_questions("gs://bkt/data/nope.jsonl"), "data file gs://bkt/data/nope.jsonl: not found")
        _one_line(lambda: prompt_sets.load("gs://bkt/nope"), "env.prompt_set 'gs://bkt/nope' is neither")
        _one_line(lambda: hf_checkpoint.load("gs://bkt/nope"), "checkpoint directory gs://bkt/nope does not exist")
        _one_line(lambda: policy.load(dataclasses.replace(remote_cfg, checkpoint="gs://bkt/nope")),
                  "model.checkpoint=gs://bkt/nope: no such directory")
        # Unreadable (objects that answer 403; the model's config.json is readable, its weights not): one
        # line naming the input and why.
        real_open = fsspec.implementations.local.LocalFileSystem._open

        def forbidden(self, path, *args, **kwargs):
            if "secret" in str(path) and not str(path).endswith(".json"):
                raise PermissionError(403, "Forbidden")
            return real_open(self, path, *args, **kwargs)

        monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "_open", forbidden)
        shutil.copy(root / "bkt" / "data" / "q.jsonl", root / "bkt" / "data" / "secret.jsonl")
        _one_line(lambda: read_questions("gs://bkt/data/secret.jsonl"),
                  "data file gs://bkt/data/secret.jsonl: cannot be read (PermissionError")
        shutil.copytree(root / "bkt" / "model", root / "bkt" / "secret-model")
        _one_line(lambda: hf_checkpoint.load("gs://bkt/secret-model"),
                  "checkpoint directory gs://bkt/secret-model: cannot be read (PermissionError")
    assert not (tmp_path / "gs:").exists() and not os.listdir(downloads)  # the downloads are gone
    if importlib.util.find_spec("gcsfs") is None:  # gs:// without the cloud requirements: one line, the fix
        with pytest.raises(DataError, match=r"^data file gs://bkt/data/q.jsonl: reading gs:// needs its file system "
                                            r"\(ImportError: .*\); pip install -r requirements-cloud.txt$"):
            read_questions("gs://bkt/data/q.jsonl")


def test_the_executors_local_llm_reads_its_model_from_gs(tmp_path):
    """`python -m workflow_r1.executor --llm=local:gs://...`: the weights and tokenizer read from the
    bucket generate what the same directory read locally does; a missing model, or one without
    tokenizer files, is one line naming the URI."""
    from workflow_r1 import policy
    from workflow_r1.executor.factory import build_llm
    from workflow_r1.executor.local_backend import make_local_generate_fn
    from workflow_r1.model import checkpoint as hf_checkpoint

    root = tmp_path / "gcs"
    model, tokenizer = policy.load(policy.ModelConfig(preset="tiny-chat", seed=3))
    hf_checkpoint.save(model, root / "bkt" / "model")
    tokenizer.save_pretrained(str(root / "bkt" / "model"))
    hf_checkpoint.save(model, root / "bkt" / "weights-only")
    prompts = ["What is 2 + 2?", "Name a colour."]
    local = make_local_generate_fn(str(root / "bkt" / "model"), cache_size=128)(prompts, 12)
    with emulated_gcs(root):
        remote = make_local_generate_fn("gs://bkt/model", cache_size=128)
        assert remote(prompts, 12) == local and any(text for text, _ in local)
        _one_line(lambda: build_llm("local:gs://bkt/nope"),
                  "LLM spec local:gs://bkt/nope: checkpoint directory gs://bkt/nope does not exist")
        _one_line(lambda: build_llm("local:gs://bkt/weights-only"),
                  "LLM spec local:gs://bkt/weights-only: no tokenizer files in gs://bkt/weights-only")
    assert not (tmp_path / "gs:").exists() and not (ROOT / "gs:").exists()


def test_a_run_trained_on_gs_is_evaluated_from_the_bucket(tmp_path, monkeypatch):
    """docs/replicate.md §3 then §4 against a bucket: a tiny run trains on gs:// (its question files and
    prompt set there too), then `python -m workflow_r1.evaluate --checkpoint=gs://bkt/run
    --data=gs://...` evaluates its orbax checkpoint into the bucket: the same episodes as the same
    evaluation of the run's files read locally. Its HF export (checkpoint.export_dtype=bfloat16) loads
    from the bucket as the checkpoint's weights rounded to bf16."""
    import subprocess
    import sys

    import jax
    import ml_dtypes

    from tests.test_train import CONFIG, SMALL
    from workflow_r1 import configlib, run_config, trainer
    from workflow_r1.data import bundled_questions, write_questions
    from workflow_r1.eval import job, policy_source

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "gcs"
    questions = bundled_questions()
    write_questions(questions[:8], root / "bkt" / "data" / "train.jsonl")
    write_questions(questions[8:10], root / "bkt" / "data" / "test.jsonl")
    shutil.copytree(ROOT / "tests" / "short_prompts", root / "bkt" / "prompts")
    overrides = [*(o for o in SMALL if not o.startswith("env.prompt_set=")), "env.prompt_set=gs://bkt/prompts",
                 "data.train_files=gs://bkt/data/train.jsonl", "checkpoint.export_dtype=bfloat16",
                 "rollout.max_response_tokens=64", "rollout.max_turn_tokens=16", "rollout.max_assistant_turns=2",
                 "data.eval_holdout=0"]
    with emulated_gcs(root):
        run = run_config.Run.from_config(configlib.load(CONFIG, ["steps=1", *overrides]))
        t = trainer.Trainer(run, "gs://bkt/run")
        t.train()
        t.finish()
        cli = subprocess.run([sys.executable, "-m", "workflow_r1.evaluate", f"--config={CONFIG}",
                              *(f"--config.{o}" for o in overrides), "--checkpoint=gs://bkt/run",
                              "--data=gs://bkt/data/test.jsonl"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert cli.returncode == 0, cli.stderr[-3000:]
        local, _ = job.evaluate_run(run, checkpoint=str(root / "bkt" / "run"), data=str(root / "bkt" / "data" / "test.jsonl"))
        trained, _, what = policy_source.load("gs://bkt/run", run.model)
        exported, _, _ = policy_source.load("gs://bkt/run/hf", run.model)
    assert what == "gs://bkt/run/checkpoints step 1"
    out = root / "bkt" / "run" / "eval-workflow"
    assert _lines((out / "episodes.jsonl").read_text()) == [e.summary() for e in local.episodes]
    assert len(local.episodes) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["checkpoint"], summary["data"]) == ("gs://bkt/run", "gs://bkt/data/test.jsonl")
    assert json.loads((root / "bkt" / "run" / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(exported), strict=True):
        np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), np.asarray(b))
    assert not (tmp_path / "gs:").exists()


# --------------------------------------------------------------------------------------------------
# Two hosts and one bucket (tests/gcs_multihost_worker.py, 2 processes x 2 CPU devices)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """One 2-process job: the tiny seed-0 model exported to gs://bkt/model in 13 safetensors files with
    an index, loaded by both hosts onto one mesh; then a train state saved to gs://bkt/run and restored."""
    from workflow_r1 import checkpointing, multiprocess
    from workflow_r1.model import checkpoint as hf_checkpoint
    from workflow_r1.model import qwen2
    from workflow_r1.model.config import get_preset

    base = tmp_path_factory.mktemp("two_hosts")
    root, out = base / "gcs", base / "out"
    hf_checkpoint.save(qwen2.create(get_preset("tiny"), seed=0), root / "bkt" / "model", max_shard_bytes=40_000)
    with emulated_gcs(root):
        job = multiprocess.launch(["tests.gcs_multihost_worker", f"--out={out}", "--workdir=gs://bkt/run",
                                   "--model=gs://bkt/model"], num_processes=2, devices_per_process=2, timeout_s=300,
                                  cwd=ROOT)
        assert job.ok, f"{job.describe()}\n{job.output()[-6000:]}"
        with checkpointing.Checkpointer("gs://bkt/run/checkpoints") as c:  # what the bucket holds, read back here
            steps = c.all_steps()
    return {"root": root, "out": out, "steps": steps}


def test_two_processes_save_a_sharded_state_to_gs_and_restore_it_exactly(two_hosts):
    root, out = two_hosts["root"], two_hosts["out"]
    assert two_hosts["steps"] == [3]
    hosts = [json.loads((out / f"checkpoint_p{i}.json").read_text()) for i in range(2)]
    for h in hosts:
        assert h["steps"] == [3] and h["extra"] == {"step": 3, "processes": 2}
        assert h["same_layout"] and h["mismatched"] == [] and h["shards"] > 0 and h["sharded_leaves"] > 10
    state = root / "bkt" / "run" / "checkpoints" / "3" / "state"
    assert sorted(p.name for p in state.glob("ocdbt.process_*")) == ["ocdbt.process_0", "ocdbt.process_1"]
    assert not (ROOT / "gs:").exists()


def _safetensors_header(path: pathlib.Path) -> tuple[int, dict]:
    """(where the tensors' bytes start, {name: (shape, [begin, end) in the file)}), parsed here."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return 8 + n, {k: (v["shape"], [8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]]) for k, v in header.items()}


def test_each_host_reads_only_the_rows_of_the_safetensors_it_places(two_hosts):
    """`model.checkpoint=gs://...` on two hosts: no file is downloaded or opened whole; each host reads
    the byte ranges of the rows its shards need. Under fsdp across the hosts (the `embed` axis split),
    o_proj and down_proj ([embed, ...] in HF's [out, in]) are read half by each host, disjoint halves
    that cover them; every other tensor (q/k/v, gate/up: [..., embed]; the embedding: [vocab, embed];
norms and biases, replicated) is read whole by both."""
    root, out = two_hosts["root"], two_hosts["out"]
    model_dir = root / "bkt" / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 4  # several files, mapped by the index
    headers = {f: _safetensors_header(model_dir / f)[1] for f in set(index.values())}
    hosts = [json.loads((out / f"model_p{i}.json").read_text()) for i in range(2)]
    covered = []
    for h in hosts:
        assert h["mismatched"] == [] and h["opened"] == []
        got: dict[str, set[int]] = {}  # tensor -> the byte offsets of it this host read
        for name, start, end in h["reads"]:
            for tensor, (_, (b, e)) in headers[name].items():
                if start < e and end > b:
                    assert b <= start and end <= e, (tensor, start, end)  # a read never spans two tensors
                    got.setdefault(tensor, set()).update(range(start, end))
        assert set(got) == set(index)  # every tensor: each host places a part of each
        sizes = {t: headers[index[t]][t][1][1] - headers[index[t]][t][1][0] for t in index}
        for t in index:
            half = t.endswith(("o_proj.weight", "down_proj.weight"))
            assert len(got[t]) == (sizes[t] // 2 if half else sizes[t]), t
        assert sum(map(len, got.values())) < sum(sizes.values())
        covered.append(got)
    for t in index:
        if t.endswith(("o_proj.weight", "down_proj.weight")):
            assert not covered[0][t] & covered[1][t] and len(covered[0][t] | covered[1][t]) == sizes[t], t
