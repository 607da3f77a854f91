"""Train a Workflow-R1 policy with GSsPO (or GRPO / GSPO): the main job.

    python -m workflow_r1.train --config=configs/gsspo.py:local
    python -m workflow_r1.train --config=configs/gsspo.py:paper --config.model.checkpoint=/models/Qwen2.5-7B-Instruct \\
        --config.executor.url=http://executor:8000 --workdir=runs/paper-gsspo
    python -m workflow_r1.train --config=configs/grpo.py:tiny --config.steps=3 --workdir=/tmp/tiny

`--config=FILE.py:PRESET` picks the loss (gsspo.py, grpo.py, gspo.py) and the preset (paper, local,
tiny); any field can be overridden as `--config.section.key=value` (a wrong key is one line with a
suggestion). A work directory that holds a checkpoint is resumed: the next step draws the same
questions and gives the same loss as an uninterrupted run. SIGTERM (a preemption notice) stops the run at
its next safe point with its progress saved, one line and exit status 0; the same command resumes it
(workflow_r1/preemption.py, docs/replicate.md). The run writes to its work directory:
config.json, metrics.jsonl, tensorboard/, checkpoints/, trajectories/, eval/, hf/ (the final policy as
a Hugging Face checkpoint) and summary.json.
"""
from __future__ import annotations

import errno
import json
import os
import pathlib
import sys
import time
import traceback

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", default="configs/gsspo.py:local",
                                          help_string="config file and preset, e.g. configs/gsspo.py:local")
_WORKDIR = flags.DEFINE_string("workdir", None, "work directory, a local path or a URI such as gs://bucket/run "
                               "(default: config.workdir, else runs/<config>-<preset>)")


def default_workdir(spec: str) -> pathlib.Path:
    """runs/<file stem>-<preset> for `--config=configs/<stem>.py:<preset>`."""
    path, _, preset = spec.partition(":")
    return pathlib.Path("runs") / (pathlib.Path(path).stem + (f"-{preset}" if preset else ""))


# A write that failed for lack of room or rights (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, EPERM, EIO): the
# run ends in one line; any other OSError (a bug, a lost executor connection) keeps its traceback.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:  # "No space left on device: /w/metrics.jsonl"
        return f"cannot write {exc.filename or 'the work directory'}: {exc.strerror}" if exc.errno in WRITE_ERRNOS \
            else f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def abandon(trainer) -> None:
    """Closes a trainer whose run failed, so orbax's writer threads end before the interpreter does
    (their errors were already reported: they are not raised again)."""
    try:
        trainer.close()
    except Exception:  # noqa: BLE001  the failure being reported is the one that counts
        pass


