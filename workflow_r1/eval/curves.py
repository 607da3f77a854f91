"""A run's per-step curves as one PNG, drawn from its `metrics.jsonl` (so a resumed run draws all its steps).

Four panels against the training step: the mean reward of each step's episodes; their exact-match and
format-valid rates, with the greedy evaluations on held-out questions as points (step 0 is before
training); operator calls per episode, in all and per operator; the step's wall time in seconds.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from workflow_r1 import storage


def read_metrics(path: storage.PathLike) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, one per step (a later record of a step replaces an earlier)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in storage.path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r and isinstance(r[key], (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot(rows: Sequence[Mapping[str, Any]], path: storage.PathLike, title: str = "") -> storage.Path:
    """Draws the four panels of `rows` (metrics records) into the PNG `path`; returns it."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    ax = axes[0]
    ax.plot(*_series(rows, "rollout/reward"), marker=".", label="training episodes")
    ax.set_title("reward (mean of the step's episodes)")
    ax = axes[1]
    for key, label, style in (("rollout/em", "EM, training", "-"), ("rollout/format_ok", "format valid, training", "--")):
        ax.plot(*_series(rows, key), style, marker=".", label=label)
    for key, label, marker in (("eval/em", "EM, held-out (greedy)", "o"),
                               ("eval/format_ok", "format valid, held-out (greedy)", "s")):
        ax.plot(*_series(rows, key), marker, markersize=8, linestyle=":", label=label)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("exact match and format")
    ax = axes[2]
    ax.plot(*_series(rows, "rollout/calls"), marker=".", color="black", label="all")
    operators = sorted({k.split("/", 2)[2] for r in rows for k in r if k.startswith("rollout/calls/")})
    for op in operators:
        ax.plot(*_series(rows, f"rollout/calls/{op}"), marker=".", label=op)
    ax.set_title("operator calls per episode (training)")
    ax = axes[3]
    ax.plot(*_series(rows, "time/step_s"), marker=".", label="step")
    ax.plot(*_series(rows, "time/rollout_s"), marker=".", label="rollout")
    ax.plot(*_series(rows, "time/update_s"), marker=".", label="update")
    ax.set_title("seconds")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = storage.path(path)
    with out.open("wb") as f:
        fig.savefig(f, format="png", dpi=90)
    plt.close(fig)
    return out
