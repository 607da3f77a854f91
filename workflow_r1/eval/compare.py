"""Before and after training: two greedy evaluations of the same questions, compared question by question.

A run evaluates its held-out questions before its first step and after its last (`eval.at_start`),
writing every episode to `eval/step_N.jsonl`. `paired` reads two such lists and gives, for the EM,
the format-valid rate and the operator calls per episode (in all and per operator), the mean before,
the mean after, and the mean of the per-question differences with its standard error

    d_i = after_i - before_i,  mean(d) +- std(d, ddof=1) / sqrt(n).

Both evaluations score the same questions, so how hard each question is cancels in d_i: the paired
error is what a rise is judged against ("a rise of more than 2 paired s.e."), not the two rates'
own errors. `markdown` renders the table a run ends with. The trainer reads the two from the run's
`eval/` step files, so a resumed run (whose first evaluation ran in an earlier process) compares
the same way.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Paired:
    """One measure before and after: means over the n questions, and the mean paired difference
    (after - before) with its standard error (0 for n < 2)."""

    name: str
    before: float
    after: float
    diff: float
    diff_stderr: float
    n: int

    @property
    def z(self) -> float:
        """The difference in paired standard errors (inf when every question moved alike and it is not 0)."""
        if self.diff_stderr > 0:
            return self.diff / self.diff_stderr
        return 0.0 if self.diff == 0 else math.copysign(math.inf, self.diff)


def exact_match(row: Mapping[str, Any]) -> float:
    """1.0 when the episode summary's answer matched a gold answer (outcome reward 1), else 0.0."""
    return float(row["reward_outcome"] == 1.0)


def _measures(row: Mapping[str, Any], operators: Sequence[str]) -> dict[str, float]:
    """The per-question values of one episode summary (`Episode.summary()`)."""
    ops = row.get("operators") or {}
    out = {"EM": exact_match(row), "format valid": float(row["reward_format"] == 0.0),
           "operator calls": float(row.get("operator_rounds", sum(ops.values())))}
    out.update({f"calls: {op}": float(ops.get(op, 0)) for op in operators})
    return out


def paired(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> list[Paired]:
    """Paired statistics of two evaluations' episode summaries, matched by question id.

    Raises ValueError when they do not hold the same questions (a before/after table of different
    questions would compare nothing)."""
    b = {r["id"]: r for r in before}
    a = {r["id"]: r for r in after}
    if set(b) != set(a) or len(b) != len(before) or len(a) != len(after):
        raise ValueError(f"the two evaluations hold different questions ({len(before)} and {len(after)} episodes, "
                         f"{len(set(b) & set(a))} ids in common): a paired comparison needs the same ones once each")
    operators = sorted({op for r in (*before, *after) for op in (r.get("operators") or {})})
    ids = [r["id"] for r in before]
    vb = [_measures(b[i], operators) for i in ids]
    va = [_measures(a[i], operators) for i in ids]
    n, out = len(ids), []
    for name in vb[0] if vb else ():
        d = [y[name] - x[name] for x, y in zip(vb, va)]
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
        out.append(Paired(name, sum(x[name] for x in vb) / n, sum(y[name] for y in va) / n, mean, se, n))
    return out


def markdown(rows: Sequence[Paired], before_step: int = 0, after_step: int | None = None) -> str:
    """The before/after table: one row per measure (EM, format valid, calls in all and per operator)."""
    n = rows[0].n if rows else 0
    after = "after" if after_step is None else f"after (step {after_step})"
    lines = [f"Greedy evaluation on {n} held-out questions, before (step {before_step}) and {after} training; "
             "the change is the mean of the per-question differences ± its standard error.", "",
             f"| measure | before | {after} | change | change / s.e. |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.before:.3f} | {r.after:.3f} | {r.diff:+.3f} ± {r.diff_stderr:.3f} | "
                     f"{r.z:+.1f} |")
    return "\n".join(lines) + "\n"
