"""Async client of the executor service, used by the rollout engine and by rlmopt.

`execute_many` sends calls concurrently (at most `max_concurrency` in flight), each with its own
timeout, and returns one `Observation` per call in order. It never raises for a call: a timeout,
an unreachable executor, an HTTP error or a malformed or oversized reply becomes an observation
text with `error_kind` set, so the episode continues and a batch of rollouts is never lost to one
bad call. A 503 "busy" (the executor's max_inflight or max_connections reached) is retried after its
Retry-After, within the call's timeout, and a call whose pooled keep-alive connection the executor
closed before replying is sent once more on another connection. Observation texts never name the
executor's address (it may be internal and the policy reads them); the log does.

`execute_many_sync` is the same for synchronous callers (the JAX training loop): it runs on a
private event-loop thread owned by the client, so the connection pool is reused across calls.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import aiohttp

from workflow_r1.executor.guard import TOKEN_ENV
from workflow_r1.executor.httpio import (EXECUTOR_REPLY_BYTES, ReplyTooLarge, check_url, read_capped,
                                         retry_after_s)

_log = logging.getLogger(__name__)
# Longest wait between retries of a 503 "busy" reply, seconds, whatever its Retry-After says.
_BUSY_WAIT_CAP_S = 5.0


@dataclass(frozen=True)
class Observation:
    """Result of one operator call.

    text: the observation for the policy (an error explanation when error_kind is set).
    error_kind: None on success; else the executor's kind (input_format, llm_timeout, ...,
        unknown_operator, bad_template, too_large, ...) or a client-side one: client_timeout,
        client_connection, client_http_error, client_error.
    latency_ms: wall time of the call as seen by the client, milliseconds.
    llm_calls, tokens: executor LLM calls and completion tokens spent (0 when unknown).
    """

    text: str
    error_kind: str | None
    latency_ms: float
    llm_calls: int = 0
    tokens: int = 0


class ExecutorClient:
    """Client for one executor base URL.

    Args:
        base_url: e.g. "http://127.0.0.1:8000" (the value of `ServerHandle.url`).
        timeout_s: limit on one call, seconds, including queueing behind `max_concurrency`.
        max_concurrency: calls in flight at once from this client.
        token: bearer token sent with every request; None: $WORKFLOW_R1_EXECUTOR_TOKEN if set;
            "" sends none.
        max_reply_bytes: longest reply read, bytes; a longer one becomes an error observation.
    """

    def __init__(self, base_url: str, timeout_s: float = 1800.0, max_concurrency: int = 256,
                 token: str | None = None, max_reply_bytes: int = EXECUTOR_REPLY_BYTES):
        check_url(base_url, "executor URL", "http://127.0.0.1:8000")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_reply_bytes = max_reply_bytes
        token = os.environ.get(TOKEN_ENV, "").strip() if token is None else token
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, asyncio.Semaphore]
        ] = weakref.WeakKeyDictionary()
        self._bg_loop: asyncio.AbstractEventLoop | None = None
        self._bg_thread: threading.Thread | None = None
        self._bg_lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------
    # async API

    def _session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        # aiohttp sessions belong to one event loop; keep one per loop that uses this client.
        loop = asyncio.get_running_loop()
        entry = self._per_loop.get(loop)
        if entry is None or entry[0].closed:
            connector = aiohttp.TCPConnector(limit=self.max_concurrency)
            # No session-level timer: `execute` bounds the whole call (queueing included) with one
            # asyncio.timeout, and a second timer per request costs measurable CPU at >1k calls/s.
            session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                            timeout=aiohttp.ClientTimeout(total=None),
                                            trace_configs=[_REUSE_TRACE])
            entry = (session, asyncio.Semaphore(self.max_concurrency))
            self._per_loop[loop] = entry
        return entry

    async def execute(self, operator: str, content: str, template: str | None = None,
                      ) -> Observation:
        """One operator call; never raises (except cancellation)."""
        start = time.perf_counter()
        payload: dict[str, Any] = {"operator": operator, "content": content}
        if template is not None:
            payload["template"] = template
        session, semaphore = self._session()
        resent = False
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    async with semaphore:
                        reuse: dict[str, bool] = {}  # _REUSE_TRACE sets "reused"
                        try:
                            resp = await session.post(f"{self.base_url}/execute", json=payload,
                                                      trace_request_ctx=reuse)
                        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                            # A pooled keep-alive connection closed before any byte of the reply:
                            # the executor closes only connections with no request in progress
                            # (its keep-alive timeout, or room made at its connection cap), which
                            # races with the client reusing one. Sending again is safe: no reply
                            # was produced, so no result can be duplicated, and an operator call
                            # has no effect but its reply (at worst its LLM work is repeated).
                            # Once: a second failure, on a new connection, is a real fault.
                            if resent or not reuse.get("reused"):
                                raise
                            resent = True
                            continue
                        async with resp:
                            body = await read_capped(resp, self.max_reply_bytes)
                            status = resp.status
                            wait_s = retry_after_s(resp.headers.get("Retry-After"))
                    if status != 503 or wait_s is None:
                        break
                    # The executor is at its max_inflight or max_connections: wait as asked (the
                    # timeout still holds).
                    await asyncio.sleep(min(max(wait_s, 0.05), _BUSY_WAIT_CAP_S))
        except TimeoutError:
            return Observation(f"Operator {operator} failed: the executor did not answer within "
                               f"{self.timeout_s:g} s. Continue without this result.",
                               "client_timeout", _ms(start))
        except aiohttp.ClientError as exc:
            _log.warning("executor %s: %s: %s", self.base_url, type(exc).__name__, exc)
            return Observation(f"Operator {operator} failed: cannot reach the executor "
                               f"({type(exc).__name__}). Continue without this result.",
                               "client_connection", _ms(start))
        except ReplyTooLarge as exc:
            return Observation(f"Operator {operator} failed: the executor's {exc}. Continue "
                               "without this result.", "client_http_error", _ms(start))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # e.g. a malformed URL; the caller still gets an observation
            return Observation(f"Operator {operator} failed: executor client error "
                               f"({type(exc).__name__}: {exc}). Continue without this result.",
                               "client_error", _ms(start))
        return _observation_from_reply(operator, status, body, start)

    async def execute_many(self, calls: Sequence[tuple[str, str]],
                           templates: Mapping[str, str] | None = None) -> list[Observation]:
        """Run `calls` = [(operator, content), ...] concurrently; results in the same order.
        `templates` maps operator name -> prompt-template override (rlmopt candidates)."""
        templates = templates or {}
        return list(await asyncio.gather(
            *(self.execute(op, content, templates.get(op)) for op, content in calls)))

    async def health(self) -> dict:
        """GET /health; raises on failure (for startup checks, not for rollouts)."""
        return await self._get_json("/health")

    async def operators(self) -> dict:
        """GET /operators; raises on failure."""
        return await self._get_json("/operators")

    async def _get_json(self, path: str) -> dict:
        """GET `path` (e.g. "/health") and parse the JSON reply; raises on any failure."""
        session, _ = self._session()
        async with session.get(f"{self.base_url}{path}",
                               timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
            resp.raise_for_status()
            return json.loads(await read_capped(resp, self.max_reply_bytes))

    async def aclose(self) -> None:
        """Close the session of the running loop."""
        entry = self._per_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[0].close()

    # ---------------------------------------------------------------------------------------------
    # sync API

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        with self._bg_lock:
            if self._bg_loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="executor-client",
                                          daemon=True)
                thread.start()
                self._bg_loop, self._bg_thread = loop, thread
            return self._bg_loop

    def execute_many_sync(self, calls: Sequence[tuple[str, str]],
                          templates: Mapping[str, str] | None = None) -> list[Observation]:
        """Blocking `execute_many` for synchronous callers (not from inside a running loop)."""
        future = asyncio.run_coroutine_threadsafe(self.execute_many(calls, templates),
                                                  self._background_loop())
        return future.result()

    def close(self) -> None:
        """Stop the background loop of the sync API (async users call `aclose`)."""
        with self._bg_lock:
            loop, thread = self._bg_loop, self._bg_thread
            self._bg_loop = self._bg_thread = None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        assert thread is not None
        thread.join(10)
        loop.close()

    def __enter__(self) -> "ExecutorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _mark_reused(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    context.trace_request_ctx["reused"] = True


# Tells `execute` whether a request went out on a pooled connection (see the resend there).
_REUSE_TRACE = aiohttp.TraceConfig()
_REUSE_TRACE.on_connection_reuseconn.append(_mark_reused)
_REUSE_TRACE.freeze()


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _observation_from_reply(operator: str, status: int, body: bytes, start: float) -> Observation:
    """The observation of one HTTP reply. Never raises: a reply that is not the executor's JSON (a
    proxy's HTML page, a truncated body, counters that are not numbers, JSON nested too deep to
    parse) becomes an error observation, so one bad reply cannot lose the whole batch."""
    try:
        return _parse_reply(operator, status, body, start)
    except Exception as exc:  # e.g. int("many"), int(inf), RecursionError from json.loads
        return Observation(f"Operator {operator} failed: the executor's HTTP {status} reply could not be "
                           f"read ({type(exc).__name__}). Continue without this result.",
                           "client_http_error", _ms(start))


def _parse_reply(operator: str, status: int, body: bytes, start: float) -> Observation:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if status == 200 and isinstance(data, dict) and isinstance(data.get("text"), str):
        return Observation(data["text"], data.get("error_kind"), _ms(start),
                           int(data.get("llm_calls") or 0), int(data.get("tokens") or 0))
    if isinstance(data, dict) and isinstance(data.get("message"), str) and 400 <= status < 500:
        # The executor's own message ("Unknown operator: X. Available operators: [...]", ...).
        return Observation(data["message"], str(data.get("error", "client_http_error")), _ms(start))
    return Observation(f"Operator {operator} failed: the executor answered HTTP {status}. "
                       "Continue without this result.", "client_http_error", _ms(start))
