"""record.json and summary.md of a run (docs/rlmopt.md, Record).

record.json has the keys: method, bench, seed, task_lm, optimizer_lm, rollouts_used, budget,
wall_clock_s, val_score, test_score, seed_val_score, seed_test_score, per_example_test
({example id: composite}), test_fields and seed_test_fields ({field: mean over the test split}
of the chosen and the seed candidate), cost_usd_estimate (from the user's price table,
rlmopt/cost.py; null without one or when a role with calls is unpriced), chosen ({label, candidate_id,
candidate}), pool (every finalist with its validation scores), commits, and extra = {api_calls,
prompt_tokens, completion_tokens, total_tokens, cached_tokens, cache_hit_rate (cached / prompt
tokens: the servers' prompt-cache share), calls_by_role, by_role ({role: calls, prompt, completion
and cached tokens, estimated_prompt_calls, cost_usd}), prices (the table used, or null),
unpriced_roles, agent_iterations, diagnoses, stop_reason}, and sandbox (the agent's REPL: {mode,
promised, in_force, missing, landlock_abi, worker_uid} of rlmopt.sandbox.layers.summary; null
for methods that run no agent code). Token counts are estimates where a backend does not report
them (lm.Meter).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlmopt import cost
from rlmopt.harness import Harness
from rlmopt.sandbox import layers
from rlmopt.selection import FinalResult


def build_record(h: Harness, final: FinalResult, *, method: str, task_lm: str, optimizer_lm: str,
                 iterations: int = 0, stop_reason: str = "",
                 prices: dict | None = None, sandbox: dict | None = None) -> dict[str, Any]:
    """`prices`: a checked price table (cost.load_prices), or None (no cost estimate); `sandbox`:
    the agent REPL's layers (Repl.sandbox_report), None when no agent code ran."""
    m = h.meter
    prompt = sum(m.prompt_tokens.values())
    completion = sum(m.completion_tokens.values())
    cached = sum(m.cached_tokens.values())
    costs = cost.summary(m, prices)
    return {
        "method": method, "bench": h.task.name, "seed": h.config.seed, "task_lm": task_lm,
        "optimizer_lm": optimizer_lm, "rollouts_used": h.state.rollouts_used,
        "budget": h.config.budget, "wall_clock_s": round(h.wall_clock_s(), 3),
        "val_score": final.val.composite, "test_score": final.test.composite,
        "seed_val_score": final.seed_val.composite, "seed_test_score": final.seed_test.composite,
        "per_example_test": dict(zip(final.test.ids, final.test.composites)),
        "test_fields": dict(final.test.fields), "seed_test_fields": dict(final.seed_test.fields),
        "cost_usd_estimate": costs["cost_usd_estimate"],
        "chosen": {"label": final.chosen_label, "candidate_id": final.chosen_id,
                   "candidate": h.state.candidates[final.chosen_id]},
        "pool": final.pool, "commits": list(h.state.commits), "sandbox": sandbox,
        "extra": {"api_calls": sum(m.calls.values()), "prompt_tokens": prompt,
                  "completion_tokens": completion, "total_tokens": prompt + completion,
                  "cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else 0.0,
                  "calls_by_role": dict(m.calls), "by_role": costs["by_role"], "prices": prices,
                  "unpriced_roles": costs["unpriced_roles"],
                  "style": h.config.style,
                  "self_stop_floor_pct": h.config.styled("self_stop_floor_pct"),
                  "agent_iterations": iterations, "diagnoses": h.state.diagnoses,
                  "stop_reason": stop_reason},
    }


def _cost_line(rec: dict) -> str:
    total, extra = rec["cost_usd_estimate"], rec["extra"]
    if not extra["prices"]:
        return "Estimated cost: - (no price table given: --prices=FILE.json, see rlmopt/cost.py)"
    if total is None:
        return f"Estimated cost: - (the price table has no price for {extra['unpriced_roles']})"
    return f"Estimated cost: {cost.usd(total)} USD"


def summary_markdown(rec: dict) -> str:
    lines = [f"# rlmopt run: {rec['method']} on {rec['bench']} (seed {rec['seed']})", "",
             f"- task LM: `{rec['task_lm']}`; optimizer LM: `{rec['optimizer_lm']}`",
             f"- rollouts used: {rec['rollouts_used']} of {rec['budget']}; wall clock "
             f"{rec['wall_clock_s']:.1f} s; LM calls {rec['extra']['api_calls']} "
             f"({rec['extra']['calls_by_role']}); ~{rec['extra']['total_tokens']} tokens",
             f"- agent iterations: {rec['extra']['agent_iterations']}; stop: "
             f"{rec['extra']['stop_reason'] or '-'}; commits: {len(rec['commits'])}",
             f"- {layers.log_line(rec['sandbox'])}" if rec.get("sandbox") else
             "- sandbox: no agent code ran",
             "", "## Cost", "", "| role | LM calls | prompt tokens | cached | completion tokens | "
             "cost (USD) |", "|---|---|---|---|---|---|"]
    for role, row in rec["extra"]["by_role"].items():
        usd = cost.usd(row["cost_usd"])
        est = " (est.)" if row["estimated_prompt_calls"] else ""
        lines.append(f"| {role} | {row['calls']} | {row['prompt_tokens']}{est} | "
                     f"{row['cached_tokens']} | {row['completion_tokens']} | {usd} |")
    lines += ["", _cost_line(rec), "", "| | validation | test |", "|---|---|---|",
             f"| seed | {rec['seed_val_score']:.3f} | {rec['seed_test_score']:.3f} |",
             f"| chosen ({rec['chosen']['label']}) | {rec['val_score']:.3f} | {rec['test_score']:.3f} |",
             "", "## Final pool (validation)", "", "| candidate | label | composite | fields | "
             "frontier | chars |", "|---|---|---|---|---|---|"]
    for p in rec["pool"]:
        fields = ", ".join(f"{k}={v:.3f}" for k, v in p["fields"].items())
        lines.append(f"| {p['candidate_id']} | {p['label']} | {p['composite']:.3f} | {fields} | "
                     f"{'yes' if p['on_frontier'] else 'no'} | {p['chars']} |")
    lines += ["", "## Chosen candidate", ""]
    for name, text in rec["chosen"]["candidate"].items():
        lines += [f"### {name}", "", "```text", text, "```", ""]
    return "\n".join(lines)


def write(run_dir: str | Path, rec: dict) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "record.json").write_text(json.dumps(rec, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(rec))
