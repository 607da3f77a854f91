"""How many connections the executor holds, which one makes room for a newcomer, and for how long
one may dawdle over its headers.

Why: every open socket costs a file descriptor. Without a cap, a client that opens sockets and
sends nothing (or half a request) until the process runs out of descriptors makes every other
caller fail until the idle timeout closes them. With one:
- at most `limit` connections are open (`ServerConfig.max_connections`, lowered to 3/4 of the
  process's RLIMIT_NOFILE so the server always has descriptors left to accept, to reach its LLM
  and to open files; `raise_descriptor_limit` first lifts the soft limit to the hard one);
- at the cap, a new connection first closes the oldest connection that has sent nothing at all
  since it opened `SILENT_EVICT_S` ago (1 s, or `evict_idle_s` if shorter): it carries no call and
  no client pools it (a client sends its request as soon as it connects), so a flood of silent
  sockets cannot keep every slot young and lock out `/health` and new clients unless it opens
  more than the cap every second. Failing that, it closes the connection that has been quiet longest,
  if it has been quiet for at least `evict_idle_s`: idle since its last reply was sent, or stalled
  in one request (its headers or body begun that long ago and still not complete). A connection
  whose request is complete, or that completed a request or received anything within
  `evict_idle_s`, is never closed for a newcomer: it may carry a call whose reply is due, or a
  client may be about to reuse it, and a POST that is cut off is not retried by HTTP clients;
  When no connection is quiet enough the newcomer is answered 503 `busy` with `Retry-After: 1`
  (ExecutorClient waits and retries within its timeout: a full server is a slow one, never a
  lost call);
- a connection that has started a request must finish its headers within `header_timeout_s` of
  its first byte, or it is closed (silent or idle connections keep `idle_timeout_s`);
- a request answered before its body was read whole (a refusal: no token, too large) closes its
  connection after the reply (the server's middleware). Until then aiohttp goes on reading the
  body for a while (a lingering close, so the client gets the reply before the socket resets);
  a newcomer at the cap closes such a connection before any other, so a trickling body does not
  hold a slot once it has its answer.

`ConnectionLimiter.site(runner, host, port)` is an aiohttp site whose connections pass through
the limiter; the app's middleware brackets each request with `begin`/`end`.
"""
from __future__ import annotations

import asyncio
import json
import resource
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web

_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
               b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")
# Seconds a connection that has sent nothing must be open before a newcomer may close it (or
# evict_idle_s, if shorter): a client sends its request the moment it connects, so only a socket
# held open on purpose is silent this long; closing a client's connection in that first moment
# would cut off its call.
SILENT_EVICT_S = 1.0
# Phases of a connection: nothing received since it opened or since its last reply; a request
# begun and not yet received whole; a whole request received (in a handler, or its reply queued).
_IDLE, _RECEIVING, _SERVING = 0, 1, 2


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (where the OS allows); returns the
    soft limit in force afterwards. Why: distributions start processes at a soft limit of 1,024
    under a hard one of 524,288 or more, and the connection cap is 3/4 of the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    # macOS refuses an infinite soft limit for descriptors; its per-process ceiling is 10,240.
    for target in (hard, 10_240) if hard == resource.RLIM_INFINITY else (hard,):
        if soft != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def descriptor_cap(limit: int) -> int:
    """`limit`, lowered to 3/4 of this process's soft RLIMIT_NOFILE (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft * 3 // 4))


class _Tracked(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's request handler, tells the limiter."""

    __slots__ = ("limiter", "handler", "transport", "admitted", "phase", "since", "requests",
                 "in_handler", "header_timer")

    def __init__(self, limiter: "ConnectionLimiter", handler: Any):
        self.limiter, self.handler = limiter, handler
        self.transport: asyncio.Transport | None = None
        self.admitted = self.in_handler = False
        self.phase, self.since = _IDLE, time.monotonic()  # since: when the phase began
        self.requests = 0  # requests that entered the app on this connection
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
        self.limiter._silent.pop(self, None)
        if self.phase == _IDLE:  # a request has begun: its headers are due
            self.limiter._touch(self, _RECEIVING)
            if self.header_timer is None:
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
        if not self.in_handler:
            self.limiter.header_timeouts += 1
            self.handler.force_close()

    def _received(self, request_number: int) -> None:
        """The body of request `request_number` is in (aiohttp's end-of-payload callback)."""
        if self.in_handler and self.requests == request_number and self.phase == _RECEIVING:
            self.phase = _SERVING

    def quiet_for(self, now: float) -> float:
        """Seconds this connection has been idle or stalled in one request; -1 when it holds a
        whole request or has reply bytes still unsent (never closed for a newcomer)."""
        if self.phase == _SERVING:
            return -1.0
        t = self.transport
        if t is not None and not t.is_closing() and t.get_write_buffer_size():
            return -1.0
        return now - self.since


