"""Multi-host on one machine: 2 JAX processes x 2 CPU devices (gloo collectives over localhost) against
1 process x 4 devices, both started by the launcher a pod run uses locally (workflow_r1.multiprocess).

The program is tests/multihost_worker.py (see its docstring). Three runs:
  one:  1 process x 4 devices; saves checkpoint step 2;
  two:  2 processes x 2 devices; restores one's step 2, saves its own; process 1 is SIGKILLed right
        after it starts the save of step 3 (so the launcher kills process 0 and reports process 1);
  back: 1 process x 4 devices; restores two's step 2.
Compared: the train step (loss, grad norm, parameters, optimizer state: equal to 1e-6; measured
bit-identical), each host's data slices, the checkpoints across process counts, the killed save,
the sampler's tokens. The trainer itself (the tiny preset) is compared at the end of the file.
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from tests.gcs_emulator import emulated_gcs
from workflow_r1 import checkpointing, multiprocess, preemption

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ["tests.multihost_worker"]
TIMEOUT_S = 240


def _launch(program, processes: int, devices: int, timeout_s: float = TIMEOUT_S) -> multiprocess.JobResult:
    return multiprocess.launch(program, num_processes=processes, devices_per_process=devices, timeout_s=timeout_s,
                               cwd=ROOT)


def _require_ok(result: multiprocess.JobResult, what: str) -> None:
    if not result.ok:
        pytest.fail(f"{what}: {result.describe()}\n{result.output()[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("multihost")
    one, two, back = base / "one", base / "two", base / "back"
    _require_ok(_launch([*WORKER, f"--out={one}"], 1, 4), "1 process x 4 devices")
    killed = _launch([*WORKER, f"--out={two}", f"--restore_from={one / 'ckpt'}", "--kill_after_save=1"], 2, 2)
    # What the killed save left, before any Checkpointer opens the directory (which cleans it up).
    left = sorted(p.name for p in (two / "ckpt").iterdir())
    _require_ok(_launch([*WORKER, f"--out={back}", f"--restore_from={two / 'ckpt'}"], 1, 4), "1 process restoring")
    return {"one": one, "two": two, "back": back, "killed": killed, "left": left}


def _npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray], prefix: str = "") -> float:
    keys = [k for k in a if k.startswith(prefix) and k != "extra"]
    assert keys and sorted(keys) == sorted(k for k in b if k.startswith(prefix) and k != "extra")
    worst = 0.0
    for k in keys:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if a[k].size:
            worst = max(worst, float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))))
    return worst


def _json(run: pathlib.Path, name: str, processes: int) -> list[dict]:
    return [json.loads((run / f"{name}_p{i}.json").read_text()) for i in range(processes)]


def test_launcher_reports_the_killed_process_and_stops_the_others(runs):
    killed = runs["killed"]
    # Process 1 killed itself (SIGKILL); process 0, left waiting for it, was killed by the launcher.
    assert killed.failed == 1 and killed.processes[1].returncode == -9 and not killed.timed_out
    assert killed.processes[0].returncode == -9
    assert "worker done" not in killed.output()
    assert all(line.startswith(f"[p{p.process_id}] ") for p in killed.processes for line in p.output.splitlines())


def test_sharded_train_step_equals_one_process(runs):
    one, two = _npz(runs["one"] / "step.npz"), _npz(runs["two"] / "step.npz")
    # Each host passed only its rows to shard_batch: the global batch is the one-process batch.
    assert _max_abs_diff(one, two, "batch") == 0
    assert np.all(np.isfinite(one["loss"])) and np.all(one["grad_norm"] > 1e-3)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(two[key], one[key], rtol=0, atol=1e-6)
    assert _max_abs_diff(one, two, "['params']") <= 1e-6
    assert _max_abs_diff(one, two, "['opt_state']") <= 1e-6
    assert int(two["['step']"]) == int(one["['step']"]) == 4  # 2 rollout batches x 2 mini-batches


def test_host_data_slices_are_disjoint_make_the_global_batch_and_resume(runs):
    whole = _json(runs["one"], "data", 1)[0]
    assert whole == _json(runs["back"], "data", 1)[0]  # the same order in every run
    hosts = _json(runs["two"], "data", 2)
    for key in ("drawn", "resumed"):
        for s, batch in enumerate(whole[key]):
            parts = [h[key][s] for h in hosts]
            assert all(len(p) == len(batch) // 2 for p in parts)
            assert not set(parts[0]) & set(parts[1])
            assert parts[0] + parts[1] == batch  # host h holds rows [h*B/2, (h+1)*B/2)
    assert whole["resumed"] == whole["drawn"][2:]  # resumed at step 2: what the uninterrupted run drew
    assert len({q for batch in whole["drawn"][:4] for q in batch}) == 16  # 4 distinct batches of an epoch


def test_checkpoints_restore_across_process_counts(runs):
    one, two, back = (_npz(runs[k] / "step.npz") for k in ("one", "two", "back"))
    from_one = _npz(runs["two"] / "restored.npz")  # saved by 1 process, restored by 2
    from_two = _npz(runs["back"] / "restored.npz")  # saved by 2 processes, restored by 1
    assert json.loads(str(from_one["extra"])) == {"step": 2, "processes": 1}
    assert json.loads(str(from_two["extra"])) == {"step": 2, "processes": 2}
    for restored, saved in ((from_one, one), (from_two, two)):
        assert _max_abs_diff(restored, saved, "['params']") == 0
        assert _max_abs_diff(restored, saved, "['opt_state']") == 0
        assert int(restored["['step']"]) == int(saved["['step']"])
    assert _max_abs_diff(back, one, "") == 0


def test_save_killed_on_one_process_is_never_complete(runs):
    # Step 2 finished; step 3 was being written when process 1 died: only a temporary directory.
    assert "2" in runs["left"] and "3" not in runs["left"], runs["left"]
    assert any(name.startswith("3.orbax-checkpoint-tmp") for name in runs["left"]), runs["left"]
    with checkpointing.Checkpointer(runs["two"] / "ckpt") as c:
        assert c.all_steps() == [2]


def test_each_host_samples_its_rows_like_one_process(runs):
    whole = _json(runs["one"], "sampler", 1)[0]
    hosts = _json(runs["two"], "sampler", 2)
    assert hosts[0]["tokens"] + hosts[1]["tokens"] == whole["tokens"]
    assert len({tuple(t) for t in whole["tokens"]}) == 4  # sampled (temperature 1), not degenerate
    lps = [np.asarray(x) for h in hosts for x in h["logprobs"]]
    assert max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in zip(lps, whole["logprobs"])) < 1e-5


def test_launcher_timeout_kills_every_process(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('started', os.getpid(), flush=True)\ntime.sleep(600)\n")
    result = _launch([str(script)], 2, 1, timeout_s=3)
    assert result.timed_out and result.returncode == multiprocess.TIMEOUT_STATUS
    assert [p.returncode for p in result.processes] == [-9, -9]
    assert "[p0] started" in result.output() and "[p1] started" in result.output()


def test_launcher_sets_the_variables_maybe_initialize_distributed_reads():
    env = multiprocess.process_env(1, 2, 3, 4567, base={})
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:4567"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("2", "1")
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    assert "JAX_COORDINATOR_ADDRESS" not in multiprocess.process_env(0, 1, 4, 4567, base={})
    assert multiprocess.command(["workflow_r1.train", "--x=1"]) == [sys.executable, "-m", "workflow_r1.train", "--x=1"]
    assert multiprocess.command(["a/b.py"]) == [sys.executable, "a/b.py"]


# ------------------------------------------------------------------------------------------------
# The trainer: 2 steps of the tiny preset
# ------------------------------------------------------------------------------------------------

# Small budgets (tests/test_train.py's, shortened): 2 questions x 2 samples per step, one eval question.
TRAIN = ["workflow_r1.train", f"--config={ROOT}/configs/gsspo.py:tiny", "--config.steps=2",
         *(f"--config.{o}" for o in ("rollout.prompts_per_step=2", "rollout.max_response_tokens=64",
                                     "rollout.max_turn_tokens=32", "rollout.pad_multiple=128", "data.eval_holdout=2",
                                     "eval.max_questions=1", "log_trajectories=4", "mesh.tensor=2",
                                     "train.entropy_coef=0.01"))]
# What differs between any two runs (wall-clock times, memory, throughput).
UNTIMED = ("time/", "memory/", "rollout/tokens_per_s", "perf/")
# The engine's schedule, which depends on which rows share a host: its calls, the prompt tokens
# each host's own prefix cache did not hold (every host computes the shared template once), the
# pages a host's rows held at their peak, and the versions a partial rollout loaded.
SCHEDULE = ("rollout/rounds", "rollout/prefill_tokens", "rollout/prefix_hit_rate", "rollout/preemptions",
            "rollout/kv_bytes_peak", "rollout/kv_overhead", "rollout/version_loads")


def _metrics(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


# Asynchronous training with partial rollouts over 3 steps: step 3's batch loads version 2 mid-rollout
# on each host at its own pace, and two turns an episode (a warning observation, about 280 byte
# tokens, fits the budget once) give every step after the first turns by two versions.
PARTIAL = ["--config.steps=3", "--config.train.partial_rollouts=True", "--config.rollout.max_response_tokens=384",
           "--config.rollout.max_turn_tokens=16"]


@pytest.mark.parametrize("max_staleness,share_prompts,max_tokens_per_step",
                         [(0, False, 0), (1, False, 0), (0, True, 48)])
def test_trainer_two_processes_equal_one_with_host_0_writing(tmp_path, max_staleness, share_prompts,
                                                             max_tokens_per_step):
    """With max_staleness 1 (asynchronous training, with partial rollouts) every host rolls its
    batches out ahead, each turn by the same version, loading the newer ones at its own pace (their
    weights gathered by the trainer's thread, in every host's order), and the hosts still agree on
    every step's batch, metrics and weights. With
    share_prompts the hosts build one plan of the global batch from each other's row records. With
    ragged engine steps (rollout.max_tokens_per_step) each host's steps mix its own rows' decode
    tokens and prompt chunks, and the hosts still sample what one process does."""
    # The 2-process job writes to one shared bucket (gs://, served by tests/gcs_emulator.py) as a pod
    # would; `two` is where the emulator keeps that bucket's files.
    one, two = tmp_path / "one", tmp_path / "gcs" / "bkt" / "two"
    # Every policy text in a few words: the byte-level tokenizer makes every byte a token.
    train = [*TRAIN, f"--config.env.prompt_set={ROOT}/tests/short_prompts",
             f"--config.train.max_staleness={max_staleness}", f"--config.train.share_prompts={share_prompts}",
             f"--config.rollout.max_tokens_per_step={max_tokens_per_step}",
             # A ragged step is one flat run of tokens: the host's chips split the heads, not rows.
             f"--config.rollout.tensor_parallel={-1 if max_tokens_per_step else 0}", *(PARTIAL if max_staleness else [])]
    steps = [1, 2, 3] if max_staleness else [1, 2]
    _require_ok(_launch([*train, f"--workdir={one}"], 1, 4, timeout_s=600), "tiny trainer, 1 process")
    with emulated_gcs(tmp_path / "gcs"):
        job = _launch([*train, "--workdir=gs://bkt/two"], 2, 2, timeout_s=600)
        _require_ok(job, "tiny trainer, 2 processes")
        with checkpointing.Checkpointer("gs://bkt/two/checkpoints") as c:
            assert c.all_steps() == steps
    assert not (ROOT / "gs:").exists()
    a, b = _metrics(one), _metrics(two)  # one line per step: process 1 wrote none
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps
    compared = 0
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for key in x:
            if not key.startswith(UNTIMED + SCHEDULE):
                assert float(y[key]) == pytest.approx(float(x[key]), abs=1e-6), (x["step"], key)
                compared += 1
        assert y["rollout/prefill_tokens"] >= x["rollout/prefill_tokens"] > 0
    assert compared > 50 and b[0]["rollout/episodes"] == 4  # every host's episodes counted
    assert [r.get("async/behaviour_version") for r in b] == ([0, 0, 1] if max_staleness else [None, None])
    if max_staleness:  # episodes whose turns two versions wrote
        assert b[1]["async/versions_per_episode"] > 1 and b[2]["async/versions_per_episode"] > 1
    assert b[1]["train/updates"] == 2 and b[1]["train/grad_norm"] > 0
    # Each group's prompt once: one slot per question of the 4-row batch.
    assert [r.get("train/share_prompt_slots") for r in b][:2] == ([2.0, 2.0] if share_prompts else [None, None])
    # Host 0 alone writes: one TensorBoard file, one log; the same trajectories and final policy.
    assert len(list((two / "tensorboard").iterdir())) == 1
    for step in steps:
        name = f"trajectories/step_{step:06d}.jsonl"
        assert (two / name).read_text() == (one / name).read_text() and (one / name).read_text().count("\n") == 4
    assert (two / "hf" / "model.safetensors").read_bytes() == (one / "hf" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (two / "checkpoints" / "2" / "state").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]  # both hosts wrote their shards to the one bucket
    assert job.processes[1].output.count("workflow_r1.train:") == 0
    last = f"step {steps[-1]}/{steps[-1]}"
    assert last in job.processes[0].output and last not in job.processes[1].output


@pytest.mark.parametrize("service", [True, False])
def test_a_preemption_notice_on_one_host_stops_every_host_at_one_safe_point(tmp_path, service):
    """Process 1 alone gets SIGTERM once step 1's metrics line is written. With JAX's preemption
    service (on by default under jax.distributed) JAX holds the signal and the hosts meet at its
    sync point; without it process 1's Python handler flags it and the hosts agree by an all-gather.
    Either way both stop at the same safe point (after a step's rollout: the step abandoned and the
    one before saved; or after a step: that step saved), save together (no regular save is due) and
    exit 0; host 0 prints the one line, and it names what is on disk.

    Which safe point is a race the test does not fix: the notice reaches the other host (through
    JAX's coordination service, or at the next all-gather) while it works, and a loaded machine
    may finish step 1's end or step 2's rollout first. The run has steps to spare so a late notice
    still stops it."""
    import os
    import re
    import signal
    import subprocess
    import threading
    import time

    workdir = tmp_path / "w"
    train = [*TRAIN, f"--config.env.prompt_set={ROOT}/tests/short_prompts", "--config.steps=8",
             "--config.checkpoint.every_steps=100", "--config.checkpoint.export_hf=False", f"--workdir={workdir}"]
    job = {}
    env = {**os.environ, "JAX_ENABLE_PREEMPTION_SERVICE": str(service).lower()}
    thread = threading.Thread(target=lambda: job.update(result=multiprocess.launch(
        train, num_processes=2, devices_per_process=2, timeout_s=600, cwd=ROOT, env=env)))
    thread.start()
    metrics, deadline = workdir / "metrics.jsonl", time.time() + 600
    while thread.is_alive() and time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n")):
        time.sleep(0.1)
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
    [one] = [int(p) for p in children if b"JAX_PROCESS_ID=1\0" in pathlib.Path(f"/proc/{p}/environ").read_bytes()]
    os.kill(one, signal.SIGTERM)
    thread.join()
    result = job["result"]
    _require_ok(result, "tiny trainer, 2 processes, SIGTERM to process 1")
    p0, p1 = (p.output for p in result.processes)
    lines = [ln for ln in p0.splitlines() if "preempted:" in ln]
    assert len(lines) == 1 and "preempted:" not in p1, result.output()[-6000:]
    line = lines[0]
    step = int(re.search(r"during step (\d+);", line)[1])
    stops = {saved: f"[p0] {preemption.stop_line('a preemption notice', step, saved, workdir / 'checkpoints')}"
             for saved in (step - 1, step)}  # the rollout abandoned, or the step finished
    [saved] = [s for s, want in stops.items() if want == line]
    assert 1 <= saved < 8
    with checkpointing.Checkpointer(workdir / "checkpoints") as c:
        assert c.all_steps() == [saved]
    assert [r["step"] for r in _metrics(workdir)] == list(range(1, saved + 1))
    # With the service the stop came from its sync point, the same on both hosts (orbax logs it):
    # the safe points are each step's rollout and its end, counted from 1.
    point = f"Reached preemption sync point, step={2 * step - 1 if saved < step else 2 * step}"
    assert (point in p0 and point in p1) == service


# ------------------------------------------------------------------------------------------------
# The pieces, in this process
# ------------------------------------------------------------------------------------------------

def _episode(i: int):
    from workflow_r1.data.questions import Question
    from workflow_r1.rollout import Episode, Turn

    rng = np.random.RandomState(i)
    e = Episode(question=Question(f"q{i}", "?", ("a",), "nq"), group=i, sample=0, messages=[], prompt_ids=[1])
    for t in range(rng.randint(1, 4)):
        op = ["Custom", "Review", "WarningOp"][rng.randint(3)] if i % 3 else "Custom"  # host sets lack some
        n = rng.randint(1, 6)
        e.add_turn(list(range(n)), np.zeros(n), Turn(text="", action="tool", operator=op,
                                                                 observation="x", error_kind=None if t else "http"))
        e.add_observation([5] * rng.randint(0, 4), "x")
    e.finish_reason = ["answer", "call_cap", "budget"][rng.randint(3)] if i % 4 else "answer"
    e.reward_outcome = float(rng.choice([1.0, 0.0, -1.0]))
    e.reward_format = float(rng.choice([0.0, -1.0]))
    e.reward = e.reward_outcome + e.reward_format
    return e


def test_combined_host_metrics_equal_metrics_of_all_episodes():
    from workflow_r1.rollout import combine, episode_metrics

    episodes = [_episode(i) for i in range(12)]
    whole = episode_metrics(episodes)
    for hosts in (2, 3, 4):
        size = len(episodes) // hosts
        parts = [episode_metrics(episodes[h * size:(h + 1) * size]) for h in range(hosts)]
        assert any(set(p) != set(whole) for p in parts)  # some hosts never called some operator
        got = combine(parts)
        assert set(got) == set(whole)
        for key in whole:
            assert got[key] == pytest.approx(whole[key], abs=1e-12), key
    assert combine([]) == {}


def test_allgather_objects_and_copy_to_mesh_in_one_process():
    import jax
    from flax import nnx

    from workflow_r1 import sharding
    from workflow_r1.model import qwen2
    from workflow_r1.model.config import get_preset

    assert sharding.allgather_objects({"a": [1, "x"]}) == [{"a": [1, "x"]}]
    mesh = sharding.make_mesh(2, 2, 2)
    local = sharding.host_mesh(tensor=4)
    assert dict(local.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(sharding.host_mesh(tensor=3).shape)["tensor"] == 1  # 3 does not tile 8 devices
    params = nnx.split(qwen2.create(get_preset("tiny"), seed=0))[1]
    on_mesh = jax.device_put(params, sharding.state_shardings(params, mesh))
    small = sharding.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    moved = sharding.copy_to_mesh(on_mesh, sharding.state_shardings(params, small))
    assert sharding.on_devices(on_mesh, mesh) and not sharding.on_devices(on_mesh, small)
    assert sharding.on_devices(moved, small)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_launcher_command_line_prefixes_output_and_returns_the_failing_status(tmp_path):
    import subprocess

    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\npid = int(os.environ['JAX_PROCESS_ID'])\n"
                      "print('hello from', pid, 'of', os.environ['JAX_NUM_PROCESSES'], flush=True)\n"
                      "time.sleep(0.5)\nsys.exit(3 if pid == 1 else 0)\n")
    proc = subprocess.run([sys.executable, "-m", "workflow_r1.multiprocess", "--num_processes=2",
                           "--devices_per_process=1", "--timeout_s=60", "--", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "[p0] hello from 0 of 2" in proc.stdout and "[p1] hello from 1 of 2" in proc.stdout
    assert "process 1 exited with status 3" in proc.stderr


def test_a_jaxlib_without_gloo_is_a_clear_error(monkeypatch):
    import jax

    from workflow_r1 import sharding

    real_update = jax.config.update

    def update(name, value):
        if name == "jax_cpu_collectives_implementation":
            raise ValueError(f"unknown value {value!r}")
        real_update(name, value)

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialised without gloo"))
    monkeypatch.setattr(jax.config, "update", update)
    with pytest.raises(RuntimeError, match="cannot run CPU collectives over gloo") as e:
        sharding.maybe_initialize_distributed(True)
    assert "\n" not in str(e.value)
