"""What an evaluation writes: every episode (JSONL), `summary.json` and a Markdown table.

The table has one row per data source and one for all questions together: questions, EM with its
standard error (of a mean of 0/1 outcomes, sqrt(p(1-p)/(n-1))), the format-valid rate, the answered
rate, operator calls, turns and response tokens per episode; a second table gives the calls of each
operator per episode. `evaluation_line` is the one line a training run ends with (before and after).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from workflow_r1 import storage
from workflow_r1.eval.greedy import EvalResult
from workflow_r1.rollout.stats import rate_stderr

COLUMNS = (("EM", "em"), ("format ok", "format_ok"), ("answered", "answered"), ("calls", "calls"),
           ("turns", "turns"), ("response tokens", "response_tokens"))


def _row_order(metrics: Mapping[str, Mapping[str, float]]) -> list[str]:
    return [s for s in metrics if s != "all"] + ["all"]


def markdown_table(metrics: Mapping[str, Mapping[str, float]], title: str = "") -> str:
    """The per-source table (and the calls-per-operator table when any operator was called)."""
    lines = [f"**{title}**", ""] if title else []
    lines += ["| data source | questions | " + " | ".join(c for c, _ in COLUMNS) + " |",
              "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for source in _row_order(metrics):
        m = metrics[source]
        cells = [f"{m['em']:.3f} ± {m['em_stderr']:.3f}"]
        cells += [f"{m[k]:.3f}" if k in ("format_ok", "answered") else f"{m[k]:.2f}" for _, k in COLUMNS[1:]]
        name = "**all**" if source == "all" else source
        lines.append(f"| {name} | {int(m['episodes'])} | " + " | ".join(cells) + " |")
    operators = sorted({k.split("/", 1)[1] for m in metrics.values() for k in m if k.startswith("calls/")})
    if operators:
        lines += ["", "Calls per episode, by operator:", "",
                  "| data source | " + " | ".join(operators) + " |", "|---|" + "---:|" * len(operators)]
        for source in _row_order(metrics):
            m = metrics[source]
            lines.append(f"| {source} | " + " | ".join(f"{m.get('calls/' + op, 0.0):.2f}" for op in operators) + " |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: storage.PathLike, result: EvalResult, meta: Mapping[str, Any]) -> storage.Path:
    """Writes out_dir/{episodes.jsonl, summary.json, results.md} (out_dir may be a URI); returns out_dir.

    meta: what was evaluated (method, checkpoint, data files, ...), stored in summary.json.
    """
    out = storage.path(out_dir)
    result.write(out / "episodes.jsonl")
    n = len(result.episodes)
    summary = {**meta, "questions": n, "seconds": result.seconds,
               "questions_per_s": n / result.seconds if result.seconds > 0 else None, "metrics": result.metrics}
    storage.write_text(out / "summary.json", json.dumps(summary, indent=2, default=str))
    title = f"{meta.get('method', '')} on {meta.get('checkpoint') or 'the configured policy'}"
    storage.write_text(out / "results.md", markdown_table(result.metrics, title))
    return out


def evaluation_line(before: dict, after: dict) -> str:
    """"evaluation on 4 questions (greedy): EM 0.000 ± 0.000, format 0.25 ± 0.25, operator calls 1.75 per
    episode before training; EM ... after" from the eval/ metrics of the evaluations before (may be
    empty) and after training."""
    def one(m: dict) -> str:
        n, fmt = m.get("eval/episodes", 0.0), m.get("eval/format_ok", 0.0)
        fmt_se = rate_stderr(fmt, n)
        return (f"EM {m['eval/em']:.3f} ± {m.get('eval/em_stderr', 0.0):.3f}, format {fmt:.2f} ± {fmt_se:.2f}, "
                f"operator calls {m.get('eval/calls', 0.0):.2f} per episode")
    text = f"evaluation on {after.get('eval/episodes', 0.0):.0f} questions (greedy): "
    return text + (f"{one(before)} before training; " if "eval/em" in before else "") + f"{one(after)} after"
