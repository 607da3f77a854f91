"""Valid ranges of the executor's numeric options, with one-line errors naming each bad one.

Each settings dataclass of `options` (ServerConfig, ProcessConfig) has one table, RANGES, that serves
both the dataclass (checked when it is built) and the command line (checked, all flags at once,
before the server starts), so a limit and its range are written once. Zero never means
"unlimited": every limit is a positive number, and a bad value is refused instead of turned into a
surprise (a port past 65535 wrapping around, a concurrency of 0 that waits forever).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Range:
    """Numbers from `low` (excluded when `open_low`) to `high` (included); `integer` for counts."""

    low: float
    high: float = math.inf
    open_low: bool = False
    integer: bool = False

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if math.isnan(value) or math.isinf(value):
            return False
        return (value > self.low if self.open_low else value >= self.low) and value <= self.high

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        low = f"{self.low:g}"
        if self.high == math.inf:
            return f"{kind} {'>' if self.open_low else '>='} {low}"
        bracket = "(" if self.open_low else "["
        return f"{kind} in {bracket}{low}, {self.high:g}]"


COUNT = Range(1, integer=True)  # how many of something: at least one
SECONDS = Range(0, open_low=True)  # a timeout or a limit in time: more than zero


def range_errors(values: Mapping[str, Any], ranges: Mapping[str, Range], prefix: str = "") -> list[str]:
    """One line per value outside its range: "{prefix}{name}={value!r}: must be <range>"."""
    return [f"{prefix}{name}={values[name]!r}: must be {r.describe()}"
            for name, r in ranges.items() if name in values and not r.contains(values[name])]
