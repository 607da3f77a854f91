"""The ablation's outputs: curves against step (PNG), final EM with paired differences (Markdown),
and every number behind them (JSON), from `results`:

    results = {"task": ..., "reference": "gsspo", "variants": {name: {"label": ..., "seeds": {
        seed: {"curve": [{"reward": .., "em": .., "format_ok": .., "calls": .., ...} per step],
               "final": {"em": .., "em_stderr": .., "episodes": ..},
               "diagnostics": [{"step": .., "cos_token_sequence": .., "clipfrac_token": .., ...}]}}}}}

"diagnostics" (optional: runs with `train.grad_diagnostics_every`) are the same-batch gradients of
the three granularities on the logged steps; they get a figure of their own (<name>_gradients.png:
cosines, norm ratios and clip fractions against step, one column per loss applied) and a table.

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
            _band(ax, np.arange(1, m.shape[1] + 1), m, v.get("label", name), lw=1.6)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    n_seeds = max(len(v["seeds"]) for v in results["variants"].values())
    fig.suptitle(f"{results.get('title', 'loss ablation')}: mean over {n_seeds} seed(s), band +- 1 s.e., "
                 f"moving average of {window} steps", fontsize=10)
    axes[0, 0].legend(fontsize=8)
    return _save(fig, path)


# The diagnostics' rows: (title, [(key, label)]).
GRADIENTS = (
    ("cosine of the gradients", (("cos_token_sequence", "token · sequence"), ("cos_token_subsequence",
                                 "token · sub-sequence"), ("cos_sequence_subsequence", "sequence · sub-sequence"))),
    ("norm ratio", (("norm_ratio_token_sequence", "token / sequence"), ("norm_ratio_token_subsequence",
                    "token / sub-sequence"), ("norm_ratio_sequence_subsequence", "sequence / sub-sequence"))),
    ("clip fraction", (("clipfrac_token", "token (GRPO)"), ("clipfrac_sequence", "sequence (GSPO)"),
                       ("clipfrac_subsequence", "sub-sequence (GSsPO)"))),
)


def diagnostics_matrix(seeds: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [n], values [seeds, n]) of one diagnostic over the seeds that logged it (cut to the shortest)."""
    runs = [run["diagnostics"] for run in seeds.values() if run.get("diagnostics")]
    n = min(len(r) for r in runs)
    return (np.asarray([row["step"] for row in runs[0][:n]]),
            np.asarray([[row.get(key, np.nan) for row in r[:n]] for r in runs], np.float64))


def has_diagnostics(results: dict[str, Any]) -> bool:
    return any(run.get("diagnostics") for v in results["variants"].values() for run in v["seeds"].values())


def plot_gradients(results: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Rows: cosines, norm ratios, clip fractions; columns: the loss applied; mean over seeds +- 1 s.e."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = {n: v for n, v in results["variants"].items() if any(r.get("diagnostics") for r in v["seeds"].values())}
    fig, axes = plt.subplots(len(GRADIENTS), len(variants), figsize=(4.2 * len(variants), 8), sharex=True,
                             sharey="row", squeeze=False)
    for col, (name, v) in enumerate(variants.items()):
        for row, (title, keys) in enumerate(GRADIENTS):
            ax = axes[row, col]
            for key, label in keys:
                _band(ax, *diagnostics_matrix(v["seeds"], key), label, lw=1.4, marker=".")
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"applied: {v.get('label', name)}", fontsize=9)
            if col == 0:
                ax.set_ylabel(title)
                ax.legend(fontsize=7)
            if row == len(GRADIENTS) - 1:
                ax.set_xlabel("training step")
    n_seeds = max(len(v["seeds"]) for v in variants.values())
    fig.suptitle(f"{results.get('title', 'loss ablation')}: the three losses' gradients of the same batch "
                 f"(mean over {n_seeds} seed(s), band +- 1 s.e.)", fontsize=10)
    return _save(fig, path)


