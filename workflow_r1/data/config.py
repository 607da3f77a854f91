"""The trainer's `data` config section: which question files (`load_questions`) and the deterministic
train / eval split it describes."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from workflow_r1 import bounds
from workflow_r1.data.questions import DataError, Question, bundled_questions, read_questions


def load_questions(spec: str) -> list[Question]:
    """The questions named by a config string, in order.

    `spec` is "" or "bundled" (the bundled set), or a comma-separated list whose entries are
    "bundled", a `.jsonl` / `.parquet` file, or `tfds:DATA_DIR` (the train split written by
    `python -m workflow_r1.data.tfds_builder`).
    """
    entries = [e.strip() for e in spec.split(",") if e.strip()] or ["bundled"]
    out: list[Question] = []
    for entry in entries:
        if entry == "bundled":
            out += bundled_questions()
        elif entry.startswith("tfds:"):
            from workflow_r1.data import tfds_source  # tensorflow_datasets only when asked for

            out += list(tfds_source.read_questions_tfds(entry[len("tfds:"):]))
        else:
            out += read_questions(entry)
    return out


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which questions the trainer trains and evaluates on.

    Attributes:
      train_files: a load_questions spec: "" (the bundled questions), or comma-separated .jsonl /
        .parquet files or tfds:DATA_DIR.
      eval_files: the same for evaluation; "" holds out `eval_holdout` questions of the train set.
      eval_holdout: questions held back from the train set for evaluation when eval_files is "";
        0 means no evaluation set.
      shuffle: shuffle the training questions (a new permutation each epoch).
      max_questions: train on at most this many questions (a seeded random subset); 0 means all.
    """
    train_files: str = ""
    eval_files: str = ""
    eval_holdout: int = 16
    shuffle: bool = True
    max_questions: int = 0

    def no_evaluation_warning(self) -> str | None:
        """The line a training run prints at its start when this section gives it no evaluation
        questions (eval_files "" and eval_holdout 0: the paper preset's defaults), naming the keys
        to set; None when it has some. A warning, not a refusal: evaluating the final export
        afterwards (`python -m workflow_r1.evaluate`, docs/replicate.md §4) is a plan too."""
        if self.eval_files or self.eval_holdout:
            return None
        return ("warning: this run evaluates nothing (data.eval_files is empty and data.eval_holdout is 0); set "
                "--config.data.eval_files=FILE.jsonl,... (e.g. the NQ and HotpotQA test sets) or "
                "--config.data.eval_holdout=N to evaluate while training")

    def __post_init__(self):
        bounds.check("data.eval_holdout", self.eval_holdout, 0, bounds.MAX_COUNT, note=" (0: none)")
        if self.max_questions < 0:
            raise ValueError(f"max_questions {self.max_questions} must be >= 0 (0 means all)")
        bounds.check("data.max_questions", self.max_questions, 0, bounds.MAX_COUNT, note=" (0: all)")


def split_train_eval(questions: Sequence[Question], cfg: DataConfig,
                     seed: int) -> tuple[list[Question], list[Question]]:
    """(train, eval) from the loaded train questions, a pure function of its arguments.

    eval is `load_questions(cfg.eval_files)` if given, else `cfg.eval_holdout` questions drawn from
    `questions` with `seed` and removed from train. train is then capped at `cfg.max_questions`
    (drawn with the same permutation, so the eval questions never enter it). Both keep file order.

    Raises:
      DataError: the hold-out or cap leaves no training question.
    """
    n = len(questions)
    holdout = 0 if cfg.eval_files else cfg.eval_holdout
    if holdout >= n:
        raise DataError(f"data.eval_holdout={holdout} leaves no training question out of {n}; "
                        "lower it or set data.eval_files")
    order = np.random.default_rng(seed).permutation(n) if (holdout or cfg.max_questions) else np.arange(n)
    eval_idx = np.sort(order[:holdout])
    rest = order[holdout:]
    if cfg.max_questions:
        rest = rest[:cfg.max_questions]
    train = [questions[i] for i in np.sort(rest)]
    evaluation = load_questions(cfg.eval_files) if cfg.eval_files else [questions[i] for i in eval_idx]
    return train, evaluation


def load_data(cfg: DataConfig, seed: int) -> tuple[list[Question], list[Question]]:
    """(train, eval) questions for a run: load_questions(cfg.train_files), then split_train_eval."""
    return split_train_eval(load_questions(cfg.train_files), cfg, seed)
