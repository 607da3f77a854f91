"""Launchers in dry-run mode (what they would run), the sweep's grid, directories and skips with a
stand-in for the trainer, and the workflow ablation's train.py commands: both take the trainer's
`--config=FILE:PRESET --config.key=value` (their old `--set` / `--override` are one-line errors)."""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(cmd, env=None, timeout=120, **kw):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, **kw)


def test_tpu_pod_dry_run_runs_the_trainer_on_every_worker():
    proc = _run(["bash", "launch/tpu_pod.sh", "--config=configs/gsspo.py:paper",
                 "--config.executor.url=http://a:8000,http://b:8000", "--workdir=gs://bucket/run 1"],
                env={"DRY_RUN": "1", "TPU_NAME": "wr1-v5p-64", "ZONE": "us-east5-a", "PROJECT": "proj"})
    assert proc.returncode == 0, proc.stderr
    gcloud = shlex.split(proc.stdout.splitlines()[-1])
    assert gcloud[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "wr1-v5p-64"]
    assert {"--zone=us-east5-a", "--worker=all", "--project=proj"} <= set(gcloud)
    remote = next(a for a in gcloud if a.startswith("--command="))[len("--command="):]
    # What each worker's shell runs: jax.distributed from the environment, the arguments intact.
    words = shlex.split(remote.split("&&")[-1])
    assert words[:4] == ["WORKFLOW_R1_DISTRIBUTED=1", ".venv/bin/python", "-m", "workflow_r1.train"]
    assert words[4:] == ["--config=configs/gsspo.py:paper", "--config.executor.url=http://a:8000,http://b:8000",
                         "--workdir=gs://bucket/run 1"]
    setup = _run(["bash", "launch/tpu_pod.sh"], env={"DRY_RUN": "1", "SETUP": "1", "TPU_NAME": "t", "ZONE": "z",
                                                      "MODULE": "workflow_r1.evaluate"})
    assert "pip install -q -r requirements-tpu.txt" in setup.stdout and "-m workflow_r1.evaluate" in setup.stdout
    missing = _run(["bash", "launch/tpu_pod.sh"], env={"DRY_RUN": "1", "TPU_NAME": ""})
    assert missing.returncode != 0 and "TPU_NAME" in missing.stderr


def test_gpu_dry_run():
    proc = _run(["bash", "launch/gpu.sh", "--config=configs/gsspo.py:paper", "--config.steps=2"],
                env={"DRY_RUN": "1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"})
    assert proc.returncode == 0, proc.stderr
    env_line, cmd = proc.stdout.splitlines()
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45" in env_line
    assert shlex.split(cmd) == [".venv/bin/python", "-m", "workflow_r1.train", "--config=configs/gsspo.py:paper",
                                "--config.steps=2"]


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    """benchmarks/gpu.py runs end to end (tiny model, CPU) and its MFU / bandwidth come from the table."""
    out = tmp_path / "gpu.json"
    proc = _run([sys.executable, "benchmarks/gpu.py", "--smoke", "--peak_tflops=1", "--peak_tbps=1",
                 f"--out={out}"], timeout=480)  # ~90 s alone on 2 cores, more beside another test worker
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    (train, peer_train), (decode, peer_decode) = res["train"], res["decode"]
    assert train["impl"] == "ours" and train["step_s"] > 0 and train["model_tflops"] == pytest.approx(
        6 * train["params"] * train["rows"] * train["length"] / train["step_s"] / 1e12)
    assert decode["impl"] == "ours" and decode["batch"] == 2 and decode["tok_s"] > 0 and decode["tbps"] > 0
    # The PyTorch peer (HF Qwen2 from the same config; on the CPU here) ran the same shapes.
    assert peer_train["impl"] == "torch" and peer_train["params"] == train["params"] and peer_train["step_s"] > 0
    assert peer_decode["impl"] == "hf" and peer_decode["batch"] == 2 and peer_decode["tok_s"] > 0
    assert "MFU" in proc.stdout and "| torch |" in proc.stdout and "| hf | 2 |" in proc.stdout
    assert not res["failed"] and not res["skipped"]
    refused = _run([sys.executable, "benchmarks/gpu.py"])  # no accelerator here: one clear line
    assert refused.returncode != 0 and "no accelerator" in refused.stderr


