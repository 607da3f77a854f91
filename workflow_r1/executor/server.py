"""The executor HTTP service (aiohttp).

Why aiohttp: one dependency serves both the server and the clients (executor client, OpenAI
backend, remote search), it is fully async so thousands of slow LLM calls can be in flight on one
thread, and on 2 cores its plain handler path is fast enough for the load target without uvicorn.

Endpoints (JSON in, JSON out):
    POST /execute        {"operator": str, "content": str, "template"?: str|null, "id"?: str|int}
                         -> {"text", "error_kind", "latency_ms", "llm_calls", "tokens", "id"}
    POST /execute_batch  {"calls": [<execute body>, ...]} -> {"results": [<execute reply>, ...]}
    GET  /health         -> {"status": "ok", "llm", "search", "inflight", "peak_inflight", "served",
                             "refused_busy", "cancelled", "connections", "max_connections",
                             "evicted", "refused_connections", "header_timeouts", "uptime_s"}
                            (no token needed)
    GET  /operators      -> {"operators": [{name, description, usage, input_fields, ...}],
                             "variants": {name: [operator, ...]}}

Errors are JSON `{"error": kind, "message": str}` with a 4xx status: 400 malformed JSON or schema,
401 missing bearer token (when one is set), 403 foreign Host on a loopback socket, 404/405 unknown
path or method, 408 body not received within `read_timeout_s`, 413 body, content or rendered prompt
over the limits, 415 body not application/json or with a Content-Encoding other than identity,
422 unknown operator or unusable template; 503 with `Retry-After` when `max_inflight` calls are
already running (or, on connecting, when all `max_connections` connections are open and none has
been quiet for `evict_idle_s`). Operator failures (LLM down, search error, bad input fields) are not
HTTP errors: they are 200 replies whose `error_kind` is set and whose text tells the policy. A call
whose caller has gone (timed out, disconnected) is cancelled, LLM requests included. The limits
(`options.ServerConfig`) and the guard are in docs/executor.md.
"""
from __future__ import annotations

import asyncio
import json
import string
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from workflow_r1.task import prompt_sets
from workflow_r1.task.operators import OPERATORS, VARIANT_POOLS, validate_template
from workflow_r1.task.protocol import unknown_operator_text
from workflow_r1.executor.backends import LLMBackend
from workflow_r1.executor.connections import ConnectionLimiter, raise_descriptor_limit
from workflow_r1.executor.guard import Guard, GuardError
from workflow_r1.executor.operators_exec import OperatorRunner
from workflow_r1.executor.options import ServerConfig
from workflow_r1.executor.search import SearchBackend


class RequestError(GuardError):
    """A request refused by a handler (same shape as the guard's refusals)."""


_EXECUTE_KEYS = frozenset({"operator", "content", "template", "id"})
# Bodies longer than this are parsed in a worker thread, so the loop keeps serving meanwhile.
_THREAD_PARSE_BYTES = 1 << 20


def _error_response(status: int, kind: str, message: str,
                    headers: dict[str, str] | None = None) -> web.Response:
    body = json.dumps({"error": kind, "message": message}).encode()
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _template_shape(template: str) -> tuple[int, int]:
    """(literal characters, placeholders) of a str.format template that validate_template accepted."""
    literal = placeholders = 0
    for text, field, _, _ in string.Formatter().parse(template):
        literal += len(text)
        placeholders += field is not None
    return literal, placeholders


# The registry templates' shapes, computed once (a caller's template is measured per call).
_REGISTRY_SHAPES = {name: _template_shape(spec.template) for name, spec in OPERATORS.items()
                    if spec.template is not None}


def _json_response(payload: Any) -> web.Response:
    return web.Response(body=json.dumps(payload).encode(), content_type="application/json")


