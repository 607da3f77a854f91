"""Metrics: JSON lines (valid, one per step, resumable), TensorBoard events read back, process 0 only,
progress bars, the console summary line."""
from __future__ import annotations

import json
import math
import pathlib
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from workflow_r1 import metrics


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_events(logdir: pathlib.Path) -> list[event_pb2.Event]:
    """Every event of every TensorBoard file under `logdir`, in file order, CRCs checked.

    TFRecord framing: uint64 length, uint32 masked-crc32c(length), data, uint32 masked-crc32c(data).
    """
    events = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            header = data[i:i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(header)
            body = data[i + 12:i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(body)
            events.append(event_pb2.Event.FromString(body))
            i += 16 + n
    return events


def scalars(events: list[event_pb2.Event]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for e in events:
        for v in e.summary.value:
            out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def test_jsonl_lines_are_valid_sorted_and_typed(tmp_path):
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True) as w:
        w.write(1, {"loss": np.float32(0.5), "reward": jnp.asarray(-0.25), "calls": 3, "em": np.int64(2),
                    "grad_norm": float("nan"), "ratio_max": jnp.asarray([np.inf]), "ratio_min": -math.inf})
        w.write(2, {"loss": 0.125})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        # Strict JSON (no NaN / Infinity tokens), keys sorted.
        record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert list(record) == sorted(record)
    first = json.loads(lines[0])
    assert first == {"step": 1, "loss": 0.5, "reward": -0.25, "calls": 3, "em": 2, "grad_norm": "nan",
                     "ratio_max": "inf", "ratio_min": "-inf"}
    assert isinstance(first["calls"], int) and isinstance(first["em"], int) and isinstance(first["loss"], float)
    assert math.isnan(float(first["grad_norm"])) and float(first["ratio_max"]) == math.inf


def test_write_rejects_arrays_and_the_step_key(tmp_path):
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True) as w:
        with pytest.raises(ValueError, match=r"metric 'loss' has shape \[3\]; write scalars"):
            w.write(1, {"loss": jnp.zeros(3)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(1, {"step": 3})


def test_resume_drops_the_steps_it_rewrites(tmp_path):
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True) as w:
        for s in range(1, 6):
            w.write(s, {"x": float(s)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x"')  # a killed run's torn last line
    # Restarted from the checkpoint of step 2: the next step written is 3.
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True, resume_from=3) as w:
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
        for s in (3, 4):
            w.write(s, {"x": 10.0 * s})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # Without resume_from the file is appended to as it is.
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True) as w:
        w.write(5, {"x": 50.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_step_rows_read_back_as_written(tmp_path):
    rows = [{"id": "q1", "reward": 1.0, "text": "é"}, {"id": "q2", "reward": -0.5}]
    metrics.write_step_rows(tmp_path / "eval", 16, rows)
    assert metrics.step_file(tmp_path / "eval", 16).name == "step_000016.jsonl"
    assert metrics.read_step_rows(tmp_path / "eval", 16) == rows


def test_drop_step_files_deletes_only_the_steps_rewritten(tmp_path):
    d = tmp_path / "trajectories"
    d.mkdir()
    for name in ("step_000001.jsonl", "step_000002.jsonl", "step_000010.jsonl", "notes.jsonl", "step_x.jsonl"):
        (d / name).write_text("{}\n")
    assert metrics.drop_step_files(d, 2) == ["step_000002.jsonl", "step_000010.jsonl"]
    assert sorted(p.name for p in d.iterdir()) == ["notes.jsonl", "step_000001.jsonl", "step_x.jsonl"]
    assert metrics.drop_step_files(tmp_path / "absent", 0) == []


def test_tensorboard_events_read_back(tmp_path):
    with metrics.MetricWriter(tmp_path, enabled=True) as w:
        w.write(1, {"loss": 0.5, "reward": jnp.asarray(-1.5)})
        w.write(2, {"loss": 0.25, "reward": np.float64(2.0)})
        w.flush()
        got = scalars(read_events(tmp_path / "tensorboard"))
        assert got == {"loss": [(1, 0.5), (2, 0.25)], "reward": [(1, -1.5), (2, 2.0)]}
    # A resumed writer tells TensorBoard to discard the old run's events from its first step on.
    with metrics.MetricWriter(tmp_path, enabled=True, resume_from=2) as w:
        w.write(2, {"loss": 0.75})
    events = read_events(tmp_path / "tensorboard")
    starts = [e.step for e in events if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [2]
    # Both files are there (a second writer in the same second must not truncate the first).
    assert scalars(events)["loss"] == [(1, 0.5), (2, 0.25), (2, 0.75)]


def wandb_records(path: pathlib.Path) -> list:
    """The records of a wandb transaction log (`run-<id>.wandb`): a 7-byte header (":W&B", 0xBEE1,
    version 0), then LevelDB's log format, 32 KiB blocks of records framed by (crc32c, length, type),
    a record split over blocks as FIRST / MIDDLE / LAST; each is a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, part, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            out.append(wandb_internal_pb2.Record.FromString(part))
            part = b""
    return out


def wandb_history(workdir: pathlib.Path) -> list[dict]:
    """Every history row ({"_step": N, key: value, ...}) of the offline wandb runs under workdir/wandb."""
    rows = []
    for f in sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def test_wandb_offline_run_holds_every_step_and_a_restart_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True, wandb_project="wr1-test",
                              wandb_mode="offline", config={"train": {"learning_rate": 3e-6}}) as w:
        w.write(1, {"train/loss": 0.5, "rollout/reward": jnp.asarray(-1.5)})
        w.write(2, {"train/loss": 0.25, "rollout/reward": 2})
    with metrics.MetricWriter(tmp_path, tensorboard=False, enabled=True, wandb_project="wr1-test",
                              wandb_mode="offline", resume_from=3) as w:
        w.write(3, {"train/loss": 0.125})
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and runs[0].name == runs[1].name  # one wandb run id for the work directory
    rows = wandb_history(tmp_path)
    assert [(r["_step"], r["train/loss"]) for r in rows] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [r["rollout/reward"] for r in rows[:2]] == [-1.5, 2.0]
    config = [r for r in wandb_records(runs[0]) if r.WhichOneof("record_type") == "run"][0].run.config
    assert any("learning_rate" in item.value_json for item in config.update)


def test_a_wandb_project_without_wandb_installed_is_a_config_error(monkeypatch):
    import importlib.util

    from workflow_r1 import run_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="needs wandb, which is not installed: pip install wandb"):
        run_config.RunConfig(wandb_project="p")
    with pytest.raises(ValueError, match="wandb_mode must be 'online' or 'offline'"):
        run_config.RunConfig(wandb_mode="disabled")


def test_only_process_zero_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    workdir = tmp_path / "run"
    w = metrics.MetricWriter(workdir)
    assert not w.enabled
    w.write(1, {"loss": 1.0})
    with w.progress(10, "rollout") as bar, metrics.progress(10, "eval") as bar2:
        bar.update(5)
        bar2.update(5)
        bar2.set_postfix(em=0.5)
    w.flush()
    w.close()
    assert not workdir.exists()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with metrics.MetricWriter(workdir, tensorboard=False) as w:
        w.write(1, {"loss": 1.0})
    assert read_jsonl(workdir / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


def test_progress_bar(capsys):
    with metrics.progress(4, "rollout", enabled=True) as bar:
        bar.update(3)
        bar.set_postfix(calls=2)
        bar.update(1)
    err = capsys.readouterr().err
    assert "rollout" in err and "3/4" in err and "calls=2" in err  # set_postfix redraws the bar
    with metrics.progress(4, "rollout", enabled=False) as bar:
        bar.update(4)
        bar.set_postfix(calls=2)
    assert capsys.readouterr().err == ""


def test_format_summary():
    m = {"reward": -0.4213, "exact_match": np.float32(0.125), "format": 0.6, "calls": jnp.asarray(2.1),
         "loss": 0.0131, "tokens": 123456.7, "num_responses": 64}
    keys = {"reward": "reward", "em": "exact_match", "format": "format", "calls": "calls", "loss": "loss",
            "tokens": "tokens", "n": "num_responses", "kl": "kl"}
    assert (metrics.format_summary(3, 10, m, keys, seconds=41.23)
            == "step 3/10 | reward -0.421 | em 0.125 | format 0.6 | calls 2.1 | loss 0.0131 | tokens 123457 "
               "| n 64 | 41.2 s")
    assert metrics.format_summary(1, 2, {"loss": float("nan")}, ["loss", "reward"]) == "step 1/2 | loss nan"
    # The trainer's names by default; the step time from its metric.
    trainer = {"rollout/reward": -0.42, "rollout/em": 0.12, "rollout/format_ok": 0.6, "rollout/calls": 2.1,
               "train/loss": 0.013, "time/step_s": 41.23, "rollout/tokens_per_s": 900.0}
    assert (metrics.format_summary(3, 10, trainer)
            == "step 3/10 | reward -0.42 | em 0.12 | format 0.6 | calls 2.1 | loss 0.013 | 41.2 s")
    # Calls per operator follow, by name.
    trainer.update({"rollout/calls/Search": 0.75, "rollout/calls/AnswerGenerate": 0.125})
    assert (metrics.format_summary(3, 10, trainer)
            == "step 3/10 | reward -0.42 | em 0.12 | format 0.6 | calls 2.1 | loss 0.013 "
               "| calls by operator AnswerGenerate 0.125 Search 0.75 | 41.2 s")


class _Device:
    def __init__(self, kind, stats=None):
        self.device_kind, self._stats = kind, stats

    def memory_stats(self):
        return self._stats


def test_peak_flops_by_device_kind():
    assert metrics.peak_flops("TPU v5 lite") == 197e12 and metrics.peak_flops("TPU v5") == 459e12
    assert metrics.peak_flops("TPU v5p") == 459e12 and metrics.peak_flops("TPU v6 lite") == 918e12
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and metrics.peak_flops("TPU v4") == 275e12
    assert metrics.peak_flops("cpu") is None and metrics.peak_flops(jax.devices()[0].device_kind) is None


def test_update_throughput_and_mfu_closed_form():
    devices = [_Device("TPU v5 lite")] * 4
    got = metrics.update_throughput(tokens=8192, seconds=2.0, num_params=10**9, devices=devices)
    assert got["perf/tokens_per_s_per_device"] == pytest.approx(8192 / 2.0 / 4)
    assert got["perf/mfu"] == pytest.approx(6 * 1e9 * 8192 / (2.0 * 4 * 197e12))
    assert "perf/mfu" not in metrics.update_throughput(100, 1.0, 10, jax.devices())  # CPU: no peak, no MFU


def test_device_memory_where_the_backend_reports_it():
    devices = [_Device("x", {"bytes_in_use": 3e9, "peak_bytes_in_use": 5e9}), _Device("x", {"bytes_in_use": 4e9})]
    assert metrics.device_memory(devices) == {"memory/device_gb_in_use": 4.0, "memory/device_gb_peak": 5.0}
    assert metrics.device_memory([_Device("cpu", None)]) == {}


def test_profile_trace_writes_a_trace_tensorboard_reads(tmp_path):
    with metrics.profile_trace(tmp_path / "off", False):
        pass
    assert not (tmp_path / "off").exists()
    with metrics.profile_trace(tmp_path / "profile", True):
        jax.block_until_ready(jax.jit(lambda x: x @ x)(jnp.ones((64, 64))))
    assert list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
