"""Which page holds what: the host side of the paged KV cache (the device arrays: sampler/paged.py).

A pool of `num_pages` pages of `page_size` tokens each. A sequence owns a page table (the pages of
its positions 0..ps-1, ps..2ps-1, ...); pages are reference-counted, so several sequences can
share one.

Automatic prefix caching: a page whose `page_size` tokens are all written is registered under the
hash of every token up to its end (a chain, `page_hashes`), so a new sequence that starts with the
same tokens takes the same pages instead of computing them: the template every prompt shares, a
group's prompt across its samples, and a preempted episode's own history. A registered page is
never written again (a sequence writes only past its own cached tokens). When its last reference
goes, it stays registered and becomes evictable; `allocate` takes free pages first, then evicts
the least recently used registered ones. The cache holds K/V of one set of weights: a rollout
starts a new pool, and so does a partial rollout when it changes weights (rollout/paged.py).

A page being computed in the current call can be promised (`promise`): a sequence whose next
prefix page is promised waits one call and then finds it registered, instead of computing it too.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class OutOfPages(RuntimeError):
    """More pages asked for than are free or evictable."""


def page_hashes(tokens: Sequence[int], page_size: int, prior: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hash of every full page of `tokens`: hash i covers tokens [0, (i + 1) * ps).

    prior: hashes already computed for a prefix of the same tokens (extended, not recomputed)."""
    out = list(prior)
    for i in range(len(out), len(tokens) // page_size):
        h = hashlib.blake2b(out[-1] if out else b"", digest_size=16)
        h.update(np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes())
        out.append(h.digest())
    return out


class PagePool:
    """Page ids 0..num_pages-1 (the device's scratch page, index num_pages, is never handed out)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = np.zeros(num_pages, np.int64)
        self._free = list(range(num_pages - 1, -1, -1))   # a stack: the lowest ids first
        self._page_of: dict[bytes, int] = {}              # registered: prefix hash -> page
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced; oldest first
        self._promised: dict[bytes, int] = {}             # prefix hash -> the sequence computing it
        self.evictions = 0

    # ------------------------------------------------------------------------ counting

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def in_use(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - self.available

    @property
    def registered(self) -> int:
        return len(self._page_of)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    # ------------------------------------------------------------------------ pages

    def allocate(self, n: int) -> list[int]:
        """n private pages (reference count 1), free ones first, then least recently used evictable."""
        if n > self.available:
            raise OutOfPages(f"{n} pages asked for, {self.available} free or evictable of {self.num_pages}")
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(p)]
                self.evictions += 1
            self.refs[p] = 1
            out.append(p)
        return out

    def acquire(self, pages: Sequence[int]) -> None:
        """One more reference to each of `pages` (registered pages a sequence now shares)."""
        for p in pages:
            if self.refs[p] == 0:
                if p not in self._evictable:
                    raise ValueError(f"page {p} is free; only held or registered pages can be shared")
                del self._evictable[p]
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One reference less to each; a page nobody holds becomes evictable (registered) or free."""
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"page {p} released more often than held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # ------------------------------------------------------------------------ prefix cache

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered pages of the longest prefix of `hashes` (not acquired yet)."""
        out = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            out.append(p)
        return out

    def evictable_among(self, pages: Sequence[int]) -> int:
        """How many of `pages` are evictable (sharing them takes them out of `available`)."""
        return sum(p in self._evictable for p in pages)

    def register(self, page: int, h: bytes) -> None:
        """Page `page` (held, its tokens all written) now serves prefix `h`. If another page already
        does (two sequences computed the same prefix in one call), `page` stays private."""
        self._promised.pop(h, None)
        if h in self._page_of or page in self._hash_of:
            return
        if self.refs[page] < 1:
            raise ValueError(f"page {page} is not held; register a page while a sequence holds it")
        self._page_of[h], self._hash_of[page] = page, h

    def promise(self, hashes: Sequence[bytes], owner: int) -> None:
        """`owner` is computing the pages of `hashes` (those not registered or promised already)."""
        for h in hashes:
            if h not in self._page_of:
                self._promised.setdefault(h, owner)

    def promised(self, h: bytes) -> bool:
        return h in self._promised

    def forget_promises(self, owner: int) -> None:
        """Drops what `owner` promised and has not registered (it stopped: preempted or finished)."""
        for h in [h for h, o in self._promised.items() if o == owner]:
            del self._promised[h]
