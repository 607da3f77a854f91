"""Range checks of config values: one line naming the key, its allowed range and the value given.

Every config section's dataclass checks its numbers in `__post_init__` with `check`, one line per
key, so a NaN learning rate, a negative batch or a two-billion-token budget is refused when the
config is read, before any model loads. NaN and inf are outside every range.
"""
from __future__ import annotations

import math
from typing import Any

# A row's tokens (prompt + response) beyond this are no budget any model here can hold: Qwen2.5's
# longest context is 131,072 tokens, and a row's KV cache alone would pass a chip's memory first.
MAX_TOKENS = 1 << 20
# Rows, questions or batches beyond this are typing mistakes, not runs (the paper's step is 4,096 rows).
MAX_COUNT = 1 << 24


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.10g}"


def describe(low: float, high: float = math.inf, above: bool = False) -> str:
    """The range as the error line says it: ">= 0", "> 0", "in (0, 1]", "in [1, 1048576]"."""
    if high == math.inf:
        return f"{'>' if above else '>='} {_num(low)}"
    return f"in {'(' if above else '['}{_num(low)}, {_num(high)}]"


def choice(key: str, value: Any, allowed: tuple[Any, ...], note: str = "") -> None:
    """Raises ValueError "{key} must be one of [...]{note}, got {value!r}" unless `value` is in `allowed`."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ValueError(f"{key} must be one of {list(allowed)}{note}, got {value!r}")


def check(key: str, value: Any, low: float, high: float = math.inf, *, above: bool = False,
          optional: bool = False, note: str = "") -> None:
    """Raises ValueError "{key} must be <range>{note}, got {value}" unless `value` is a finite number
    in [low, high] ((low, high] with `above`); `optional`: None passes too. `note` says what the
    range's edge means, e.g. " (0: off)"."""
    if value is None and optional:
        return
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if above else value >= low) and value <= high)
    if not ok:
        raise ValueError(f"{key} must be {describe(low, high, above)}{' or None' if optional else ''}{note}, "
                         f"got {value!r}")
