"""The ablation's outputs: curves against step (PNG), final EM with paired differences (Markdown),
and every number behind them (JSON), from `results`:

    results = {"task": ..., "reference": "gsspo", "variants": {name: {"label": ..., "seeds": {
        seed: {"curve": [{"reward": .., "em": .., "format_ok": .., "calls": .., ...} per step],
               "final": {"em": .., "em_stderr": .., "episodes": ..}}}}}}

Across seeds: a curve is the mean over seeds with a band of +- one standard error; a final EM is the
mean over seeds +- the standard error over seeds; the paired difference to the reference loss is the
mean over seeds of (EM of the variant - EM of the reference with the same seed, so the same initial
policy, questions and evaluation set) +- its standard error.
"""
from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

CURVES = (("reward", "reward"), ("em", "EM"), ("format_ok", "format valid"), ("calls", "operator calls / episode"))


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is 0 for a single value."""
    x = np.asarray(values, np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0


def curve_matrix(seeds: dict[str, Any], key: str) -> np.ndarray:
    """[seeds, steps] of one metric (runs cut to the shortest)."""
    rows = [[row[key] for row in run["curve"]] for run in seeds.values()]
    steps = min(len(r) for r in rows)
    return np.asarray([r[:steps] for r in rows], np.float64)


def smooth(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over the last axis (the first points average what exists)."""
    if window <= 1:
        return x
    c = np.cumsum(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, 0)]), axis=-1)
    n = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(n - window, 0)
    return (np.take(c, n, axis=-1) - np.take(c, lo, axis=-1)) / (n - lo)


def plot(results: dict[str, Any], path: str | pathlib.Path, *, window: int = 5) -> pathlib.Path:
    """A 2 x 2 figure of reward, EM, format rate and calls against step, one line per loss."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, CURVES):
        for name, v in results["variants"].items():
            m = smooth(curve_matrix(v["seeds"], key), window)
            mean = m.mean(0)
            se = m.std(0, ddof=1) / math.sqrt(len(m)) if len(m) > 1 else np.zeros_like(mean)
            steps = np.arange(1, len(mean) + 1)
            (line,) = ax.plot(steps, mean, label=v.get("label", name), lw=1.6)
            ax.fill_between(steps, mean - se, mean + se, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    n_seeds = max(len(v["seeds"]) for v in results["variants"].values())
    fig.suptitle(f"{results.get('title', 'loss ablation')}: mean over {n_seeds} seed(s), band +- 1 s.e., "
                 f"moving average of {window} steps", fontsize=10)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(results: dict[str, Any]) -> str:
    """Markdown: per loss, final greedy EM (mean +- s.e. over seeds), per-seed EMs, the paired
    difference to the reference loss, and the last-10-step training reward."""
    ref_name = results.get("reference", "gsspo")
    ref = results["variants"].get(ref_name)
    lines = ["| loss | final EM (mean ± s.e.) | EM per seed | Δ EM vs " + ref_name + " (paired) | "
             "train reward, last 10 steps | calls / episode, last 10 steps |", "|---|---:|---|---:|---:|---:|"]
    for name, v in results["variants"].items():
        seeds = v["seeds"]
        em = [seeds[s]["final"]["em"] for s in seeds]
        m, se = mean_se(em)
        if ref is None or name == ref_name:
            diff = "—"
        else:
            common = [s for s in seeds if s in ref["seeds"]]
            d_m, d_se = mean_se([seeds[s]["final"]["em"] - ref["seeds"][s]["final"]["em"] for s in common])
            diff = f"{d_m:+.3f} ± {d_se:.3f}"
        reward = np.mean([np.mean([r["reward"] for r in seeds[s]["curve"][-10:]]) for s in seeds])
        calls = np.mean([np.mean([r["calls"] for r in seeds[s]["curve"][-10:]]) for s in seeds])
        lines.append(f"| {v.get('label', name)} | {m:.3f} ± {se:.3f} | {', '.join(f'{x:.3f}' for x in em)} | "
                     f"{diff} | {reward:.3f} | {calls:.2f} |")
    return "\n".join(lines) + "\n"


def _rounded(x: Any) -> Any:
    """Floats to 5 significant digits (a compact JSON)."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def write(results: dict[str, Any], out_dir: str | pathlib.Path, name: str = "ablation") -> dict[str, pathlib.Path]:
    """out_dir/{name}.json, {name}.png, {name}.md; returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "png": out / f"{name}.png", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(_rounded(results)))
    plot(results, paths["png"])
    paths["md"].write_text(table(results))
    return paths
