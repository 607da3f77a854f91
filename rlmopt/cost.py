"""Cost accounting: LM calls and tokens per role, priced from a table the user passes.

No price is written in the code: prices change, differ per provider and are the user's to state.
A price table is a JSON file, US dollars per million tokens, keyed by role (task, optimizer, sub,
judge, subagent) or "default" (used for every role the table does not name):

    {"optimizer": {"prompt": 3.0, "completion": 15.0, "cached": 0.3},
     "default":   {"prompt": 0.1, "completion": 0.4}}

`cached` prices the prompt tokens a server served from its prompt cache (they are a subset of the
prompt tokens, so they are charged at `cached` instead of `prompt`); it defaults to `prompt`. A
role's cost is ((prompt - cached) * prompt_price + cached * cached_price + completion *
completion_price) / 1e6. A role with calls but no price (and no "default") makes the total null
and is listed in `unpriced_roles`, so an estimate never silently leaves a role out.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from rlmopt.lm import Meter

PRICE_KEYS = ("prompt", "completion", "cached")


def usd(value: float | None) -> str:
    """A cost for a table: four significant digits (runs cost fractions of a cent), "-" if None."""
    return "-" if value is None else f"{value:.4g}"


def check_prices(table: Any, source: str = "price table") -> dict[str, dict[str, float]]:
    """The validated table {role: {prompt, completion, cached}} (cached filled in from prompt);
    ValueError naming the bad entry otherwise."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"{source}: expected a JSON object {{role: {{\"prompt\": USD per 1M, "
                         "\"completion\": USD per 1M, \"cached\": USD per 1M}}}} (see rlmopt/cost.py)")
    out: dict[str, dict[str, float]] = {}
    for role, entry in table.items():
        if not isinstance(entry, Mapping) or not {"prompt", "completion"} <= set(entry):
            raise ValueError(f"{source}: role {role!r} needs \"prompt\" and \"completion\" prices "
                             "(USD per million tokens)")
        unknown = set(entry) - set(PRICE_KEYS)
        if unknown:
            raise ValueError(f"{source}: role {role!r} has unknown key(s) {sorted(unknown)}; "
                             f"use {list(PRICE_KEYS)}")
        prices = {}
        for key in PRICE_KEYS:
            value = entry.get(key, entry["prompt"])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value < 0:
                raise ValueError(f"{source}: {role}.{key} = {value!r}; give a non-negative number "
                                 "(USD per million tokens)")
            prices[key] = float(value)
        out[str(role)] = prices
    return out


def load_prices(path: str | Path) -> dict[str, dict[str, float]]:
    """The price table in a JSON file (see the module docstring)."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"price table {path}: cannot read it as JSON ({exc})") from None
    return check_prices(table, f"price table {path}")


def by_role(meter: Meter, prices: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, dict]:
    """{role: {calls, prompt_tokens, completion_tokens, cached_tokens, estimated_prompt_calls,
    cost_usd}}; cost_usd is None for a role the table does not price (or without a table)."""
    out = {}
    for role in sorted(meter.calls):
        p = meter.prompt_tokens.get(role, 0)
        c = meter.completion_tokens.get(role, 0)
        k = meter.cached_tokens.get(role, 0)
        row = {"calls": meter.calls[role], "prompt_tokens": p, "completion_tokens": c,
               "cached_tokens": k, "estimated_prompt_calls": meter.estimated_prompt.get(role, 0),
               "cost_usd": None}
        price = None if prices is None else prices.get(role, prices.get("default"))
        if price is not None:
            row["cost_usd"] = ((p - k) * price["prompt"] + k * price["cached"] +
                               c * price["completion"]) / 1e6
        out[role] = row
    return out


def summary(meter: Meter, prices: Mapping[str, Mapping[str, float]] | None = None) -> dict:
    """The cost section of a record: per-role rows, the total estimate (None without a table or
    when a role with calls is unpriced) and the unpriced roles."""
    roles = by_role(meter, prices)
    unpriced = [r for r, row in roles.items() if row["cost_usd"] is None]
    total = None
    if prices is not None and not unpriced:
        total = sum(row["cost_usd"] for row in roles.values())
    return {"by_role": roles, "cost_usd_estimate": total, "unpriced_roles": unpriced}
