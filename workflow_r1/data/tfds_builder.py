"""Question files as a TFDS dataset in array_record format, built without TensorFlow (read back by
tfds_source.py).

    python -m workflow_r1.data.tfds_builder --files=train_mix.jsonl --data_dir=/data/tfds

writes DATA_DIR/workflow_r1_questions/1.0.0/workflow_r1_questions-train.array_record-*, one record
per question (features: id, question, golden_answers (a sequence of str), data_source), in file
order. Read it back with random access, which is what grain consumes:

    tfds.data_source("workflow_r1_questions", data_dir=DATA_DIR, download=False)["train"][i]
    read_questions_tfds(DATA_DIR)            # the same, as a Sequence[Question]
    load_questions("tfds:DATA_DIR")          # the trainer's data.train_files form

tensorflow-datasets 4.9.10 builds and reads array_record with no TensorFlow installed: features
are encoded with its NumPy code path and records written with the array_record package (checked by
tests/test_data.py, which also asserts TensorFlow is never imported).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from absl import app, flags

from workflow_r1.data.config import load_questions
from workflow_r1.data.questions import DataError, Question, cli_main
from workflow_r1.data.tfds_source import NAME, SPLIT, TfdsQuestions, read_questions_tfds  # noqa: F401


class _LocalInfo(tfds.core.DatasetInfo):
    """The dataset's info; it is never on TFDS's public bucket, so a builder without prepared data
    does not look there (TFDS would probe gs://tfds-data over the network, waiting out its timeouts
    offline, and leave a temporary directory behind on every construction)."""

    def initialize_from_bucket(self) -> None:
        return None


class WorkflowR1Questions(tfds.core.GeneratorBasedBuilder):
    """Questions from Search-R1 / FlashRAG files (`files`: a load_questions spec) as one split."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "id, question, golden_answers, data_source."}

    def __init__(self, *, files: str = "", **kwargs: Any):
        self._files = files
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalInfo(
            builder=self,
            description="Workflow-R1 questions in the Search-R1 row format.",
            features=tfds.features.FeaturesDict({
                "id": tfds.features.Text(),
                "question": tfds.features.Text(),
                "golden_answers": tfds.features.Sequence(tfds.features.Text()),
                "data_source": tfds.features.Text(),
            }),
            # Records keep file order (TFDS would otherwise order them by a hash of the key).
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
        if not self._files:
            raise DataError(f"{NAME}: no prepared data in {self.data_dir} and no files to build it "
                            "from; run python -m workflow_r1.data.tfds_builder --files=... --data_dir=...")
        return {SPLIT: self._generate_examples(load_questions(self._files))}

    def _generate_examples(self, questions: list[Question]) -> Iterator[tuple[int, dict[str, Any]]]:
        for i, q in enumerate(questions):
            yield i, q.to_row()


def build(files: str, data_dir: str | os.PathLike) -> Path:
    """Writes the questions of `files` (a load_questions spec) under `data_dir`; returns the
    version directory. An existing build of the same version is kept (TFDS never overwrites)."""
    builder = WorkflowR1Questions(files=files, data_dir=os.fspath(data_dir), file_format="array_record")
    with tempfile.TemporaryDirectory() as downloads:  # nothing is downloaded; keep data_dir clean
        builder.download_and_prepare(download_dir=downloads)
    return Path(builder.data_dir)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The CLI's flags; defined only when run as a program, so importing this module defines none."""
    flags.DEFINE_string("files", None, "Comma-separated .jsonl/.parquet question files, or 'bundled'.")
    flags.DEFINE_string("data_dir", None, "TFDS data directory to write under.")
    flags.mark_flags_as_required(["files", "data_dir"])


def _run() -> str:
    out = build(FLAGS.files, FLAGS.data_dir)
    n = len(read_questions_tfds(FLAGS.data_dir))
    return f"wrote {n} questions to {out} (read with load_questions('tfds:{FLAGS.data_dir}'))"


main = cli_main(_run)


if __name__ == "__main__":
    define_flags()
    app.run(main)
