"""A task from your own data: a JSON spec file naming a jsonl file of records.

Spec (`task.json`):
    {"name": "my_task", "description": "what the task LM must do",
     "data": "records.jsonl",                       # relative to the spec file
     "inputs": ["question"],                        # input fields of each record
     "fields": [{"name": "answer", "metric": "exact_match", "weight": 1.0}],
     "seed_prompt": "Answer the question: {question}",  # or "seed_candidate": {name: text}
     "max_tokens": 64, "split_sizes": [40, 30, 30]}  # optional
Each jsonl line holds the input and output fields by name, and optionally an "id" (default: the
line number). With several output fields the task LM must answer with one JSON object.
"""
from __future__ import annotations

import json
from pathlib import Path

from rlmopt.task import Example, Field, Task


def load(spec_path: str) -> Task:
    path = Path(spec_path)
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"task spec {spec_path}: cannot read it as JSON ({exc})") from None
    for key in ("data", "inputs", "fields"):
        if key not in spec:
            raise ValueError(f"task spec {spec_path}: missing key {key!r} (see rlmopt/tasks/jsonl.py)")
    fields = [Field(f["name"], f.get("metric", "exact_match"), float(f.get("weight", 1.0)))
              for f in spec["fields"]]
    data = path.parent / spec["data"]
    examples = []
    for n, line in enumerate(data.read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        missing = [k for k in list(spec["inputs"]) + [f.name for f in fields] if k not in rec]
        if missing:
            raise ValueError(f"{data} line {n + 1}: missing field(s) {missing}")
        examples.append(Example(str(rec.get("id", f"r{n:05d}")),
                                {k: rec[k] for k in spec["inputs"]},
                                {f.name: rec[f.name] for f in fields}))
    seed = spec.get("seed_candidate") or {"system_prompt": spec.get("seed_prompt", "")}
    if not any(str(v).strip() for v in seed.values()):
        raise ValueError(f"task spec {spec_path}: give a seed_prompt or seed_candidate")
    sizes = tuple(spec["split_sizes"]) if spec.get("split_sizes") else None
    return Task(name=spec.get("name", path.stem), description=spec.get("description", ""),
                examples=examples, fields=fields, seed_candidate=dict(seed),
                max_tokens=int(spec.get("max_tokens", 64)), split_sizes=sizes)
