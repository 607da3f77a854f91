"""The cross-run skill library: what a finished run learned, as text, kept in a directory the user
chooses and offered to later runs through the `skill_library` tool (docs/rlmopt.md, Skill library).

One finished rlmopt run adds one JSON file, `<task>-seed<N>-<chosen id>.json`:

    {"task", "description", "seed", "style", "val_score", "seed_val_score", "commits",
     "rules": [...],          # accepted commits' rationales, then the agent's "rule" notes
     "failure_modes": [...],  # the sub-LM's diagnoses, then the agent's "warning"/"hypothesis" notes
     "field_scores": {field: validation score of the chosen candidate}}

Only the agent's and the sub-LM's own words and validation scores are stored, never example
records: a later run with another split seed could hold those examples in its test split. The
texts may still quote training or validation inputs the agent chose to write down, which is why
the library is off by default and never used by `rlmopt.compare` (as the paper disables it for
head-to-head comparisons).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

_TEXT_CHARS = 1000  # one stored rule or failure mode
_MAX_ITEMS = 20


def _texts(items: list) -> list[str]:
    """Non-empty texts, each cut to _TEXT_CHARS, at most _MAX_ITEMS."""
    return [str(t)[:_TEXT_CHARS] for t in items if str(t).strip()][:_MAX_ITEMS]


class SkillLibrary:
    """The library in `directory` (created on the first save)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"skill library {self.dir} is a file; give a directory")

    def entries(self) -> list[dict]:
        """Every stored entry, oldest first (files that do not parse are skipped)."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name)):
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out

    def lookup(self, task: str, query: str = "", limit: int = 5) -> list[dict]:
        """Up to `limit` entries: this task's first (newest first), then other tasks'; with a
        `query`, only entries whose text contains it (case-insensitive)."""
        entries = self.entries()[::-1]
        if query:
            q = str(query).lower()
            entries = [e for e in entries if q in json.dumps(e).lower()]
        entries.sort(key=lambda e: e.get("task") != task)  # stable: newest first within each
        return entries[: max(0, int(limit))]

    def save(self, h: Any, chosen_id: str, val_score: float, seed_val_score: float) -> Path:
        """Stores what the finished run of harness `h` learned; returns the file written."""
        history = h.state.history
        rules = [e["rationale"] for e in history if e.get("event") == "commit" and e["accepted"]]
        rules += [n["text"] for n in h.state.scratchpad if n["kind"] == "rule"]
        failures = [e["analysis"] for e in history if e.get("event") == "diagnosis"]
        failures += [n["text"] for n in h.state.scratchpad if n["kind"] in ("warning", "hypothesis")]
        chosen = h.scores(chosen_id, h.val_order)
        entry = {"task": h.task.name, "description": h.task.description, "seed": h.config.seed,
                 "style": h.config.style, "val_score": val_score, "seed_val_score": seed_val_score,
                 "commits": len(h.state.commits), "rules": _texts(rules),
                 "failure_modes": _texts(failures), "field_scores": chosen.fields}
        self.dir.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{h.task.name}-seed{h.config.seed}-{chosen_id}")
        path = self.dir / f"{name}.json"
        path.write_text(json.dumps(entry, indent=1))
        return path