def test_local_launcher_puts_cpu_buffers_on_huge_pages():
    text = (ROOT / "launch" / "local.sh").read_text()
    assert 'export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"' in text
    assert text.index("GLIBC_TUNABLES") < text.index("-m workflow_r1.train")


def _sweep(tmp_path, *extra):
    return _run([sys.executable, "launch/sweep.py", "--config=configs/gsspo.py:tiny",
                 "--grid=train.learning_rate=1e-6,3e-6", "--grid=seed=0,1,2", "--config.steps=3",
                 f"--root={tmp_path / 'sweep'}", *extra])


def test_sweep_dry_run_prints_the_grid(tmp_path):
    proc = _sweep(tmp_path, "--dry_run")
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(cmds) == 6
    points = {(c[c.index("-m") + 1], next(a for a in c if a.startswith("--config.train.learning_rate")),
               next(a for a in c if a.startswith("--config.seed"))) for c in cmds}
    assert len(points) == 6 and all(p[0] == "workflow_r1.train" for p in points)
    assert all("--config.steps=3" in c for c in cmds)
    assert cmds[0][-1] == f"--workdir={tmp_path / 'sweep' / 'seed=0,train.learning_rate=1e-6'}"
    assert not (tmp_path / "sweep").exists()
    bad = _run([sys.executable, "launch/sweep.py", "--config=configs/gsspo.py:tiny", "--grid=train.lr=1,2",
                "--dry_run"])
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: config key train.lr unknown")
    bad = _run([sys.executable, "launch/sweep.py", "--config=configs/gsspo.py:tiny", "--config.train.lr=1",
                "--dry_run"])
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: config key train.lr unknown")
    old = _run([sys.executable, "launch/sweep.py", "--config=configs/gsspo.py:tiny", "--set=steps=3", "--dry_run"])
    assert old.returncode == 2 and old.stderr.strip() == "error: --set is gone; write --config.steps=3 instead"


def test_sweep_runs_every_point_once(tmp_path):
    # A stand-in for the trainer: records its arguments in the work directory and finishes it,
    # except for seed 2, which fails.
    fake = ("import json, pathlib, sys; a = sys.argv[1:]; w = pathlib.Path(a[-1].split('=', 1)[1]); "
            "w.mkdir(parents=True); (w / 'args.json').write_text(json.dumps(a)); "
            "sys.exit(3) if '--config.seed=2' in a else (w / 'summary.json').write_text('{}')")
    launcher = f"{sys.executable} -c {shlex.quote(fake)}"
    proc = _sweep(tmp_path, f"--launcher={launcher}")
    assert proc.returncode == 1 and "2 of 6 points failed" in proc.stderr
    root = tmp_path / "sweep"
    finished = sorted(p.parent.name for p in root.glob("*/summary.json"))
    assert finished == [f"seed={s},train.learning_rate={lr}" for s in (0, 1) for lr in ("1e-6", "3e-6")]
    plan = json.loads((root / "sweep.json").read_text())
    assert len(plan["points"]) == 6 and plan["points"][0]["point"] == {"train.learning_rate": "1e-6", "seed": "0"}
    assert plan["overrides"] == ["steps=3"]
    again = _sweep(tmp_path, f"--launcher={launcher}")
    assert again.stdout.count("finished before, skipped") == 4


