"""Whether the rollout's KV page pool can fit the memory it will live in, asked once at start.

The config's own checks (`bounds`) stop budgets no model could hold (past 2^20 tokens a row), but a
budget inside them can still ask for more KV cache than any chip has: the page pool of a rollout is
`RolloutConfig.page_budget(rows in flight)` pages, and every device of the host's sampler mesh
holds all of it (sampler/paged.py replicates pages) or, for a tensor-parallel sampler's TPU-native
pages, its KV heads' share. What a device holds of a page is known only once the sampler exists
(layers, KV heads, head size, cache dtype and layout), so the trainer asks here after
building the sampler and before any rollout: a pool larger than a device's whole memory is refused
in one line naming the keys that size it, instead of an out-of-memory error (or a host swapping)
at the first rollout, after the model has loaded and compiled.

A device's memory is its allocator's limit (`memory_stats()["bytes_limit"]`: TPU, GPU). CPU devices
have none: they share the host's memory, which then holds every device's share; what counts is the
memory still available when the check runs (`MemAvailable`: after the model has loaded, and net of
what other processes hold), not the machine's total.
"""
from __future__ import annotations

import os
from typing import Any


def available_host_memory() -> int | None:
    """Bytes of host memory available now (Linux `MemAvailable`: free plus reclaimable caches), else
    the physical memory (systems without /proc/meminfo); None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def device_memory(device: Any) -> int | None:
    """Bytes one copy of the pool may use on `device`: its allocator's limit, or for CPU devices the
    host's memory available now (`available_host_memory`); None when neither is known."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics raise their own errors
        pass
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if getattr(device, "platform", "") == "cpu":
        return available_host_memory()
    return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def per_device_bytes(pages: Any, device: Any) -> int:
    """The bytes of the KV pages `pages` (`KVPages`) that `device` holds: all of them when they are
    replicated (or not on a mesh), its shard when they are split over KV heads (a tensor-parallel
    sampler's TPU-native pages)."""
    import jax

    total = 0
    for x in jax.tree_util.tree_leaves((pages.k, pages.v)):
        shards = [s for s in getattr(x, "addressable_shards", []) if s.device == device]
        total += int(shards[0].data.nbytes) if shards else int(x.nbytes)
    return total


def check_page_pool(cfg: Any, rows: int, bytes_per_page: int, devices: list[Any], what: str) -> None:
    """Raises ValueError (one line) when the page pool of a rollout of `rows` rows on this host
    (`cfg`: its `RolloutConfig`; `what` names the rollout) cannot fit: on an accelerator, more than one
    device's memory; on CPU devices, one copy per device more than the host's available memory.

    bytes_per_page: what one device holds of a page's K and V of every layer (`per_device_bytes`);
    devices: the sampler mesh's devices on this host, each holding that much a page."""
    if not devices or rows < 1:
        return
    in_flight = min(cfg.max_rows_in_flight or rows, rows)
    pages = cfg.page_budget(in_flight)
    need = (pages + 1) * bytes_per_page  # and the scratch page every pool has
    cpu = all(getattr(d, "platform", "") == "cpu" for d in devices)
    copies = len(devices) if cpu else 1  # CPU devices' shares all live in the host's memory
    have = device_memory(devices[0])
    if have is None or need * copies <= have:
        return
    sized = ("rollout.kv_cache_pages" if cfg.kv_cache_pages else
             f"{in_flight} rows in flight x {cfg.pages_per_row} pages a row of rollout.max_prompt_tokens + "
             "rollout.max_response_tokens")
    where = (f"the host's {_gib(have)} available, holding every CPU device's share ({copies})" if cpu
             else f"one {str(devices[0].platform).upper()} device's {_gib(have)}")
    raise ValueError(
        f"{what}: its KV page pool needs {_gib(need * copies)} ({pages} pages of {cfg.page_size} tokens, "
        f"{bytes_per_page} bytes a page a device: {sized}), more than {where}; lower rollout.max_rows_in_flight, "
        "rollout.kv_cache_pages or rollout.max_response_tokens")


def check_rollouts(cfg: Any, sampler: Any, *, train_rows: int, eval_rows: int) -> None:
    """`check_page_pool` for the run's two rollouts on this host: a training step's (`train_rows`:
    its questions on this host x rollout.n) and an evaluation batch's (`eval_rows`: eval.batch_size),
    with `sampler`'s page bytes (two pages allocated to measure them) and its mesh's devices here."""
    import jax

    mesh = getattr(sampler, "mesh", None)
    devices = ([d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None
               else jax.local_devices()[:1])
    bytes_per_page = per_device_bytes(sampler.new_pages(1, cfg.page_size), devices[0]) // 2
    check_page_pool(cfg, train_rows, bytes_per_page, devices, "a training step's rollout")
    check_page_pool(cfg, eval_rows, bytes_per_page, devices, "an evaluation batch's rollout")
