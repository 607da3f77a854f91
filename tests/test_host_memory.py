"""host_memory: freed heap memory goes back to the OS on release_freed; the peak RSS in GiB."""
from __future__ import annotations

import ctypes
import os
import resource

import pytest

from workflow_r1 import host_memory

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@pytest.mark.skipif(host_memory._malloc_trim() is None or not os.path.exists("/proc/self/statm"),
                    reason="glibc's malloc_trim and Linux's /proc only")
def test_release_freed_returns_freed_heap_memory_to_the_os():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 3072  # 192 MiB in blocks below glibc's mmap threshold: on the heap
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    last = libc.malloc(size)  # held: the freed blocks are not at the heap's top, so free() keeps them
    for b in blocks:
        libc.free(b)
    try:
        retained = _rss_bytes()
        assert host_memory.release_freed()
        released = retained - _rss_bytes()
        assert released > size * count // 2, f"released {released / 2**20:.0f} MiB of 192 MiB freed"
    finally:
        libc.free(last)


def test_peak_rss_is_in_gib_and_at_least_the_current_rss():
    peak = host_memory.peak_rss_gb()
    assert peak == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if os.path.exists("/proc/self/statm"):
        assert _rss_bytes() / 2**30 <= peak + 1e-3
