"""Reading a prepared `workflow_r1_questions` TFDS dataset (array_record) as a Sequence[Question].

Written by `python -m workflow_r1.data.tfds_builder`; read by `load_questions("tfds:DATA_DIR")`
(data/config.py). Reading needs tensorflow_datasets, never TensorFlow itself.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, overload

import tensorflow_datasets as tfds

from workflow_r1.data.questions import DataError, Question

NAME = "workflow_r1_questions"
SPLIT = "train"


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TfdsQuestions(Sequence[Question]):
    """A prepared split as a random-access Sequence[Question], decoded on access (grain-ready)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = SPLIT):
        try:
            self._source = tfds.data_source(NAME, data_dir=os.fspath(data_dir), download=False)[split]
        except Exception as exc:  # TFDS raises several types for a missing or foreign directory
            raise DataError(f"tfds data dir {data_dir}: no {NAME} split {split!r} "
                            f"({type(exc).__name__}); build it with python -m "
                            "workflow_r1.data.tfds_builder --files=... --data_dir=...") from None

    def __len__(self) -> int:
        return len(self._source)

    @overload
    def __getitem__(self, index: int) -> Question: ...
    @overload
    def __getitem__(self, index: slice) -> list[Question]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"question {index} out of range for {n} questions")
        r = self._source[index % n]
        return Question(id=_text(r["id"]), question=_text(r["question"]),
                        golden_answers=tuple(_text(a) for a in r["golden_answers"]),
                        data_source=_text(r["data_source"]))


def read_questions_tfds(data_dir: str | os.PathLike, split: str = SPLIT) -> TfdsQuestions:
    """The questions of a prepared `workflow_r1_questions` dataset under `data_dir`."""
    return TfdsQuestions(data_dir, split)
