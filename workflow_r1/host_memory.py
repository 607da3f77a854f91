"""The process's host memory: its peak resident size, and freed heap memory handed back to the OS.

On a CPU run, XLA's buffers, the checkpoint loader's tensors and the tokenizer's strings live on
the C heap. When they are freed, glibc keeps the memory inside its heaps (in every thread's arena)
for later allocations, and it hands back only what lies at a heap's top. The phases of a trainer
step (rollout, update, evaluation) each free gigabytes in pieces of other sizes than the next
phase asks for, so the retained memory grows from step to step: the embedded default's 2-step run
peaked at 9.9 GB with 3.6 GB of live arrays. `release_freed()` after each phase returns every wholly
free page (glibc's `malloc_trim(0)`), which kept the same run at 7.2 GB with the same step times.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys


def peak_rss_gb() -> float:
    """The process's peak resident set size so far, in GiB (Linux reports ru_maxrss in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**30 if sys.platform == "darwin" else kib / 2**20  # macOS reports bytes


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed() -> bool:
    """Returns the free pages of every malloc heap to the OS; True if anything was released.

    Cheap (milliseconds) and safe at any time: it touches only memory that nothing holds. A no-op
    (False) where the C library has no malloc_trim.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
