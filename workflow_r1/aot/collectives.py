"""What a compiled program's collectives move: the bytes each device receives, read off the HLO
text XLA compiled (`compiled.as_text()`), for the programs whose cost is their data movement (the
sampler's weight sync, aot/sampler.py).
"""
from __future__ import annotations

import math
import re

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}
_COLLECTIVE = re.compile(r"= (.+?) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-done)?\(")


def _group_size(line: str, mesh_size: int) -> int:
    """Devices per replica group of an HLO collective: mesh['a'=1,'b'=4] {'b'}, {{0,1,2,3},...} or
    iota [groups,size]<=[...]; none listed: every device of the program."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict((k.strip("'"), int(v)) for k, v in re.findall(r"('?[\w.]+'?)=(\d+)", m.group(1)))
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=", line):
        return int(m.group(1).split(",")[-1])
    return mesh_size


def received_bytes(hlo: str, mesh_size: int) -> float:
    """Bytes one device receives through the collectives of a compiled program's HLO text: of each
    op's result, the share it did not hold (all-gather, all-to-all: (g-1)/g of it; reduce-scatter:
    (g-1) times it; all-reduce: 2 (g-1)/g, a ring's; collective-permute: all of it), g devices a
    group. A loop body's collectives count once (the sync, the one program this prices, has none)."""
    total = 0.0
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        out = sum(_ITEMSIZE.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
                  for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
        g = _group_size(line, mesh_size)
        total += out * {"all-gather": (g - 1) / g, "all-to-all": (g - 1) / g, "reduce-scatter": g - 1,
                        "all-reduce": 2 * (g - 1) / g, "collective-permute": 1}[m.group(2)]
    return total