def _band(ax: Any, steps: np.ndarray, runs: np.ndarray, label: str, **kw: Any) -> None:
    """The mean of runs [seeds, steps] against steps, with a band of +- one standard error over seeds."""
    mean = runs.mean(0)
    se = runs.std(0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else np.zeros_like(mean)
    (line,) = ax.plot(steps, mean, label=label, **kw)
    ax.fill_between(steps, mean - se, mean + se, color=line.get_color(), alpha=0.2, lw=0)


def _save(fig: Any, path: str | pathlib.Path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gradients_table(results: dict[str, Any]) -> str:
    """Markdown: per loss applied, each diagnostic's mean over its logged steps and seeds (+- s.e. over seeds)."""
    keys = [(k, f"{title.split()[0]}: {label}") for title, ks in GRADIENTS for k, label in ks]
    lines = ["| applied | " + " | ".join(label for _, label in keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, v in results["variants"].items():
        if not any(r.get("diagnostics") for r in v["seeds"].values()):
            continue
        cells = []
        for key, _ in keys:
            _, m = diagnostics_matrix(v["seeds"], key)
            logged = m[~np.isnan(m).all(axis=1)]  # seeds that logged this key
            if not len(logged):
                cells.append("—")
                continue
            mean, se = mean_se(np.nanmean(logged, axis=1))
            cells.append(f"{mean:.3f} ± {se:.3f}")
        lines.append(f"| {v.get('label', name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


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


def _paired(d: Sequence[float]) -> str:
    m, se = mean_se(d)
    z = m / se if se > 0 else (0.0 if m == 0 else math.copysign(math.inf, m))
    return f"{m:+.3f} ± {se:.3f} | {z:+.1f}"


def question_table(results: dict[str, Any]) -> str:
    """Markdown, workflow runs whose evaluations are kept per question: per loss, the held-out EM
    before and after training and its change, and the after-EM against the reference loss's, each
    paired by question (a seed's questions are the same for every loss) and pooled over seeds; ""
    when the runs kept no per-question evaluations."""
    ref_name = results.get("reference", "gsspo")
    ref = results["variants"].get(ref_name, {"seeds": {}})["seeds"]
    rows = []
    for name, v in results["variants"].items():
        seeds = {s: r["final"] for s, r in v["seeds"].items() if "before" in r["final"] and "after" in r["final"]}
        if not seeds:
            continue
        pairs = [(f["before"][q], f["after"][q]) for f in seeds.values() for q in f["after"]]
        change = _paired([a - b for b, a in pairs])
        vs = [seeds[s]["after"][q] - ref[s]["final"]["after"][q] for s in seeds if s in ref
              and "after" in ref[s]["final"] for q in seeds[s]["after"]]
        rows.append(f"| {v.get('label', name)} | {len(pairs)} | {np.mean([b for b, _ in pairs]):.3f} | "
                    f"{np.mean([a for _, a in pairs]):.3f} | {change} | "
                    f"{'— | —' if name == ref_name or not vs else _paired(vs)} |")
    if not rows:
        return ""
    return "\n".join([f"| loss | questions | held-out EM before | after | change (paired) | change / s.e. | "
                      f"after − {ref_name} after (paired) | / s.e. |", "|---|---:|---:|---:|---:|---:|---:|---:|",
                      *rows]) + "\n"


def window_stats(seeds: dict[str, Any], key: str, window: int = 10) -> dict[str, float]:
    """One metric at the start and the end of training: the mean of its first and its last `window`
    steps (each step's value is the mean over that step's episodes), pooled over the seeds, each
    +- its standard error over those seed-steps; `rise` = end - start in combined standard errors
    (sqrt(se_start^2 + se_end^2)). Runs shorter than 2 x window use half their steps per window.
    `steps`: the runs' length (cut to the shortest). The steps are treated as independent samples:
    each step draws new questions and new episodes, though the policy carries over (the s.e. is a
    floor, not an exact figure)."""
    m = curve_matrix(seeds, key)  # [seeds, steps]
    w = max(1, min(window, m.shape[1] // 2))
    (start, se_start), (end, se_end) = mean_se(m[:, :w].ravel()), mean_se(m[:, -w:].ravel())
    spread = math.hypot(se_start, se_end)
    return {"steps": m.shape[1], "window": w, "start": start, "start_se": se_start, "end": end, "end_se": se_end,
            "rise": (end - start) / spread if spread > 0 else float("nan")}


def rise_table(results: dict[str, Any], window: int = 10) -> str:
    """Markdown: per loss, reward, format-valid rate and operator calls per episode over the first and
    the last `window` steps (`window_stats`), and the change between them in combined standard errors.
    The calls sit beside the format rate because the reward does not require a call: a policy can
    reach a valid format by answering directly, and only the calls tell the two apart."""
    cols = (("reward", "reward"), ("format_ok", "format valid"), ("calls", "calls / episode"))
    rows = []
    for name, v in results["variants"].items():
        stats = [window_stats(v["seeds"], key, window) for key, _ in cols]
        rows.append(f"| {v.get('label', name)} | " + " | ".join(
            f"{s['start']:+.3f} ± {s['start_se']:.3f} | {s['end']:+.3f} ± {s['end_se']:.3f} | {s['rise']:+.1f}"
            for s in stats) + " |")
    w, steps = stats[0]["window"], stats[0]["steps"]  # the last loss's; every loss runs the same steps
    first, last = f"steps 1-{w}", f"steps {steps - w + 1}-{steps}"
    labels = [f"{title}, {when}" for _, title in cols for when in (first, last, "rise (s.e.)")]
    return "\n".join(["| loss | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels), *rows]) + "\n"


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
    """out_dir/{name}.json, {name}.png, {name}.md (the final EM table and the start-vs-end table),
    and {name}_gradients.png when the runs logged gradient diagnostics; returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "png": out / f"{name}.png", "md": out / f"{name}.md"}
    paths["json"].write_text(json.dumps(_rounded(results)))
    plot(results, paths["png"])
    text = table(results)
    questions = question_table(results)
    if questions:
        text += (f"\nHeld-out EM question by question (before and after training, and against "
                 f"{results.get('reference', 'gsspo')}), pooled over seeds:\n\n" + questions)
    text += ("\nStart and end of training (each step's mean over its episodes; mean ± s.e. over "
             "the window's steps of every seed; the rise in combined standard errors):\n\n" + rise_table(results))
    if has_diagnostics(results):
        paths["gradients_png"] = plot_gradients(results, out / f"{name}_gradients.png")
        text += ("\nSame-batch gradients (mean over the logged steps, ± s.e. over seeds):\n\n"
                 + gradients_table(results))
    paths["md"].write_text(text)
    return paths
