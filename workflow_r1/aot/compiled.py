"""One program compiled ahead of time: `_compile` lowers and compiles it for a slice's devices and
returns its `Report` (per-device bytes from XLA's memory analysis, the HLO's cost, and the
roofline's inputs counted from the model); `roofline_s` is a call's lower bound on a chip.
Bytes are per device, flops per device per call, seconds per call.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from typing import Any


class AotError(ValueError):
    """A topology, mesh or program that cannot be used; the message names the fix."""


class DoesNotFit(Exception):
    """A program the TPU compiler refused for lack of HBM; the message is the one-line error."""


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    import jax
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


@dataclasses.dataclass
class Report:
    """One compiled program: per-device bytes and the HLO's cost; `resident`: other live buffers."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    resident: int
    flops: float  # XLA's cost analysis (a while / scan body counted once)
    bytes_accessed: float
    compile_s: float
    fix: str  # config keys that shrink this program
    model_flops: float = 0.0  # per device per call: 6 N per trained token, 2 N per scored / generated one
    executed_flops: float = 0.0  # per device per call, with remat's and the old log-probs' forwards
    min_bytes: float = 0.0  # per device per call: HBM bytes it must at least read (weights, cache)
    attention_flops: float = 0.0  # of executed_flops: attention over the whole compiled cache
    cache_bytes: float = 0.0  # of min_bytes: the working cache (a longest row's slots)
    ici_bytes: float = 0.0  # per device per call: received over the ICI (an FSDP sampler's weight shards, the sync)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.resident


def _compile(name: str, fn: Any, args: tuple, kwargs: dict, mesh: Any, *, resident: int, fix: str,
             donate: tuple[int, ...] = (), static: tuple[str, ...] = (), collectives: bool = False,
             **estimate: Any) -> Report:
    """Compiles `fn` (jitted here, or already: then donate / static are its own) on `args` within
    `mesh` (None: no context mesh). collectives: its ICI bytes are what the compiled program's
    collectives deliver each device (`collectives.received_bytes`) rather than `estimate`'s."""
    import jax

    from workflow_r1 import sharding

    t0 = time.perf_counter()
    print(f"compiling {name} ...", file=sys.stderr, flush=True)
    with sharding.use_mesh(mesh):
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate, static_argnames=static)
        lowered = jitted.lower(*args, **kwargs)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            # The TPU compiler itself refuses a program over HBM, with its own figures.
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            said = re.search(r"required for [^(]*\(([\d.]+\s*\w*)\) exceeds available HBM \(([\d.]+\s*\w*)\)", str(e))
            need = f"{said.group(1)} of temporaries per device, over the {said.group(2)} HBM" if said else \
                str(e).splitlines()[0][:200]
            raise DoesNotFit(f"error: {name} does not fit: the TPU compiler needs {need}; change {fix}, "
                             "or use a larger slice") from None
    mem = compiled.memory_analysis()
    print(f"compiled {name} in {time.perf_counter() - t0:.0f} s: arguments {_gib(mem.argument_size_in_bytes)}, "
          f"outputs {_gib(mem.output_size_in_bytes)}, aliased {_gib(mem.alias_size_in_bytes)}, temporaries "
          f"{_gib(mem.temp_size_in_bytes)}, resident {_gib(resident)} GiB per device", file=sys.stderr, flush=True)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    if collectives:
        from workflow_r1.aot.collectives import received_bytes

        size = max((len(x.sharding.device_set) for x in jax.tree.leaves(args) if getattr(x, "sharding", None)),
                   default=1)
        estimate["ici_bytes"] = received_bytes(compiled.as_text(), size)
    return Report(name, mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                  mem.temp_size_in_bytes, resident, float(cost.get("flops", 0.0)),
                  float(cost.get("bytes accessed", 0.0)), time.perf_counter() - t0, fix, **estimate)


def _matmul_params(arch: Any) -> int:
    """Parameters that multiply every token: all but the embedding table (the head counts)."""
    return arch.num_params - arch.vocab_size * arch.hidden_size * (0 if arch.tie_word_embeddings else 1)


def _attention_flops(arch: Any, rows: int, queries: int, keys: int) -> float:
    """Forward flops of the score and weighted-sum products: 4 * L * H * Dh per query-key pair."""
    return 4.0 * arch.num_layers * arch.num_heads * arch.head_dim * rows * queries * keys


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def roofline_s(p: Report, chip: Any) -> float:
    """Lower bound on one call's time: compute-, HBM- or ICI-bound, whichever is slowest."""
    return max(p.executed_flops / chip.peak_flops, p.min_bytes / chip.hbm_bandwidth, p.ici_bytes / chip.ici_bandwidth)