def _drop_closed_loop_callbacks(default=sys.unraisablehook):
    """sys.unraisablehook for the CLI: when an asynchronous checkpoint save fails, orbax closes its event
    loop while tensorstore still has writes in flight, and each of their completion callbacks reports
    "Event loop is closed" as unraisable. The save's failure itself is reported (one line): these are
    dropped; every other unraisable exception goes to the default hook."""
    def hook(arg):
        frames = traceback.extract_tb(arg.exc_traceback) if arg.exc_traceback else []
        if not (isinstance(arg.exc_value, RuntimeError) and str(arg.exc_value) == "Event loop is closed"
                and frames and frames[-1].name == "_check_closed"):
            default(arg)
    return hook


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; options are --config=... and --config.key=value")
    # After flag parsing: `--help` starts no JAX.
    import jax

    from workflow_r1 import checkpointing, host_memory, run_config, sharding, storage, trainer as trainer_lib
    from workflow_r1.eval import report

    sys.unraisablehook = _drop_closed_loop_callbacks()
    absl_logging.set_verbosity(absl_logging.WARNING)  # JAX's backend probing is not news to a user
    sharding.maybe_initialize_distributed()  # multi-host start-up, before JAX touches a backend
    cfg = _CONFIG.value
    try:
        run = run_config.Run.from_config(cfg)
    except ValueError as exc:  # ConfigError and the dataclasses' own checks: one line, before any work
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # A local directory or a URI (gs://bucket/run): never turned into a local path (storage.py).
    workdir = storage.path(_WORKDIR.value or run.run.workdir or default_workdir(config_flags.get_config_filename(
        flags.FLAGS["config"])))
    # Before the model loads (minutes for the 7B): a run without an evaluation set says so at once.
    warning = run.data.no_evaluation_warning() if run.env.kind == "workflow" else None  # only it reads `data`
    if warning and jax.process_index() == 0:
        print(warning, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        # A URI's file system first (gs:// needs gcsfs, requirements-cloud.txt): one line, not orbax's traceback.
        with storage.reading(workdir, "work directory"):
            workdir.exists()
        trainer = trainer_lib.Trainer(run, workdir)
    except (ValueError, OSError, RuntimeError) as exc:  # bad data file, checkpoint, workdir, executor URL...
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    if trainer.primary:  # one log for the job: host 0's (every host runs the same loop)
        print(f"workflow_r1.train: {run.rows} episodes per step ({run.rollout.prompts_per_step} questions x "
              f"{run.rollout.n}), {trainer.total_steps} steps, loss {run.train.granularity}, executor "
              f"{trainer.setup.executor_name()}, "
              f"workdir {workdir}"
              + (f", resuming at step {trainer.step + 1}" if trainer.step else ""), flush=True)
    try:
        last = trainer.train()
        if trainer.preempted:
            trainer.close()  # the preemption save is on disk once this returns
            if trainer.primary:
                print(trainer.preempted, flush=True)
            return
        hf_dir = trainer.finish()
    except (checkpointing.CheckpointError, OSError) as exc:  # e.g. the disk filled during the run
        if isinstance(exc, OSError) and exc.errno not in WRITE_ERRNOS:
            raise
        abandon(trainer)
        print(f"error: {_one_line(exc)}; the checkpoints already on disk are intact and the run resumes from the "
              "newest", file=sys.stderr, flush=True)
        # tensorstore's writer threads still hold callbacks into orbax's closed event loop: a normal
        # interpreter exit would print their tracebacks after this line. Everything of ours is closed.
        sys.stdout.flush()
        os._exit(1)
    summary = {"steps": trainer.total_steps, "workdir": str(workdir), "seconds": time.perf_counter() - t0,
               "peak_rss_gb": host_memory.peak_rss_gb(),
               "hf_checkpoint": str(hf_dir) if hf_dir else None,
               **{k: v for k, v in last.items() if k.startswith(("eval/", "rollout/reward", "rollout/em",
                                                                 "rollout/format_ok", "rollout/calls",
                                                                 "time/executor_s"))},
               **{f"before/{k}": v for k, v in trainer.eval_at_start.items() if k.startswith("eval/")}}
    if trainer.primary:
        storage.write_text(workdir / "summary.json", json.dumps(summary, indent=2))
        print(f"done: {trainer.total_steps} steps in {summary['seconds']:.0f} s, peak memory "
              f"{summary['peak_rss_gb']:.1f} GB; metrics {workdir / 'metrics.jsonl'}, "
              f"TensorBoard {workdir / 'tensorboard'}, checkpoints {workdir / 'checkpoints'}"
              + (f", HF policy {hf_dir}" if hf_dir else ""), flush=True)
        if "eval/em" in last:
            print(report.evaluation_line(trainer.eval_at_start, last), flush=True)
        report_run(workdir, trainer.total_steps)


def report_run(workdir, last_step: int) -> None:
    """The run's closing report: curves.png from its metrics and, when it evaluated the same questions
    before its first step and after its last, before_after.md (paired by question), also printed."""
    from workflow_r1 import metrics, storage
    from workflow_r1.eval import compare, curves

    curves.plot(curves.read_metrics(workdir / "metrics.jsonl"), workdir / "curves.png", title=str(workdir))
    evals = workdir / "eval"
    if last_step and metrics.step_file(evals, 0).exists() and metrics.step_file(evals, last_step).exists():
        rows = compare.paired(metrics.read_step_rows(evals, 0), metrics.read_step_rows(evals, last_step))
        table = compare.markdown(rows, after_step=last_step)
        storage.write_text(workdir / "before_after.md", table)
        print(table, flush=True)
    print(f"curves: {workdir / 'curves.png'}", flush=True)


if __name__ == "__main__":
    from workflow_r1 import configlib

    app.run(main, flags_parser=configlib.parse_flags)
