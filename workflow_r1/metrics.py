"""What a run reports: per-step metrics to JSON lines and TensorBoard, progress bars, the console line.

- `MetricWriter`: `workdir/metrics.jsonl` (one JSON object per step, keys sorted) and TensorBoard
  scalars under `workdir/tensorboard/` (tensorboardX: event files without TensorFlow). Only
  process 0 writes in a multi-host run. The workdir may be a URI (`storage`): there both files are
  rewritten whole at each flush (object stores cannot append). Optionally the same scalars go to
  Weights & Biases (`wandb_project`; online, or offline under workdir/wandb/).
- `progress`: a tqdm bar on stderr for long phases (rollouts, evaluation).
- `format_summary`: the one console line per step.
- `update_throughput`, `device_memory`, `profile_trace`: tokens/s per device and MFU (from the
  `PEAK_BF16_FLOPS` of the device kind), device memory where the backend reports it, and on-demand
  jax.profiler traces (`profile_steps`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tqdm

from workflow_r1 import storage

Number = float | int | np.number | jax.Array


def _is_primary() -> bool:
    return jax.process_index() == 0


def _scalar(name: str, value: Any) -> int | float | bool:
    """A Python int / float / bool from a number, NumPy scalar or 0-d (or size-1) array."""
    if isinstance(value, (bool, int, float)):
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric {name!r} has shape {list(arr.shape)}; write scalars (reduce it first, e.g. .mean())")
    v = arr.reshape(()).item()
    if not isinstance(v, (bool, int, float)):
        raise TypeError(f"metric {name!r} is a {type(v).__name__}; write numbers")
    return v


def _json_value(v: int | float | bool) -> int | float | bool | str:
    """Non-finite floats as the strings "nan", "inf", "-inf" (JSON has no such numbers; float(s) reads them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


class _EventFile:
    """A TensorBoard event file written synchronously (tensorboardX's record format and protos).

    Not tensorboardX's SummaryWriter: its flush() does not drain the queue of its writer thread, so
    a flushed step may still be missing from disk, and two writers opened in the same second share
    (and truncate) one file name. One record per step holds all of its scalars. A remote `logdir`
    gets a local file that each flush copies there whole (event files are small: one record a step).
    """

    def __init__(self, logdir: storage.Path, purge_step: int | None = None):
        from tensorboardX.event_file_writer import EventsWriter  # only a writer that writes needs it
        from tensorboardX.proto import event_pb2, summary_pb2
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._remote = logdir if storage.is_remote(logdir) else None
        local = pathlib.Path(tempfile.mkdtemp(prefix="workflow_r1-tb-")) if self._remote else pathlib.Path(logdir)
        local.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(local / "events"), f".{os.getpid()}.{time.time_ns()}")
        if purge_step is not None:
            # TensorBoard hides earlier files' events with step >= purge_step (a resumed run).
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.write_event(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.write_event(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()
        if self._remote is not None:
            local = pathlib.Path(self._writer._file_name)
            storage.copy_file(local, self._remote / local.name)

    def close(self) -> None:
        self.flush()
        self._writer.close()
        if self._remote is not None:
            shutil.rmtree(pathlib.Path(self._writer._file_name).parent, ignore_errors=True)


class _WandbRun:
    """One Weights & Biases run per work directory: its id is derived from the workdir, so a run
    restarted there continues the same wandb run. wandb refuses a step lower than one it has: the
    steps a killed run logged past its last checkpoint keep their first values there (metrics.jsonl
    and TensorBoard get the rewritten ones). wandb's files are local: the workdir, or for a URI the
    temporary directory (online mode uploads them; offline mode is meant for a local workdir)."""

    def __init__(self, workdir: storage.Path, project: str, mode: str, config: Mapping[str, Any] | None):
        import wandb  # optional: run_config checks it is installed when wandb_project is set

        local = str(workdir) if not storage.is_remote(workdir) else tempfile.gettempdir()  # wandb writes locally
        os.makedirs(local, exist_ok=True)
        run_id = hashlib.sha1(str(workdir).encode()).hexdigest()[:16]
        self._run = wandb.init(project=project, mode=mode, dir=local, id=run_id, resume="allow",
                               name=workdir.name, config=dict(config or {}),
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        # commit: the row goes to wandb now, not when a later step or finish() flushes it, so a run
        # killed after writing step N keeps N's row
        self._run.log(dict(values), step=step, commit=True)

    def close(self) -> None:
        self._run.finish()


class MetricWriter:
    """Appends per-step scalars to `workdir/metrics.jsonl` and TensorBoard (`workdir/tensorboard/`).

    enabled: None -> only process 0 writes (jax.process_index() == 0); False writes nothing and
      creates no file; True always writes.
    tensorboard: also write TensorBoard event files.
    resume_from: the first step this run will write, when it continues an earlier run in the same
      workdir: lines with step >= resume_from are dropped from metrics.jsonl first (so the file keeps
      one line per step) and TensorBoard is told to discard the old events from that step on.
      None: append to what is there.
    wandb_project, wandb_mode, config: also log to this Weights & Biases project ("" = off), with the
      run's config (`RunConfig.wandb_project`).
    """

    def __init__(self, workdir: storage.PathLike, *, tensorboard: bool = True, enabled: bool | None = None,
                 resume_from: int | None = None, wandb_project: str = "", wandb_mode: str = "online",
                 config: Mapping[str, Any] | None = None):
        self.workdir = storage.path(workdir)
        self.enabled = _is_primary() if enabled is None else enabled
        self.path = self.workdir / "metrics.jsonl"
        self._file = None
        self._lines: list[str] | None = None  # a remote metrics.jsonl: the whole file, rewritten at flush
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        kept = None
        if resume_from is not None and self.path.exists():
            kept = self._drop_from(resume_from)
        if storage.is_remote(self.workdir):
            self._lines = kept if kept is not None else (
                self.path.read_text(encoding="utf-8").splitlines(keepends=True) if self.path.exists() else [])
        else:
            self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            self._tb = _EventFile(self.workdir / "tensorboard", purge_step=resume_from)
        if wandb_project:
            self._wandb = _WandbRun(self.workdir, wandb_project, wandb_mode, config)

    def _drop_from(self, step: int) -> list[str]:
        """Rewrites metrics.jsonl without the lines of steps >= `step` (and without a torn last line);
        returns the lines kept."""
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run may be cut short
                continue
            if record.get("step", -1) < step:
                kept.append(line + "\n")
        storage.write_text(self.path, "".join(kept))
        return kept

    def write(self, step: int, metrics: Mapping[str, Number]) -> None:
        """Writes one step's scalars: one JSON line {"step": step, key: value, ...} and one TensorBoard
        scalar per key. Values: Python / NumPy numbers or single-element arrays (fetched to host)."""
        if not self.enabled:
            return
        if "step" in metrics:
            raise ValueError("metric name 'step' is reserved for the step number; rename that metric")
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        record = {"step": int(step), **{k: _json_value(v) for k, v in values.items()}}
        line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
        if self._lines is not None:
            self._lines.append(line)
        else:
            self._file.write(line)
        if self._tb is not None:
            self._tb.scalars(int(step), {k: float(v) for k, v in sorted(values.items())})
        if self._wandb is not None:
            self._wandb.log(int(step), {k: float(v) for k, v in sorted(values.items())})

    def progress(self, total: int | None, desc: str) -> tqdm.tqdm:
        """A progress bar that shows only where this writer writes (see `progress`)."""
        return progress(total, desc, enabled=self.enabled)

    def flush(self) -> None:
        """Pushes everything written so far to disk (to the remote work directory)."""
        if self._file is not None:
            self._file.flush()
        if self._lines is not None:
            storage.write_text(self.path, "".join(self._lines))
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._lines is not None:
            self.flush()
            self._lines = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# What a pod user reads: throughput per device, MFU, device memory, profiler traces
# --------------------------------------------------------------------------------------------------

# Peak dense bf16 FLOP/s of one device, by a lower-case substring of jax's `device_kind` (the first
# that matches; vendors' data sheets). A kind not listed (CPU) has no MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("tpu v6 lite", 918e12), ("tpu v6e", 918e12), ("tpu7x", 2307e12),
    ("tpu v5 lite", 197e12), ("tpu v5e", 197e12), ("tpu v5p", 459e12), ("tpu v5", 459e12),
    ("tpu v4", 275e12), ("tpu v3", 123e12),
    ("h200", 989e12), ("h100", 989e12), ("a100", 312e12), ("l4", 121e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of `device_kind` (e.g. "TPU v5 lite"), None when unknown (CPU)."""
    kind = device_kind.lower()
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in kind), None)


def update_throughput(tokens: int, seconds: float, num_params: int, devices: Sequence[Any]) -> dict[str, float]:
    """perf/tokens_per_s_per_device of an update over `tokens` (all hosts' rows x padded length) in
    `seconds`, and perf/mfu: 6 x params x tokens (a forward and a backward pass, attention left out)
    over seconds x devices x the devices' peak, only when the device kind's peak is known."""
    n = max(len(devices), 1)
    out = {"perf/tokens_per_s_per_device": tokens / max(seconds, 1e-9) / n}
    peak = peak_flops(devices[0].device_kind) if devices else None
    if peak:
        out["perf/mfu"] = 6.0 * num_params * tokens / (max(seconds, 1e-9) * n * peak)
    return out


def device_memory(devices: Sequence[Any]) -> dict[str, float]:
    """memory/device_gb_in_use and memory/device_gb_peak: the largest over `devices` of what the
    backend reports (`device.memory_stats()`, bytes_in_use and peak_bytes_in_use); {} where it
    reports nothing (CPU)."""
    stats = [s for s in (d.memory_stats() for d in devices) if s]
    out = {}
    for key, name in (("bytes_in_use", "memory/device_gb_in_use"), ("peak_bytes_in_use", "memory/device_gb_peak")):
        values = [s[key] for s in stats if key in s]
        if values:
            out[name] = max(values) / 1e9
    return out


class profile_trace:  # noqa: N801  (used as a context manager, like jax.profiler.trace)
    """`with profile_trace(logdir, on):` records a jax.profiler trace of the block into `logdir` when
    `on` (TensorBoard's profile plugin and Perfetto read it: logdir/plugins/profile/<run>/*.xplane.pb).
    A remote `logdir` gets the trace when the block ends (written locally first: `storage.staged`)."""

    def __init__(self, logdir: storage.PathLike, on: bool):
        self.logdir, self.on = logdir, on
        self._stage: Any = None

    def __enter__(self) -> "profile_trace":
        if self.on:
            self._stage = storage.staged(self.logdir)
            jax.profiler.start_trace(str(self._stage.__enter__()))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self._stage.__exit__(*exc)


def step_file(directory: storage.PathLike, step: int) -> storage.Path:
    """`directory/step_N.jsonl`, where a step's trajectories or evaluation episodes are kept."""
    return storage.path(directory) / f"step_{step:06d}.jsonl"


def write_step_rows(directory: storage.PathLike, step: int, rows: list[dict]) -> None:
    """Writes `rows` (JSON-serializable dicts) as `step_file(directory, step)`, one per line;
    `directory` may be a URI."""
    storage.write_text(step_file(directory, step), "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_step_rows(directory: storage.PathLike, step: int) -> list[dict]:
    """The rows `write_step_rows` wrote for `step`."""
    return [json.loads(line) for line in step_file(directory, step).read_text().splitlines() if line.strip()]


def drop_step_files(directory: storage.PathLike, first_step: int) -> list[str]:
    """Deletes `directory/step_N.jsonl` for every N >= `first_step` (a resumed run rewrites them from
    its restored step on, so what a killed run wrote past its last checkpoint never lingers); returns
    the names deleted. A missing directory has nothing to delete. `directory` may be a URI."""
    directory, gone = storage.path(directory), []
    if not directory.is_dir():
        return gone
    for path in sorted(directory.glob("step_*.jsonl")):
        number = path.name[len("step_"):-len(".jsonl")]
        if number.isdigit() and int(number) >= first_step:
            path.unlink()
            gone.append(path.name)
    return gone


def progress(total: int | None, desc: str, *, enabled: bool | None = None) -> tqdm.tqdm:
    """A tqdm progress bar on stderr: `with progress(n, "rollout") as bar: bar.update(k); bar.set_postfix(...)`.

    enabled: None -> shown on process 0 only; False -> silent (same methods, no output).
    """
    enabled = _is_primary() if enabled is None else enabled
    return tqdm.tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)


def _fmt_number(v: Any) -> str:
    v = _scalar("summary", v)
    if isinstance(v, bool) or isinstance(v, int):
        return str(int(v))
    if math.isfinite(v) and abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:.3g}"


# The trainer's metric names shown on its console line (label -> metric name).
SUMMARY_KEYS: Mapping[str, str] = {"reward": "rollout/reward", "em": "rollout/em", "format": "rollout/format_ok",
                                   "calls": "rollout/calls", "loss": "train/loss", "eval em": "eval/em"}
STEP_SECONDS_KEY = "time/step_s"
CALLS_PREFIX = "rollout/calls/"  # per-operator calls per episode, shown after the keys


def format_summary(step: int, total_steps: int, metrics: Mapping[str, Number],
                   keys: Sequence[str] | Mapping[str, str] = SUMMARY_KEYS, *, seconds: float | None = None) -> str:
    """The console line of one step, e.g. "step 3/10 | reward -0.42 | em 0.12 | loss 0.013 | 41.2 s".

    keys: the metric names to show, in order; or a mapping label -> metric name ({"em": "rollout/em"}).
    Names missing from `metrics` are left out. Numbers: 3 significant digits (whole numbers for ints
    and for |x| >= 1000). seconds: the step's wall time, appended as "41.2 s" (default:
    metrics["time/step_s"] when present).
    """
    labels = keys.items() if isinstance(keys, Mapping) else ((k, k) for k in keys)
    parts = [f"step {step}/{total_steps}"]
    parts += [f"{label} {_fmt_number(metrics[name])}" for label, name in labels if name in metrics]
    per_operator = sorted((k[len(CALLS_PREFIX):], v) for k, v in metrics.items() if k.startswith(CALLS_PREFIX))
    if per_operator:  # which operators the calls went to: what a workflow policy learns to choose
        parts.append("calls by operator " + " ".join(f"{op} {_fmt_number(v)}" for op, v in per_operator))
    if seconds is None and STEP_SECONDS_KEY in metrics:
        seconds = _scalar(STEP_SECONDS_KEY, metrics[STEP_SECONDS_KEY])
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return " | ".join(parts)


__all__ = ["MetricWriter", "PEAK_BF16_FLOPS", "device_memory", "drop_step_files", "peak_flops", "profile_trace",
           "progress", "read_step_rows", "step_file", "update_throughput", "write_step_rows", "format_summary",
           "SUMMARY_KEYS"]
