"""Whether the rollout's KV page pool can fit the memory it will live in, asked once at start.

The config's own checks (`bounds`) stop budgets no model could hold (past 2^20 tokens a row), but a
budget inside them can still ask for more KV cache than any chip has: the page pool of a rollout is
`RolloutConfig.page_budget(rows in flight)` pages, and every device of the host's sampler mesh
holds all of it (sampler/paged.py replicates pages). Its bytes are known only once the sampler
exists (layers, KV heads, head size, cache dtype and layout), so the trainer asks here after
building the sampler and before any rollout: a pool larger than a device's whole memory is refused
in one line naming the keys that size it, instead of an out-of-memory error (or a host swapping)
at the first rollout, after the model has loaded and compiled.

A device's memory is its allocator's limit (`memory_stats()["bytes_limit"]`: TPU, GPU). CPU devices
have none: they share the host's physical memory, which then holds one copy per device.
"""
from __future__ import annotations

import os
from typing import Any


def device_memory(device: Any) -> int | None:
    """Bytes one copy of the pool may use on `device`: its allocator's limit, or for CPU devices the
    host's physical memory; None when neither is known."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics raise their own errors
        pass
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if getattr(device, "platform", "") == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_page_pool(cfg: Any, rows: int, bytes_per_page: int, devices: list[Any], what: str) -> None:
    """Raises ValueError (one line) when the page pool of a rollout of `rows` rows on this host
    (`cfg`: its `RolloutConfig`; `what` names the rollout) cannot fit: on an accelerator, more than one
    device's memory; on CPU devices, one copy per device more than the host's memory.

    bytes_per_page: one page's K and V of every layer (`KVPages.bytes_per_page`); devices: the devices
    that each hold a copy (the sampler mesh's on this host)."""
    if not devices or rows < 1:
        return
    in_flight = min(cfg.max_rows_in_flight or rows, rows)
    pages = cfg.page_budget(in_flight)
    need = (pages + 1) * bytes_per_page  # and the scratch page every pool has
    cpu = all(getattr(d, "platform", "") == "cpu" for d in devices)
    copies = len(devices) if cpu else 1
    have = device_memory(devices[0])
    if have is None or need * copies <= have:
        return
    sized = ("rollout.kv_cache_pages" if cfg.kv_cache_pages else
             f"{in_flight} rows in flight x {cfg.pages_per_row} pages a row of rollout.max_prompt_tokens + "
             "rollout.max_response_tokens")
    where = (f"the host's {_gib(have)} holding one copy per CPU device ({copies})" if cpu
             else f"one {str(devices[0].platform).upper()} device's {_gib(have)}")
    raise ValueError(
        f"{what}: its KV page pool needs {_gib(need * copies)} ({pages} pages of {cfg.page_size} tokens, "
        f"{bytes_per_page} bytes a page: {sized}), more than {where}; lower rollout.max_rows_in_flight, "
        "rollout.kv_cache_pages or rollout.max_response_tokens")


def check_rollouts(cfg: Any, sampler: Any, *, train_rows: int, eval_rows: int) -> None:
    """`check_page_pool` for the run's two rollouts on this host: a training step's (`train_rows`:
    its questions on this host x rollout.n) and an evaluation batch's (`eval_rows`: eval.batch_size),
    with `sampler`'s page bytes (two pages allocated to measure them) and its mesh's devices here."""
    import jax

    bytes_per_page = sampler.new_pages(1, cfg.page_size).bytes_per_page
    mesh = getattr(sampler, "mesh", None)
    devices = ([d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None
               else jax.local_devices()[:1])
    check_page_pool(cfg, train_rows, bytes_per_page, devices, "a training step's rollout")
    check_page_pool(cfg, eval_rows, bytes_per_page, devices, "an evaluation batch's rollout")