class ExecutorService:
    """The operators behind validation, limits and timing; `app` is the aiohttp application."""

    def __init__(self, llm: LLMBackend | None, search: SearchBackend | None,
                 config: ServerConfig | None = None):
        self.llm = llm
        self.search = search
        self.config = config or ServerConfig()
        prompts = prompt_sets.load(self.config.prompt_set)
        self.runner = OperatorRunner(llm, search, max_tokens=self.config.max_tokens,
                                     max_attempts=self.config.max_attempts,
                                     search_topk=self.config.search_topk,
                                     search_snippet_chars=self.config.search_snippet_chars,
                                     templates=prompts.templates)
        self.guard = Guard(self.config.token)
        raise_descriptor_limit()  # before the cap is derived from it
        self.connections = ConnectionLimiter(self.config.max_connections,
                                             self.config.header_timeout_s,
                                             self.config.evict_idle_s)
        self.inflight = 0
        self.peak_inflight = 0  # most operator calls in flight at once since start
        self.served = 0
        self.refused_busy = 0  # calls refused with 503 because max_inflight were running
        self.cancelled = 0  # calls cancelled because their caller went away
        self.started = time.monotonic()
        self._operator_listing = _json_response({
            "operators": [
                {"name": s.name, "description": prompts.descriptions.get(s.name, s.description),
                 "usage": s.usage, "input_fields": list(s.input_fields) or ["input"],
                 "template": prompts.templates.get(s.name), "template_fields": list(s.template_fields),
                 "required_tags": list(s.required_tags), "uses_llm": s.uses_llm}
                for s in OPERATORS.values()
            ],
            "variants": {k: list(v) for k, v in VARIANT_POOLS.items()},
        }).body

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[_front(self.guard, self.connections)])
        app.router.add_post("/execute", self.handle_execute)
        app.router.add_post("/execute_batch", self.handle_batch)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/operators", self.handle_operators)
        app.on_cleanup.append(self._close_backends)
        return app

    async def _close_backends(self, app: web.Application) -> None:
        for backend in (self.llm, self.search):
            close = getattr(backend, "aclose", None)
            if close is not None:
                await close()

    # ---------------------------------------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> Any:
        if request.content.is_eof():  # the usual small body, already received: no timer needed
            raw = await request.read()  # raises 413 past client_max_size
        else:
            try:
                async with asyncio.timeout(self.config.read_timeout_s):
                    raw = await request.read()
            except TimeoutError:
                raise RequestError(408, "read_timeout", "request body not received within "
                                   f"{self.config.read_timeout_s:g} s (server option "
                                   "--read_timeout_s)") from None
        try:
            if len(raw) > _THREAD_PARSE_BYTES:
                return await asyncio.to_thread(json.loads, raw)
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise RequestError(400, "bad_json", f"request body is not valid JSON ({exc})") from None

    def _admit(self, calls: int) -> None:
        """Refuse `calls` new operator calls if they would exceed max_inflight: 503 (retry later),
        or 413 for a batch that could never fit."""
        if calls > self.config.max_inflight:
            raise RequestError(413, "too_large", f"batch has {calls} calls; more than the "
                               f"{self.config.max_inflight} this server runs at once "
                               "(server option --max_inflight)")
        if self.inflight + calls > self.config.max_inflight:
            self.refused_busy += calls
            raise RequestError(503, "busy", f"{self.inflight} calls are running and the limit is "
                               f"{self.config.max_inflight} (server option --max_inflight); retry "
                               "after the Retry-After seconds", {"Retry-After": "1"})

    def _validate_call(self, body: Any, where: str = "request") -> tuple[str, str, str | None, Any]:
        if not isinstance(body, dict):
            raise RequestError(400, "bad_request", f"{where} must be a JSON object like "
                               '{"operator": "AnswerGenerate", "content": "..."}')
        extra = set(body) - _EXECUTE_KEYS
        if extra:
            raise RequestError(400, "bad_request", f"{where} has unknown field(s) {sorted(extra)}; "
                               f"allowed: {sorted(_EXECUTE_KEYS)}")
        operator, content = body.get("operator"), body.get("content")
        if not isinstance(operator, str):
            raise RequestError(400, "bad_request", f"{where}: 'operator' must be a string")
        if not isinstance(content, str):
            raise RequestError(400, "bad_request", f"{where}: 'content' must be a string")
        template = body.get("template")
        if template is not None and not isinstance(template, str):
            raise RequestError(400, "bad_request", f"{where}: 'template' must be a string or null")
        call_id = body.get("id")
        if call_id is not None and not isinstance(call_id, (str, int)):
            raise RequestError(400, "bad_request", f"{where}: 'id' must be a string or integer")
        if operator not in OPERATORS:
            # The single-call message is exactly the observation text the release returns.
            prefix = "" if where == "request" else f"{where}: "
            raise RequestError(422, "unknown_operator",
                               prefix + unknown_operator_text(operator, list(OPERATORS)))
        limit = self.config.max_content_chars
        if len(content) > limit:
            raise RequestError(413, "too_large", f"{where}: 'content' has {len(content)} characters;"
                               f" the limit is {limit} (server option --max_content_chars)")
        for name, value in (("content", content), ("template", template)):
            try:
                if value is not None:
                    value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
                raise RequestError(400, "bad_request", f"{where}: '{name}' is not valid Unicode "
                                   "(it contains a lone surrogate)") from None
        if template is not None:
            if len(template) > limit:
                raise RequestError(413, "too_large", f"{where}: 'template' has {len(template)} "
                                   f"characters; the limit is {limit}")
            try:
                validate_template(operator, template)
            except ValueError as exc:
                raise RequestError(422, "bad_template", f"{where}: {exc}") from None
        shape = _REGISTRY_SHAPES.get(operator) if template is None else _template_shape(template)
        if shape is not None:
            # Every placeholder's value is a part of `content` (lettered lists are no longer than
            # the tagged text they come from), so this bounds the prompt before it is built.
            literal, placeholders = shape
            bound = literal + placeholders * len(content)
            if bound > self.config.max_prompt_chars:
                raise RequestError(413, "too_large", f"{where}: the prompt could reach {bound} "
                                   f"characters ({placeholders} placeholders x {len(content)} "
                                   f"content characters + {literal}); the limit is "
                                   f"{self.config.max_prompt_chars} (server option --max_prompt_chars)")
        return operator, content, template, call_id

    async def _execute(self, operator: str, content: str, template: str | None,
                       call_id: Any) -> dict:
        start = time.perf_counter()
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            # asyncio.timeout, not wait_for: no extra task per call (measurable at >1k calls/s).
            async with asyncio.timeout(self.config.op_timeout_s):
                result = await self.runner.run(operator, content, template)
            text, kind, calls, tokens = result.text, result.error_kind, result.llm_calls, result.tokens
        except TimeoutError:
            text = (f"Operator {operator} failed: it took longer than "
                    f"{self.config.op_timeout_s:g} s. Continue without this result.")
            kind, calls, tokens = "timeout", 0, 0
        except asyncio.CancelledError:  # the caller went away: its LLM requests are cancelled too
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1
            self.served += 1
        return {"text": text, "error_kind": kind,
                "latency_ms": (time.perf_counter() - start) * 1000.0,
                "llm_calls": calls, "tokens": tokens, "id": call_id}

    async def handle_execute(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        call = self._validate_call(body)
        self._admit(1)
        return _json_response(await self._execute(*call))

    async def handle_batch(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        if not isinstance(body, dict) or set(body) != {"calls"} or not isinstance(body["calls"], list):
            raise RequestError(400, "bad_request",
                               'batch body must be {"calls": [{"operator": ..., "content": ...}, ...]}')
        calls = body["calls"]
        if len(calls) > self.config.max_batch:
            raise RequestError(413, "too_large", f"batch has {len(calls)} calls; the limit is "
                               f"{self.config.max_batch}")
        checked = [self._validate_call(c, f"calls[{i}]") for i, c in enumerate(calls)]
        self._admit(len(checked))
        results = await asyncio.gather(*(self._execute(*c) for c in checked))
        return _json_response({"results": results})

    async def handle_health(self, request: web.Request) -> web.Response:
        return _json_response({
            "status": "ok",
            "llm": getattr(self.llm, "name", None),
            "search": getattr(self.search, "name", None),
            "inflight": self.inflight,
            "peak_inflight": self.peak_inflight,
            "served": self.served,
            "refused_busy": self.refused_busy,
            "cancelled": self.cancelled,
            "connections": self.connections.open,
            "max_connections": self.connections.limit,
            "evicted": self.connections.evicted,
            "refused_connections": self.connections.refused,
            "header_timeouts": self.connections.header_timeouts,
            "uptime_s": time.monotonic() - self.started,
        })

    async def handle_operators(self, request: web.Request) -> web.Response:
        return web.Response(body=self._operator_listing, content_type="application/json")


def _local_address(request: web.Request) -> str | None:
    """The server-side address of the request's connection (None if unknown)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[0] if isinstance(sockname, tuple) else None


def _front(guard: Guard, connections: ConnectionLimiter | None = None):
    """The one middleware (each layer costs per request): the guard's checks, then the handler;
    every refusal or client error as a JSON 4xx, anything unexpected as a JSON 500 (the worker
    lives on). `connections` learns which connections are inside a handler."""

    @web.middleware
    async def front(request: web.Request, handler) -> web.StreamResponse:
        if connections is None:
            return await _guarded(request, handler)
        connections.begin(request.protocol, request.content)
        unread = False
        try:
            response = await _guarded(request, handler)
            unread = not request.content.at_eof()
            if unread:
                # Answered before its body was read whole (a refusal): reading the rest would let a
                # trickling body hold the connection after its answer; close it after the reply.
                response.force_close()
            return response
        finally:
            connections.end(request.protocol, closing=unread)

    async def _guarded(request: web.Request, handler) -> web.StreamResponse:
        try:
            guard.check(request.method, request.path, request.headers, lambda: _local_address(request))
            return await handler(request)
        except GuardError as exc:  # RequestError included
            return _error_response(exc.status, exc.kind, exc.message, exc.headers)
        except web.HTTPRequestEntityTooLarge as exc:
            return _error_response(413, "too_large", f"request body too large ({exc.text}); the "
                                   "limit is the server option --max_body_bytes")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error_response(exc.status, "http_error", f"{exc.reason}: {request.method} "
                                       f"{request.path}; endpoints: POST /execute, POST "
                                       "/execute_batch, GET /health, GET /operators")
            raise
        except Exception as exc:  # a bug, not the caller's fault; keep serving
            return _error_response(500, "internal", f"{type(exc).__name__}: {exc}")

    return front


# --------------------------------------------------------------------------------------------------
# Running the service


async def start_site(service: ExecutorService, host: str, port: int,
                     shutdown_timeout_s: float = 5.0) -> tuple[web.AppRunner, str]:
    """Start `service` on host:port (0 = a free port) in the running loop; returns (runner, url).
    `runner.cleanup()` stops it, waiting at most `shutdown_timeout_s` for calls in flight."""
    return await _start_app(service.make_app(), host, port, shutdown_timeout_s, service)


async def _start_app(app: web.Application, host: str, port: int, shutdown_timeout_s: float = 5.0,
                     service: ExecutorService | None = None) -> tuple[web.AppRunner, str]:
    """Start `app`; for an executor `service`, idle connections are closed after its
    idle_timeout_s, connections are capped (service.connections), bodies are never inflated (an
    encoded body is refused by the guard) and a handler is cancelled when its client disconnects."""
    guarded = {} if service is None else {"keepalive_timeout": service.config.idle_timeout_s,
                                          "handler_cancellation": True, "auto_decompress": False}
    runner = web.AppRunner(app, access_log=None, handle_signals=False,
                           shutdown_timeout=shutdown_timeout_s, **guarded)
    await runner.setup()
    site = (web.TCPSite(runner, host, port, backlog=1024) if service is None else
            service.connections.site(runner, host, port, backlog=1024))
    await site.start()
    bound_port = runner.addresses[0][1]  # the real port when port == 0
    return runner, f"http://{host}:{bound_port}"


@dataclass
class ServerHandle:
    """A server running in a background thread; `url` is its base URL, `stop()` shuts it down.
    `service` is the ExecutorService (None for other apps run with `serve_app_in_thread`)."""

    url: str
    service: ExecutorService | None
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _stop: asyncio.Event

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_app_in_thread(make_app: Callable[[], web.Application], host: str = "127.0.0.1",
                        port: int = 0, startup_timeout_s: float = 30.0,
                        service: ExecutorService | None = None) -> ServerHandle:
    """Run the aiohttp app built by `make_app` in a daemon thread with its own event loop.
    Returns once it accepts connections (also used by tests for fake upstream servers)."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        box["loop"], box["stop"] = loop, stop

        async def serve() -> None:
            try:
                runner, url = await _start_app(make_app(), host, port, service=service)
            except BaseException as exc:
                box["error"] = exc
                ready.set()
                return
            box["url"] = url
            ready.set()
            try:
                await stop.wait()
            finally:
                await runner.cleanup()

        try:
            loop.run_until_complete(serve())
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="workflow-r1-http", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout_s):
        raise RuntimeError(f"server did not start within {startup_timeout_s:g} s on {host}:{port}")
    if "error" in box:
        raise RuntimeError(f"server could not start on {host}:{port}: {box['error']}") from box["error"]
    return ServerHandle(box["url"], service, box["loop"], thread, box["stop"])


def start_in_thread(llm: LLMBackend | None = None, search: SearchBackend | None = None,
                    config: ServerConfig | None = None, host: str = "127.0.0.1",
                    port: int = 0, startup_timeout_s: float = 30.0) -> ServerHandle:
    """Run an executor in a daemon thread with its own event loop (the embedded default).

    `llm` defaults to FakeBackend(). Backends are used only from the server's loop, so build them
    beforehand (they create loop-bound resources lazily). Returns once the server accepts requests;
    `handle.url` is the base URL for ExecutorClient, `handle.stop()` shuts it down.
    """
    if llm is None:
        from workflow_r1.executor.fake_backend import FakeBackend
        llm = FakeBackend()
    service = ExecutorService(llm, search, config)
    return serve_app_in_thread(service.make_app, host, port, startup_timeout_s, service=service)
