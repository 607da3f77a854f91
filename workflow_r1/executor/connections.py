"""How many connections the executor holds, and for how long one may dawdle over its headers.

Why: every open socket costs a file descriptor. Without a cap, a client that opens sockets and
sends nothing (or half a request line) until the process runs out of descriptors makes every
other caller fail until the idle timeout closes them. With one:
- at most `limit` connections are open (`ServerConfig.max_connections`, lowered to 3/4 of the
  process's RLIMIT_NOFILE so the server always has descriptors left to accept, to reach its LLM
  and to open files);
- at the cap, a new connection closes the oldest connection that has no request in a handler
  (a silent socket, one still sending its headers, an idle keep-alive one: a client reopens
  those at no cost), so held sockets cannot lock legitimate callers out; only when every
  connection is inside a handler is the newcomer answered 503 `busy` with `Retry-After`;
- a connection that has started a request must finish its headers within `header_timeout_s` of
  its first byte, or it is closed (silent or idle connections keep `idle_timeout_s`).

`ConnectionLimiter.site(runner, host, port)` is an aiohttp site whose connections pass through
the limiter; the app's middleware brackets each request with `begin`/`end`.
"""
from __future__ import annotations

import asyncio
import json
import resource
from collections import OrderedDict
from typing import Any

from aiohttp import web

_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
               b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


def descriptor_cap(limit: int) -> int:
    """`limit`, lowered to 3/4 of this process's soft RLIMIT_NOFILE (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft * 3 // 4))


class _Tracked(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's request handler, tells the limiter."""

    __slots__ = ("limiter", "handler", "transport", "admitted", "busy", "header_timer")

    def __init__(self, limiter: "ConnectionLimiter", handler: Any):
        self.limiter, self.handler = limiter, handler
        self.transport: asyncio.Transport | None = None
        self.admitted = self.busy = False
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.limiter._admit(self):
            self.admitted = True
            self.handler.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.limiter._forget(self)
        if self.admitted:
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self.header_timer is None:  # a request has begun: its headers are due
            self.header_timer = asyncio.get_running_loop().call_later(
                self.limiter.header_timeout_s, self._header_timeout)
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def _header_timeout(self) -> None:
        self.header_timer = None
        if not self.busy:
            self.limiter.header_timeouts += 1
            self.handler.force_close()

    def idle(self) -> bool:
        """No request in a handler and nothing left to send."""
        t = self.transport
        return not self.busy and (t is None or t.is_closing() or t.get_write_buffer_size() == 0)


class ConnectionLimiter:
    """The connection cap and the header timeout of one server (see the module docstring)."""

    def __init__(self, limit: int, header_timeout_s: float):
        self.limit = descriptor_cap(limit)
        self.header_timeout_s = header_timeout_s
        self._open: OrderedDict[_Tracked, None] = OrderedDict()  # oldest first
        self._by_handler: dict[Any, _Tracked] = {}
        self.evicted = self.refused = self.header_timeouts = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def _admit(self, conn: _Tracked) -> bool:
        if len(self._open) >= self.limit:
            victim = next((c for c in self._open if c.idle()), None)
            if victim is None:  # every connection is serving a request: this one waits its turn
                self.refused += 1
                body = json.dumps({"error": "busy", "message": f"{self.limit} connections are "
                                   "open and all are serving requests (server option "
                                   "--max_connections); retry after the Retry-After seconds"})
                assert conn.transport is not None
                conn.transport.write(_BUSY_REPLY % (len(body), body.encode()))
                conn.transport.close()
                return False
            self.evicted += 1
            self._forget(victim)
            victim.handler.force_close()
        self._open[conn] = None
        self._by_handler[conn.handler] = conn
        return True

    def _forget(self, conn: _Tracked) -> None:
        self._open.pop(conn, None)
        self._by_handler.pop(conn.handler, None)
        if conn.header_timer is not None:
            conn.header_timer.cancel()
            conn.header_timer = None

    def begin(self, handler: Any) -> None:
        """A request of `handler`'s connection entered the app (its headers are in)."""
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.busy = True
            if conn.header_timer is not None:
                conn.header_timer.cancel()
                conn.header_timer = None

    def end(self, handler: Any) -> None:
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.busy = False

    def site(self, runner: web.AppRunner, host: str, port: int, backlog: int) -> web.BaseSite:
        return _LimitedSite(runner, self, host, port, backlog)


class _LimitedSite(web.BaseSite):
    """A TCP site whose connections go through a ConnectionLimiter."""

    def __init__(self, runner: web.AppRunner, limiter: ConnectionLimiter, host: str, port: int,
                 backlog: int):
        super().__init__(runner, backlog=backlog)
        self.limiter, self.host, self.port = limiter, host, port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        make_handler = self._runner.server
        assert make_handler is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Tracked(self.limiter, make_handler()), self.host, self.port,
            backlog=self._backlog, reuse_address=True)
