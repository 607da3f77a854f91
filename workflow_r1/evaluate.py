"""Evaluate a policy greedily on question files: EM per data set, trajectories, summary and table.

    python -m workflow_r1.evaluate --config=configs/gsspo.py:local --checkpoint=runs/local/hf \\
        --data=data/nq_test.jsonl,data/hotpotqa_test.parquet
    python -m workflow_r1.evaluate --config=configs/gsspo.py:paper --checkpoint=gs://bucket/runs/paper \\
        --config.executor.url=http://executor:8000 --data=gs://bucket/data/nq.jsonl,...
    python -m workflow_r1.evaluate --method=cot --checkpoint=/models/Qwen2.5-32B-Instruct --data=...

The rollout, environment and executor come from the same config files as training (`--config`,
with `--config.section.key=value` overrides), so the evaluation runs exactly the trainer's
rollouts at temperature 0; the `eval` section sizes it (`--config.eval.batch_size`: questions
rolled out together per host; `--config.eval.max_questions`: at most this many, 0 = all).
`--checkpoint`: a run directory (its newest orbax step), an HF directory (a run's hf/ export or a
released model), or "" for the config's model. `--data`: comma-separated Search-R1 / FlashRAG
files (.jsonl, .parquet with `question`, `golden_answers`), "" = the config's evaluation set. Both
may be local paths or URIs (gs://bucket/run: what a run with that work directory wrote;
workflow_r1/storage.py); a missing or unreadable one is one line naming it.
`--method`: workflow (the policy with operators), direct or cot (one answer without operators,
workflow_r1/eval/baselines.py).

Writes to `--out` (default <checkpoint>/eval-<method>, or runs/eval-<method>): episodes.jsonl (every
trajectory), summary.json (metrics per data source) and results.md (the table), and prints the
table. Multi-host: every host evaluates its slice of the questions; host 0 writes the merged result.
Each host streams its finished episodes to `<out>/stream.host<i>.jsonl` (`eval/stream.py`; for a URI
`--out` such as gs://..., a local directory named after it): the same command run again after an
interruption rolls out only the questions not yet there.
"""
from __future__ import annotations

import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from workflow_r1 import configlib

_CONFIG = config_flags.DEFINE_config_file("config", default="configs/gsspo.py:local",
                                          help_string="config file and preset, e.g. configs/gsspo.py:local")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "run directory, orbax checkpoints/ directory or HF directory, "
                                  "local or gs://... ('' = the config's model section)")
_DATA = flags.DEFINE_string("data", "", "comma-separated .jsonl/.parquet question files ('' = the config's "
                            "evaluation set: data.eval_files, else the held-out training questions)")
_METHOD = flags.DEFINE_enum("method", "workflow", ["workflow", "direct", "cot"],
                            "workflow: the policy with operators; direct / cot: one answer, no operators")
_OUT = flags.DEFINE_string("out", "", "output directory (default <checkpoint>/eval-<method> or runs/eval-<method>)")
# Flags that config keys replaced: each is refused in one line naming the key.
RETIRED = {"batch_size": lambda value: f"--config.eval.batch_size={value or 'N'}",
           "max_questions": lambda value: f"--config.eval.max_questions={value or 'N'}"}


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    from workflow_r1 import run_config, sharding  # after flag parsing: `--help` starts no JAX
    from workflow_r1.eval import job, stream

    sharding.maybe_initialize_distributed()  # multi-host start-up, before JAX touches a backend
    out_dir = _OUT.value or job.default_out(_CHECKPOINT.value, _METHOD.value)
    try:
        run = run_config.Run.from_config(_CONFIG.value)
        result, meta = job.evaluate_run(run, checkpoint=_CHECKPOINT.value, data=_DATA.value,
                                        method=_METHOD.value, stream_dir=out_dir)
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
    stream.remove(out_dir)


if __name__ == "__main__":
    app.run(main, flags_parser=configlib.parser(RETIRED))
