"""A task: a dataset, how a candidate prompt runs on one example, and weighted per-field metrics.

A candidate is a mapping component name -> text (a single `system_prompt`, or several components
such as tool descriptions and `demonstrations`). `Task.render` turns (candidate, example) into the
task LM's prompt; `Task.parse` turns the task LM's reply into one prediction per output field.
Template variables such as `{question}` in a component are replaced by the example's input of that
name; inputs no component mentions are appended after the components, so a prompt without
placeholders still sees its input. `split` cuts the examples into train/validation/test from one
seed (docs/rlmopt.md, Splits).
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from rlmopt import metrics

Candidate = dict[str, str]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Example:
    """One record: `inputs` (field -> text) and `expected` (output field -> gold value)."""

    id: str
    inputs: Mapping[str, Any]
    expected: Mapping[str, Any]


@dataclass(frozen=True)
class Field:
    """An output field, scored by `metric` (a name in `metrics.METRICS`) with weight `weight`."""

    name: str
    metric: str
    weight: float = 1.0


@dataclass
class Task:
    """Everything the harness needs to evaluate a candidate.

    `description` is shown to the optimizer; `seed_candidate` is where the search starts;
    `max_tokens` bounds one task-LM reply.
    """

    name: str
    description: str
    examples: list[Example]
    fields: list[Field]
    seed_candidate: Candidate
    max_tokens: int = 64
    split_sizes: tuple[int, int, int] | None = None  # train, val, test; None: 40/30/30 percent

    def __post_init__(self) -> None:
        for f in self.fields:
            metrics.get_metric(f.metric)
        ids = [e.id for e in self.examples]
        if len(set(ids)) != len(ids):
            raise ValueError(f"task {self.name}: example ids must be unique")

    @property
    def weights(self) -> dict[str, float]:
        return {f.name: f.weight for f in self.fields}

    def render(self, candidate: Mapping[str, str], example: Example) -> str:
        """The task LM's prompt: the components in order with placeholders filled, then any input
        the components did not mention."""
        used: set[str] = set()

        def fill(m: re.Match) -> str:
            name = m.group(1)
            if name in example.inputs:
                used.add(name)
                return str(example.inputs[name])
            return m.group(0)

        parts = [_PLACEHOLDER.sub(fill, text) for text in candidate.values() if text.strip()]
        rest = [f"{k}: {v}" for k, v in example.inputs.items() if k not in used]
        return "\n\n".join(parts + rest)

    def parse(self, reply: str) -> dict[str, Any]:
        """Predictions per field: the stripped reply for a one-field task, else the JSON object the
        reply contains (missing fields predict "")."""
        text = reply.strip()
        if len(self.fields) == 1:
            return {self.fields[0].name: text}
        match = re.search(r"\{.*\}", text, re.S)
        try:
            obj = json.loads(match.group(0)) if match else {}
        except ValueError:
            obj = {}
        if not isinstance(obj, dict):
            obj = {}
        return {f.name: obj.get(f.name, "") for f in self.fields}

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        return {f.name: metrics.get_metric(f.metric)(prediction.get(f.name, ""),
                                                     example.expected.get(f.name, ""))
                for f in self.fields}

    def check(self, candidate: Mapping[str, str]) -> list[str]:
        """Task-specific commit refusals (one reason each); none by default."""
        del candidate
        return []

    def export(self, candidate: Mapping[str, str], run_dir: Any) -> str | None:
        """Writes the chosen candidate in a form another program reads (the operator task: a
        prompt-set directory); returns its path, or None when the task has no such form."""
        del candidate, run_dir
        return None

    def format_demo(self, example: Example) -> str:
        """One worked example for a prompt: its inputs, then its gold outputs."""
        inputs = "\n".join(f"{k}: {v}" for k, v in example.inputs.items())
        if len(self.fields) == 1:
            out = str(example.expected[self.fields[0].name])
        else:
            out = json.dumps({f.name: example.expected.get(f.name) for f in self.fields})
        return f"{inputs}\nOutput: {out}"


@dataclass(frozen=True)
class Splits:
    train: list[Example]
    val: list[Example]
    test: list[Example] = field(repr=False)

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}


def split(task: Task, seed: int = 7) -> Splits:
    """Shuffle the examples (sorted by id first, so input order does not matter) with
    `random.Random(seed)` and cut train/val/test by `task.split_sizes` (default 40/30/30 percent)."""
    examples = sorted(task.examples, key=lambda e: e.id)
    random.Random(seed).shuffle(examples)
    n = len(examples)
    if task.split_sizes is None:
        n_train, n_val = round(0.4 * n), round(0.3 * n)
    else:
        n_train, n_val, n_test = task.split_sizes
        if n_train + n_val + n_test > n:
            raise ValueError(f"task {task.name}: split_sizes {task.split_sizes} exceed its {n} "
                             "examples; lower them")
    train, val = examples[:n_train], examples[n_train:n_train + n_val]
    test = examples[n_train + n_val:] if task.split_sizes is None else \
        examples[n_train + n_val:n_train + n_val + task.split_sizes[2]]
    if not val or not test:
        raise ValueError(f"task {task.name}: {n} examples leave an empty validation or test split; "
                         "add examples or set split_sizes")
    return Splits(train, val, test)


def placeholders(candidate: Mapping[str, str]) -> set[str]:
    """Template variables ({name}) in a candidate's components."""
    return {m for text in candidate.values() for m in _PLACEHOLDER.findall(text)}


def candidate_id(candidate: Mapping[str, str]) -> str:
    """A short stable hash of a candidate (component order and text)."""
    blob = json.dumps(list(candidate.items()), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def as_candidate(value: Any, base: Mapping[str, str]) -> Candidate:
    """A candidate from what an agent passes: a string replaces the first component of `base`, a
    mapping replaces the components it names; the others are kept from `base` (the running best)."""
    components = list(base)
    if isinstance(value, str):
        return {**base, components[0]: value}
    if isinstance(value, Mapping):
        unknown = set(value) - set(components)
        if unknown:
            raise ValueError(f"unknown component(s) {sorted(unknown)}; this task's components are "
                             f"{components}")
        if not all(isinstance(v, str) for v in value.values()):
            raise ValueError("every component's text must be a string")
        return {c: str(value.get(c, base[c])) for c in components}
    raise ValueError(f"a candidate is a string or a dict of component -> text, not "
                     f"{type(value).__name__}")
