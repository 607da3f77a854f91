"""Several executor services as one client: the calls of a batch are spread round-robin over them.

    client = ReplicaClient(["http://exec-0:8000", "http://exec-1:8000"])
    client.execute_many_sync([(operator, content), ...])   # results in call order

Call i of a batch goes to replica (start + i) mod n, where `start` advances by the batch size, so
successive batches (a rollout round has few calls near its end) keep the replicas evenly loaded.
Each replica is an `ExecutorClient` with its own connection pool and concurrency limit; a failing
replica gives error observations for its share of the calls, never an exception (as one client).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from workflow_r1.executor.client import ExecutorClient, Observation


def split_urls(url: str) -> list[str]:
    """"http://a:8000, http://b:8000" -> ["http://a:8000", "http://b:8000"] (empty entries dropped)."""
    return [u.strip() for u in url.split(",") if u.strip()]


class ReplicaClient:
    """The sync and async `execute_many` of `ExecutorClient` over several base URLs.

    Args:
        urls: base URLs of the executor replicas (at least one).
        timeout_s, max_concurrency, token: per replica, as for `ExecutorClient`.
    """

    def __init__(self, urls: Sequence[str], timeout_s: float = 1800.0, max_concurrency: int = 256,
                 token: str | None = None):
        if not urls:
            raise ValueError("ReplicaClient needs at least one executor URL")
        self.clients = [ExecutorClient(u, timeout_s=timeout_s, max_concurrency=max_concurrency, token=token)
                        for u in urls]
        self.base_url = ",".join(c.base_url for c in self.clients)
        self._start = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="executor-replica")

    def assign(self, n_calls: int) -> list[int]:
        """The replica of each of the next `n_calls` calls (round-robin, continuing the last batch)."""
        with self._lock:
            start, self._start = self._start, (self._start + n_calls) % len(self.clients)
        return [(start + i) % len(self.clients) for i in range(n_calls)]

    def _shares(self, calls: Sequence[tuple[str, str]]) -> list[list[int]]:
        shares: list[list[int]] = [[] for _ in self.clients]
        for i, r in enumerate(self.assign(len(calls))):
            shares[r].append(i)
        return shares

    def execute_many_sync(self, calls: Sequence[tuple[str, str]],
                          templates: Mapping[str, str] | None = None) -> list[Observation]:
        """Runs `calls` on the replicas concurrently; results in call order."""
        shares = self._shares(calls)
        futures = [self._pool.submit(c.execute_many_sync, [calls[i] for i in share], templates)
                   for c, share in zip(self.clients, shares) if share]
        return _in_order(len(calls), [s for s in shares if s], [f.result() for f in futures])

    async def execute_many(self, calls: Sequence[tuple[str, str]],
                           templates: Mapping[str, str] | None = None) -> list[Observation]:
        """The async form of `execute_many_sync`."""
        shares = self._shares(calls)
        parts = await asyncio.gather(*(c.execute_many([calls[i] for i in share], templates)
                                       for c, share in zip(self.clients, shares) if share))
        return _in_order(len(calls), [s for s in shares if s], list(parts))

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "ReplicaClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_order(n: int, shares: list[list[int]], parts: list[list[Observation]]) -> list[Observation]:
    out: list[Observation | None] = [None] * n
    for share, part in zip(shares, parts):
        for i, obs in zip(share, part):
            out[i] = obs
    return out  # type: ignore[return-value]
