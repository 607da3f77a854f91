"""Evaluate a policy greedily on question files: EM per data set, trajectories, summary and table.

    python -m workflow_r1.evaluate --config=configs/gsspo.py:local --checkpoint=runs/local/hf \\
        --data=data/nq_test.jsonl,data/hotpotqa_test.parquet
    python -m workflow_r1.evaluate --config=configs/gsspo.py:paper --checkpoint=runs/paper \\
        --config.executor.url=http://executor:8000 --data=... --out=runs/paper/eval-test
    python -m workflow_r1.evaluate --method=cot --checkpoint=/models/Qwen2.5-32B-Instruct --data=...

The rollout, environment and executor come from the same config files as training (`--config`,
with `--config.section.key=value` overrides), so the evaluation runs exactly the trainer's
rollouts at temperature 0. `--checkpoint`: a run directory (its newest orbax step), an HF directory
(a run's hf/ export or a released model), or "" for the config's model. `--data`: comma-separated
Search-R1 / FlashRAG files (.jsonl, .parquet with `question`, `golden_answers`), "" = the config's
evaluation set. `--method`: workflow (the policy with operators), direct or cot (one answer without
operators, workflow_r1/eval/baselines.py).

Writes to `--out` (default <checkpoint>/eval-<method>, or runs/eval-<method>): episodes.jsonl (every
trajectory), summary.json (metrics per data source) and results.md (the table), and prints the
table. Multi-host: every host evaluates its slice of the questions; host 0 writes the merged result.
Each host streams its finished episodes to `<out>/stream.host<i>.jsonl` (`eval/stream.py`; for a URI
`--out` such as gs://..., a local directory named after it): the same command run again after an
interruption rolls out only the questions not yet there.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile
from typing import Any

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", default="configs/gsspo.py:local",
                                          help_string="config file and preset, e.g. configs/gsspo.py:local")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "run directory, orbax checkpoints/ directory or HF directory "
                                  "('' = the config's model section)")
_DATA = flags.DEFINE_string("data", "", "comma-separated .jsonl/.parquet question files ('' = the config's "
                            "evaluation set: data.eval_files, else the held-out training questions)")
_METHOD = flags.DEFINE_enum("method", "workflow", ["workflow", "direct", "cot"],
                            "workflow: the policy with operators; direct / cot: one answer, no operators")
_OUT = flags.DEFINE_string("out", "", "output directory (default <checkpoint>/eval-<method> or runs/eval-<method>)")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "questions rolled out together per host (0 = eval.batch_size)")
_MAX_QUESTIONS = flags.DEFINE_integer("max_questions", 0, "evaluate at most this many questions (0 = all)")


def default_out(checkpoint: str, method: str) -> Any:
    """<checkpoint>/eval-<method> (a URI stays one: `storage.path`), or runs/eval-<method>."""
    from workflow_r1 import storage

    return storage.path(checkpoint or "runs") / f"eval-{method}"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    from workflow_r1 import run_config, sharding  # after flag parsing: `--help` starts no JAX

    sharding.maybe_initialize_distributed()  # multi-host start-up, before JAX touches a backend
    out_dir = _OUT.value or default_out(_CHECKPOINT.value, _METHOD.value)
    try:
        run = run_config.Run.from_config(_CONFIG.value)
        result, meta = evaluate_run(run, checkpoint=_CHECKPOINT.value, data=_DATA.value, method=_METHOD.value,
                                    batch_size=_BATCH_SIZE.value, max_questions=_MAX_QUESTIONS.value,
                                    stream_dir=out_dir)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # bad data file, checkpoint, executor URL...
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    import jax

    from workflow_r1.eval import report

    if jax.process_index() == 0:
        out = report.write_report(out_dir, result, meta)
        print(report.markdown_table(result.metrics), flush=True)
        print(f"{len(result.episodes)} questions in {result.seconds:.0f} s"
              + (f" ({meta['resumed']} restored from an interrupted run)" if meta.get("resumed") else "")
              + f"; episodes, summary.json and results.md in {out}", flush=True)
    _finish_stream(out_dir)


def _stream_path(out_dir: str | os.PathLike) -> pathlib.Path:
    """This host's episode stream: in `out_dir` when it is local; for a URI `out_dir` (an object
    store cannot append) in a local directory named after it, so a rerun on this machine resumes."""
    import jax

    from workflow_r1 import storage

    if storage.is_remote(out_dir):
        key = hashlib.sha1(os.fspath(out_dir).encode()).hexdigest()[:16]
        base = pathlib.Path(tempfile.gettempdir()) / "workflow_r1-eval-streams" / key
    else:
        base = pathlib.Path(out_dir)
    return base / f"stream.host{jax.process_index()}.jsonl"


def _finish_stream(out_dir: str | pathlib.Path) -> None:
    """Deletes this host's episode stream once the report holds its episodes (host 0 wrote it after
    the merge, which every host waited for)."""
    _stream_path(out_dir).unlink(missing_ok=True)


def evaluate_run(run: Any, *, checkpoint: str = "", data: str = "", method: str = "workflow", batch_size: int = 0,
                 max_questions: int = 0, stream_dir: str | pathlib.Path | None = None) -> tuple[Any, dict[str, Any]]:
    """(EvalResult, meta) of `method` on `data` with the policy of `checkpoint` under `run` (a
    `run_config.Run`: its model, rollout, env, executor, data and eval sections).

    stream_dir: where each host streams its finished episodes (`eval.stream`), and from which an
    interrupted evaluation of the same method, checkpoint, data and config resumes; None: in memory
    only. meta["resumed"]: questions restored from the stream (this host's).
    """
    import jax

    from workflow_r1 import sharding
    from workflow_r1.data.config import load_data
    from workflow_r1.data.config import load_questions
    from workflow_r1.eval import baselines, evaluate, greedy, policy_source, stream
    from workflow_r1.executor.connect import connect
    from workflow_r1.metrics import progress
    from workflow_r1.rollout import RolloutEngine
    from workflow_r1.sampler import Sampler

    questions = load_questions(data) if data else load_data(run.data, run.run.seed)[1]
    limit = max_questions or run.eval.max_questions
    questions = questions[:limit] if limit else questions
    if not questions:
        raise ValueError("no evaluation questions; pass --data=FILE.jsonl,... or set data.eval_files")
    t = run.train  # the training mesh's axes: evaluation places the weights as the trainer did
    mesh = sharding.make_mesh(t.mesh_data, t.mesh_fsdp, t.mesh_tensor) if jax.device_count() > 1 else None
    model, tokenizer, what = policy_source.load(checkpoint, run.model, mesh=mesh)
    # As in training: on several hosts each samples its own slice on its own devices.
    sampler = Sampler(model, tokenizer, cache_size=run.rollout.cache_size,
                      mesh=sharding.rollout_mesh(mesh, run.train.mesh_tensor), dtype=run.rollout.sampler_dtype or None)
    executor = connect(run.executor) if method == "workflow" else None
    episodes = None
    try:
        engine = (RolloutEngine(sampler, tokenizer, executor.client.execute_many_sync, run.rollout, run.env)
                  if executor is not None else baselines.baseline_engine(method, sampler, tokenizer, run.rollout))
        mine = greedy.host_slice(len(questions), jax.process_index(), jax.process_count())
        batch_size = batch_size or run.eval.batch_size
        fingerprint = {"method": method, "checkpoint": checkpoint, "policy": what, "data": data,
                       "batch_size": batch_size, "hosts": jax.process_count(),
                       "config": run.raw.to_dict() if run.raw is not None else None}
        episodes = (stream.EpisodeStream(_stream_path(stream_dir), fingerprint, questions[mine])
                    if stream_dir is not None else None)
        done = episodes.done if episodes is not None else []
        with progress(mine.stop - mine.start, f"eval {method}") as bar:
            bar.update(len(done))
            result = evaluate(engine, questions, batch_size=batch_size, done=done,
                              on_batch=episodes.append if episodes is not None else None,
                              progress=lambda n, em: (bar.update(n - bar.n), bar.set_postfix(em=f"{em:.3f}")))
    finally:
        if executor is not None:
            executor.close()
        if episodes is not None:
            episodes.close()
    meta = {"method": method, "checkpoint": checkpoint, "policy": what, "data": data or "config evaluation set",
            "executor": (run.executor.url or f"embedded {run.executor.llm}") if executor is not None else None,
            "config": run.raw.to_dict() if run.raw is not None else None, "resumed": len(done)}
    return result, meta


if __name__ == "__main__":
    from workflow_r1 import configlib

    app.run(main, flags_parser=configlib.parse_flags)