def test_workflow_ablation_dry_run_prints_train_commands(tmp_path):
    proc = _run([sys.executable, "-m", "workflow_r1.ablation", "--task=workflow", "--config=configs/gsspo.py:paper",
                 "--seeds=2", "--config.steps=38", f"--out={tmp_path}", "--config.executor.url=http://e:8000",
                 "--dry_run"])
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(cmds) == 10
    assert sorted(next(a for a in c if a.startswith("--config.seed=")) for c in cmds) == \
        ["--config.seed=0"] * 5 + ["--config.seed=1"] * 5
    configs = sorted({next(a for a in c if a.startswith("--config=")).rsplit("/", 1)[1] for c in cmds})
    assert configs == ["grpo.py:paper", "gspo.py:paper", "gspo.py:paper,tight", "gsspo.py:paper",
                       "gsspo.py:paper,tight"]
    for c in cmds:
        assert c[1:3] == ["-m", "workflow_r1.train"]
        seed = next(a for a in c if a.startswith("--config.seed=")).split("=")[1]
        assert next(a for a in c if a.startswith("--workdir=")).endswith(f"-seed{seed}")
        assert {"--config.steps=38", "--config.executor.url=http://e:8000"} <= set(c)
    assert f"--workdir={tmp_path / 'runs' / 'gsspo-tight-seed1'}" in cmds[-1]
    bad = _run([sys.executable, "-m", "workflow_r1.ablation", "--losses=gsspo,ppo", "--dry_run"])
    assert bad.returncode == 2 and "ppo" in bad.stderr
    # The runs' overrides are checked before any runs: a wrong key or value is one line.
    for args, line in (
            (["--config.executor.urll=http://e:8000"], "error: config key executor.urll unknown; did you mean "
                                                       "executor.url?"),
            (["--config.steps=many"], None),
            (["--override=executor.url=http://e:8000"], "error: --override is gone; write "
                                                        "--config.executor.url=http://e:8000 instead"),
            (["--steps=38"], "error: --steps is gone; write --config.steps=38 instead"),
            (["--preset=paper"], "error: --preset is gone; write --config=configs/gsspo.py:paper instead"),
            (["--config=configs/gsspo.py:paper,tight"], None)):
        bad = _run([sys.executable, "-m", "workflow_r1.ablation", "--task=workflow", "--config=configs/gsspo.py:paper",
                    *args, "--dry_run"])
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)
        assert line is None or bad.stderr.strip() == line, bad.stderr


def test_the_ablation_runs_through_the_sweeps_runner(tmp_path, capsys):
    from workflow_r1 import sweep
    from workflow_r1.ablation import runs

    # A finished workflow-task run (summary.json) is read, not run again: nothing here could train.
    done = tmp_path / "runs" / "gsspo-seed0"
    done.mkdir(parents=True)
    row = {"step": 1, "rollout/reward": 0.5, "rollout/em": 0.5, "rollout/format_ok": 1.0, "rollout/calls": 1.0,
           "eval/em": 0.25}
    (done / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (done / "summary.json").write_text("{}")
    [run] = runs.workflow_runs(["gsspo"], 1, 0, "tiny", ["checkpoint.export_hf=False"], tmp_path / "runs")
    assert (run.workdir, run.overrides, run.finished) == (done, ("seed=0", "checkpoint.export_hf=False"), True)
    results = runs.run_workflow(["gsspo"], 1, 0, "tiny", ["checkpoint.export_hf=False"], tmp_path / "runs")
    assert results["variants"]["gsspo"]["seeds"]["0"]["final"]["em"] == 0.25
    assert "gsspo-seed0: finished before, skipped" in capsys.readouterr().out
    # The ablation stops at its first failed run; the sweep goes on and returns the failures.
    first, second = (sweep.Run("configs/gsspo.py:tiny", (), tmp_path / name) for name in ("first", "second"))
    fail = [sys.executable, "-c", "raise SystemExit(3)"]
    mark = [sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"]
    with pytest.raises(subprocess.CalledProcessError):
        sweep.run([first, second], [fail, mark], keep_going=False)
    assert not (tmp_path / "ran").exists()
    assert sweep.run([first, second], [fail, mark], keep_going=True) == [first]
    assert (tmp_path / "ran").exists()
    # A run that exits 0 without summary.json was preempted: the sweep stops, the next run does not start.
    (tmp_path / "ran").unlink()
    assert sweep.run([first, second], [[sys.executable, "-c", "pass"], mark]) == []
    assert not (tmp_path / "ran").exists() and "first: preempted, sweep stopped" in capsys.readouterr().out
