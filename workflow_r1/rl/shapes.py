"""The few static sizes a varying count is rounded up to, so that a jitted function compiles few times.

A jitted update recompiles for every new array shape: on the 2-core CPU machine one compile of the
0.5B update takes 40-60 s, longer than the update itself. Counts that change from step to step
(the rows a filtered batch keeps, the longest response of a micro-batch) are therefore rounded up
to a geometric ladder of multiples of a quantum q:

    q x {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ...}

Each rung is at most 1.5 times the one below, so at most a third of a rounded size is padding, and
a count that ranges over [a, b] meets about 2 log2(b / a) distinct sizes.
"""
from __future__ import annotations


def ladder_ceil(n: int, q: int) -> int:
    """The smallest q x {1, 2, 3, 4, 6, 8, 12, ...} that is >= n (q for n <= q). q >= 1."""
    if q < 1:
        raise ValueError(f"the quantum must be >= 1, got {q}")
    m = 1
    while q * m < n:
        m = (m + m // 2 if m > 1 else 2) if m & (m - 1) == 0 else m * 4 // 3  # 1 2 3 4 6 8 12 16 ...
    return q * m


__all__ = ["ladder_ceil"]
