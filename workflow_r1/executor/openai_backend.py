"""The executor LLM on an OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, hosted APIs):
`OpenAIBackend`, one user message per call, temperature 0, retries with exponential backoff and
jitter (seconds), a server's `Retry-After` honoured, a limit on requests in flight and on the reply
body (bytes). The interface it implements (`Completion`, `BackendError`) is backends.py's.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from typing import Any

import aiohttp

from workflow_r1.executor.backends import BackendError, Completion
from workflow_r1.executor.httpio import (UPSTREAM_REPLY_BYTES, ReplyTooLarge, check_url, read_capped,
                                         retry_after_s)

_log = logging.getLogger(__name__)


class OpenAIBackend:
    """Chat-completions client for an OpenAI-compatible server.

    Args:
        base_url: e.g. "http://localhost:8000/v1" (the request goes to base_url + "/chat/completions").
        api_key: sent as a Bearer token; "" sends none.
        model: the `model` field of the request.
        temperature: 0 as in the paper's executor.
        timeout_s: limit on one HTTP attempt, seconds.
        retries: extra attempts after a timeout, connection error, HTTP 429/5xx or unparseable
            body; other 4xx (bad request, bad key) fail at once, since repeating cannot help.
        backoff_base_s, backoff_max_s: delay before retry i is uniform in
            [0.5, 1] * min(backoff_max_s, backoff_base_s * 2**i) ("equal jitter").
        max_concurrency: requests in flight at once from this backend.
        max_reply_bytes: longest reply body read, bytes; a longer one fails the call at once
            (llm_bad_response), since asking again would bring the same.
        seed: seeds the jitter, for reproducible tests.

    A 429 or 503 with `Retry-After` waits what the server asks (up to MAX_RETRY_AFTER_S) before the
    next attempt, if that is longer than the backoff.
    """

    name = "openai"

    def __init__(self, base_url: str, api_key: str = "", model: str = "default",
                 temperature: float = 0.0, timeout_s: float = 600.0, retries: int = 2,
                 backoff_base_s: float = 0.5, backoff_max_s: float = 8.0,
                 max_concurrency: int = 256, max_reply_bytes: int = UPSTREAM_REPLY_BYTES,
                 seed: int | None = None):
        check_url(base_url, "OpenAI-compatible base URL", "http://localhost:8000/v1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.model = model
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_concurrency = max_concurrency
        self.max_reply_bytes = max_reply_bytes
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        # Created lazily inside the running loop: aiohttp sessions are bound to their event loop.
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_concurrency)
            self._session = aiohttp.ClientSession(connector=connector)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    def _backoff_s(self, retry_index: int) -> float:
        cap = min(self.backoff_max_s, self.backoff_base_s * (2 ** retry_index))
        return cap * (0.5 + 0.5 * self._rng.random())

    async def _attempt(self, session: aiohttp.ClientSession, payload: dict) -> Completion:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with session.post(self.url, json=payload, headers=headers, timeout=timeout) as resp:
            try:
                body = await read_capped(resp, self.max_reply_bytes)
            except ReplyTooLarge as exc:
                raise _AttemptError("llm_bad_response", f"the LLM server's {exc}", retryable=False) from None
            if resp.status != 200:
                snippet = body[:300].decode("utf-8", "replace")
                raise _AttemptError(
                    "llm_http_error", f"HTTP {resp.status} from the LLM server: {snippet}",
                    retryable=resp.status == 429 or resp.status >= 500,
                    wait_s=retry_after_s(resp.headers.get("Retry-After")),
                )
        try:
            data = json.loads(body)
            choice = data["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str) or not text:
                # null (or "") content: nothing to show the policy; a new attempt may do better.
                raise TypeError(f"message.content is {text!r}, not a non-empty string")
            finish = choice.get("finish_reason") or "stop"
            usage = data.get("usage") or {}
            tokens = _token_count(usage.get("completion_tokens"))
            prompt_tokens = _token_count(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details")
            cached = _token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as exc:
            raise _AttemptError(
                "llm_bad_response",
                f"unparseable chat-completions reply ({type(exc).__name__}: {exc})",
                retryable=True,
            ) from None
        return Completion(text=text, finish_reason=str(finish), tokens=tokens,
                          prompt_tokens=prompt_tokens, cached_tokens=min(cached, prompt_tokens))

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        session = self._ensure_session()
        assert self._semaphore is not None
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "max_tokens": max_tokens,
        }
        last: _AttemptError | None = None
        async with self._semaphore:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(max(self._backoff_s(attempt - 1), (last and last.wait_s) or 0.0))
                try:
                    return await self._attempt(session, payload)
                except _AttemptError as exc:
                    last = exc
                except asyncio.TimeoutError:
                    last = _AttemptError(
                        "llm_timeout", f"no reply from the LLM server within {self.timeout_s:g} s",
                        retryable=True)
                except aiohttp.ClientError as exc:
                    last = _AttemptError(
                        "llm_connection", f"cannot reach the LLM server ({type(exc).__name__})",
                        retryable=True, detail=f"{type(exc).__name__}: {exc}")
                if not last.retryable:
                    break
        assert last is not None
        # The policy reads the message; the server's address stays in the log (it may be internal).
        _log.warning("LLM request to %s failed after %d attempt(s): %s", self.url, attempt + 1,
                     last.detail or last.message)
        raise BackendError(last.kind, f"{last.message} (after {attempt + 1} attempt(s))")


class _AttemptError(Exception):
    """One failed attempt; `wait_s` is the server's Retry-After, seconds (None: not given)."""

    def __init__(self, kind: str, message: str, retryable: bool, wait_s: float | None = None,
                 detail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.wait_s = wait_s
        self.detail = detail  # for the log only: may name internal hosts


def _token_count(value: Any) -> int:
    """A reported token count as an int; 0 (unknown) for anything that is not a finite count
    (null, a string, 1e400), so a server's odd usage field never fails a good reply."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return int(value) if math.isfinite(value) and 0 <= value < 2**53 else 0