class ConnectionLimiter:
    """The connection cap, eviction and the header timeout of one server (see the module
    docstring). `limit` connections at most; `evict_idle_s`: seconds a connection must have been
    quiet before a newcomer may close it."""

    def __init__(self, limit: int, header_timeout_s: float, evict_idle_s: float):
        self.limit = descriptor_cap(limit)
        self.header_timeout_s = header_timeout_s
        self.evict_idle_s = evict_idle_s
        # Ordered by the start of the current phase, oldest first (`_touch` moves a connection to
        # the end), so the first connection that is not serving is the one quiet longest.
        self._open: OrderedDict[_Tracked, None] = OrderedDict()
        # The connections that have not sent a byte since they opened, oldest first; and those whose
        # request was answered before its body was read, closing once the server stops reading it.
        self._silent: OrderedDict[_Tracked, None] = OrderedDict()
        self._answered: OrderedDict[_Tracked, None] = OrderedDict()
        self._by_handler: dict[Any, _Tracked] = {}
        self.evicted = self.refused = self.header_timeouts = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def _touch(self, conn: _Tracked, phase: int) -> None:
        conn.phase, conn.since = phase, time.monotonic()
        if conn in self._open:
            self._open.move_to_end(conn)

    def _victim(self) -> _Tracked | None:
        """A connection answered before its body was read (closing anyway), else the oldest one
        that has sent nothing for SILENT_EVICT_S, else the one quiet longest if quiet for at least
        evict_idle_s; None when none qualifies."""
        now = time.monotonic()
        for conn in self._answered:  # its reply given, it was closing anyway (lingering over a body)
            t = conn.transport
            if t is None or t.is_closing() or not t.get_write_buffer_size():
                return conn
        for conn in self._silent:  # the oldest only: the others are younger
            if now - conn.since >= min(SILENT_EVICT_S, self.evict_idle_s):
                return conn
            break
        for conn in self._open:
            quiet = conn.quiet_for(now)
            if quiet < 0:
                continue  # serving: look further
            # Every later connection began its phase later: none is quieter than this one.
            return conn if quiet >= self.evict_idle_s else None
        return None

    def _admit(self, conn: _Tracked) -> bool:
        if len(self._open) >= self.limit:
            victim = self._victim()
            if victim is None:  # nothing quiet enough to close: this one waits its turn
                self._refuse(conn)
                return False
            self.evicted += 1
            self._forget(victim)
            victim.handler.force_close()
        self._open[conn] = None
        self._silent[conn] = None
        self._by_handler[conn.handler] = conn
        return True

    def _refuse(self, conn: _Tracked) -> None:
        self.refused += 1
        body = json.dumps({"error": "busy", "message": f"all {self.limit} connections (server "
                           "option --max_connections) carry a request or were active within the "
                           f"last {self.evict_idle_s:g} s (--evict_idle_s); retry after the "
                           "Retry-After seconds"})
        assert conn.transport is not None
        conn.transport.write(_BUSY_REPLY % (len(body), body.encode()))
        conn.transport.close()

    def _forget(self, conn: _Tracked) -> None:
        self._open.pop(conn, None)
        self._silent.pop(conn, None)
        self._answered.pop(conn, None)
        self._by_handler.pop(conn.handler, None)
        if conn.header_timer is not None:
            conn.header_timer.cancel()
            conn.header_timer = None

    def begin(self, handler: Any, content: Any) -> None:
        """A request of `handler`'s connection entered the app (its headers are in); `content` is
        its body stream (aiohttp StreamReader: `on_eof` says when the body is in)."""
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.in_handler = True
            conn.requests += 1
            if conn.phase == _IDLE:  # a pipelined request, received while the last was served
                self._touch(conn, _RECEIVING)
            if conn.header_timer is not None:
                conn.header_timer.cancel()
                conn.header_timer = None
            number = conn.requests
            content.on_eof(lambda: conn._received(number))

    def end(self, handler: Any, closing: bool = False) -> None:
        """The request of `handler`'s connection left the app (its reply is being sent); `closing`:
        the connection closes after the reply (a refusal answered before its body was read)."""
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.in_handler = False
            self._touch(conn, _IDLE)
            if closing:
                self._answered[conn] = None

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
