"""Deterministic, checkpointable batches of questions for the trainer, one slice per host.

The order is a pure function of (questions, batch_size, seed, shuffle) and the step number, built
with grain's random-access MapDataset:

    grain.MapDataset.source(questions).shuffle(seed=seed).batch(batch_size, drop_remainder=True)
        .repeat(num_epochs)

- Epoch e is a fresh permutation drawn with seed + e (grain's ShuffleMapDataset reseeds per epoch);
  shuffle=False keeps file order every epoch.
- Each epoch is batched on its own and its last len(questions) % batch_size questions are dropped
  (verl's drop_last): every batch is full and no batch mixes two epochs.
- The global batch of `batch_size` questions is the same on every host; host h of P takes rows
  [h*b/P, (h+1)*b/P). Resuming with a different number of hosts keeps the global order.
- The state is the step number (plus what it was drawn from, to refuse a mismatched resume); batch k
  is computed, not replayed, so set_state is O(1) and a resumed run draws exactly the questions an
  uninterrupted one would.

The order depends on grain's index shuffle: requirements.txt pins grain so that it cannot change.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import grain

from workflow_r1.data.questions import Question

_STATE_KEYS = ("step", "num_questions", "batch_size", "seed", "shuffle", "fingerprint")


class QuestionIterator:
    """Batches of questions for this host, in an order fixed by the seed; see the module docstring.

    Args:
      questions: the training questions (any random-access Sequence, e.g. a TfdsQuestions).
      batch_size: questions per global batch (all hosts together); a multiple of process_count.
      seed: shuffle seed, 0 <= seed < 2**32.
      shuffle: False keeps file order in every epoch.
      num_epochs: None repeats forever; else next() raises StopIteration after that many epochs.
      process_index, process_count: this host and the number of hosts (jax.process_index/count()).
    """

    def __init__(self, questions: Sequence[Question], batch_size: int, *, seed: int,
                 shuffle: bool = True, num_epochs: int | None = None, process_index: int = 0,
                 process_count: int = 1):
        n = len(questions)
        if batch_size <= 0 or batch_size > n:
            raise ValueError(f"QuestionIterator: batch_size {batch_size} must be in [1, {n}] "
                             f"(the number of questions); lower it or add questions")
        if process_count <= 0 or not 0 <= process_index < process_count:
            raise ValueError(f"QuestionIterator: process_index {process_index} must be in "
                             f"[0, process_count={process_count})")
        if batch_size % process_count:
            raise ValueError(f"QuestionIterator: batch_size {batch_size} is not a multiple of "
                             f"process_count {process_count}; every host needs the same share")
        if not 0 <= seed < 2**32:
            raise ValueError(f"QuestionIterator: seed {seed} must be in [0, 2**32)")
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"QuestionIterator: num_epochs {num_epochs} must be positive or None")
        self._questions = questions
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._per_host = batch_size // process_count
        self._offset = process_index * self._per_host
        ds = grain.MapDataset.source(questions)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.batch(batch_size, drop_remainder=True, batch_fn=list)
        self._steps_per_epoch = n // batch_size
        self._total_steps = None if num_epochs is None else num_epochs * self._steps_per_epoch
        self._batches = ds.repeat(num_epochs)
        self._step = 0
        self._fingerprint: str | None = None

    @property
    def step(self) -> int:
        """Batches drawn so far, over all epochs (the index of the next batch)."""
        return self._step

    @property
    def epoch(self) -> int:
        """Epochs completed so far (the epoch the next batch comes from)."""
        return self._step // self._steps_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        """len(questions) // batch_size: full batches in one epoch (the remainder is dropped)."""
        return self._steps_per_epoch

    def next(self) -> list[Question]:
        """This host's batch_size / process_count questions of the next global batch."""
        if self._total_steps is not None and self._step >= self._total_steps:
            raise StopIteration
        batch = self._batches[self._step]
        self._step += 1
        return batch[self._offset:self._offset + self._per_host]

    def __next__(self) -> list[Question]:
        return self.next()

    def __iter__(self) -> QuestionIterator:
        return self

    def _data_fingerprint(self) -> str:
        """A short hash of every question's source, id and text: refuses resuming on other data."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for q in self._questions:
                h.update(f"{q.data_source}\x1f{q.id}\x1f{q.question}\x1e".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: set_state of it on a fresh iterator continues from here."""
        return {"step": self._step, "num_questions": len(self._questions),
                "batch_size": self._batch_size, "seed": self._seed, "shuffle": self._shuffle,
                "fingerprint": self._data_fingerprint()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a get_state() of an iterator over the same questions, batch size and seed.

        Raises:
          ValueError: one line naming the first setting that differs from the saved one.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"QuestionIterator.set_state: state lacks {missing[0]!r}; "
                             "pass a dict from get_state()")
        mine = self.get_state()
        for key in _STATE_KEYS[1:]:
            if state[key] != mine[key]:
                raise ValueError(f"QuestionIterator.set_state: the state was saved with {key}="
                                 f"{state[key]!r} but this iterator has {mine[key]!r}; resume with "
                                 "the same data, batch_size, seed and shuffle")
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"QuestionIterator.set_state: step {step!r} must be a non-negative int")
        self._step = step
