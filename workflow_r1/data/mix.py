"""The paper's training mix: 10,000 questions sampled from Search-R1's NQ + HotpotQA train set.

    python -m workflow_r1.data.mix --train_parquet=Search-R1/data/nq_hotpotqa_train/train.parquet \
        --out=data/train_mix.jsonl

Search-R1's `train.parquet` merges the NQ and HotpotQA train splits (rows with data_source "nq" and
"hotpotqa"). The authors drew their training set with pandas,
`pd.read_parquet(train.parquet).sample(n=10000, random_state=42)`, which gave NQ 4,618 + HotpotQA
5,382 (docs/paper.md, Data). We draw the same rows, in the same order, without pandas:
`DataFrame.sample(n, random_state=seed)` without weights or replacement is
`np.random.RandomState(seed).choice(len(df), size=n, replace=False)` (pandas.core.sample.sample),
whose legacy stream NumPy keeps fixed (NEP 19); `df.take` of those positions keeps their order.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import app, flags

from workflow_r1.data.questions import (DataError, Question, cli_main, read_questions, source_counts,
                                        write_questions)

PAPER_MIX_SIZE = 10_000
PAPER_MIX_SEED = 42


def pandas_sample_positions(num_rows: int, n: int, seed: int) -> np.ndarray:
    """Row positions `pandas.DataFrame.sample(n=n, random_state=seed)` picks from `num_rows` rows.

    Returns: int64 [n], in the order pandas returns the rows (not sorted).
    """
    if not 0 <= n <= num_rows:
        raise DataError(f"cannot sample {n} rows from {num_rows}; lower n to at most {num_rows}")
    return np.random.RandomState(seed).choice(num_rows, size=n, replace=False).astype(np.int64)


def sample_questions(questions: Sequence[Question], n: int = PAPER_MIX_SIZE,
                     seed: int = PAPER_MIX_SEED) -> list[Question]:
    """The n questions pandas' `df.sample(n=n, random_state=seed)` picks, in its order."""
    return [questions[i] for i in pandas_sample_positions(len(questions), n, seed)]


def build_training_mix(train_parquet: str | os.PathLike, out_path: str | os.PathLike,
                       n: int = PAPER_MIX_SIZE, seed: int = PAPER_MIX_SEED) -> dict[str, int]:
    """Samples the training mix from Search-R1's train.parquet and writes it to `out_path`.

    Every row of the file is a candidate, as in the authors' `df.sample` (the file holds only NQ and
    HotpotQA rows). `out_path` is .jsonl or .parquet of Search-R1 rows, ids and data_source as read.

    Returns: data_source -> number of sampled questions (the paper's: {"hotpotqa": 5382, "nq": 4618}).
    """
    mix = sample_questions(read_questions(train_parquet), n, seed)
    write_questions(mix, out_path)
    return source_counts(mix)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The CLI's flags; defined only when run as a program, so importing this module defines none."""
    flags.DEFINE_string("train_parquet", None, "Search-R1's nq_hotpotqa_train/train.parquet.")
    flags.DEFINE_string("out", None, "Where to write the mix (.jsonl or .parquet).")
    flags.DEFINE_integer("n", PAPER_MIX_SIZE, "Number of questions to sample.")
    flags.DEFINE_integer("seed", PAPER_MIX_SEED, "pandas random_state of the sample.")
    flags.mark_flags_as_required(["train_parquet", "out"])


def _run() -> str:
    counts = build_training_mix(FLAGS.train_parquet, FLAGS.out, FLAGS.n, FLAGS.seed)
    return (f"wrote {sum(counts.values())} questions to {Path(FLAGS.out)}: "
            + ", ".join(f"{k} {v}" for k, v in counts.items()))


main = cli_main(_run)


if __name__ == "__main__":
    define_flags()
    app.run(main)
