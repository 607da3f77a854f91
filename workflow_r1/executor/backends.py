"""Executor LLM backends behind one interface: `await backend.complete(prompt, max_tokens)`.

- `OpenAIBackend`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, hosted APIs);
  temperature 0, retries with exponential backoff and jitter, a concurrency limit.
- `LocalBackend`: batches concurrent requests into one call of a synchronous
  `generate_fn(prompts, max_tokens)` run in a worker thread (the embedded JAX sampler, built by
  `make_local_generate_fn` from a checkpoint directory via `load_sampler`).
- `FakeBackend`: deterministic and instant, for tests and load benchmarks.

A backend either returns a `Completion` or raises `BackendError` with a `kind` that becomes the
observation's `error_kind`. Transport retries live in the backend; the operator's repair loop
(missing tags, truncation) lives in `operators_exec.py`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import math
import random
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import aiohttp

from workflow_r1.executor.httpio import (UPSTREAM_REPLY_BYTES, ReplyTooLarge, check_url, read_capped,
                                         retry_after_s)

if TYPE_CHECKING:  # JAX is imported lazily (see load_sampler)
    import jax

    from workflow_r1.sampler import Sampler

_log = logging.getLogger(__name__)

# Marks each earlier reply the repair loop quotes back to the executor LLM (operators_exec.py);
# FakeBackend counts it to know which attempt it is answering.
REPAIR_MARKER = "----- Your previous reply (attempt"


@dataclass(frozen=True)
class Completion:
    """One LLM reply: text, finish_reason ("stop" | "length" | ...), completion tokens (0 if unknown),
    and, where the server reports them (OpenAI-compatible `usage`), prompt tokens and the part of
    them served from the server's prompt cache (0 if unknown)."""

    text: str
    finish_reason: str
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class BackendError(Exception):
    """An LLM call failed after the backend's own retries. `kind` names the failure for metrics:
    llm_timeout | llm_http_error | llm_bad_response | llm_connection | llm_error."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


@runtime_checkable
class LLMBackend(Protocol):
    """The executor LLM. `prompt` is one user message; the backend applies any chat template."""

    name: str

    async def complete(self, prompt: str, max_tokens: int) -> Completion: ...


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible endpoint


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


# --------------------------------------------------------------------------------------------------
# Embedded local model

GenerateFn = Callable[[list[str], int], Sequence[tuple]]


@dataclass
class _Pending:
    prompt: str
    max_tokens: int
    future: asyncio.Future = field(repr=False)


@dataclass
class _LoopQueue:
    """The requests of one event loop and the task that batches them (asyncio objects are bound to
    the loop that made them)."""
    wakeup: asyncio.Event
    worker: asyncio.Task | None = None
    queue: list[_Pending] = field(default_factory=list)


class LocalBackend:
    """Serve an in-process model by batching concurrent requests into one `generate_fn` call.

    `generate_fn(prompts: list[str], max_tokens: int) -> list[(text, finish_reason)]` (a third
    element, the completion token count, is optional) is synchronous and runs in one dedicated
    worker thread, one batch at a time, so the event loop keeps serving while the model generates.
    A batch is formed from the requests waiting when the worker becomes free: it starts at the
    oldest request, waits up to `max_wait_ms` for more to arrive, and holds at most `max_batch`
    requests that share one `max_tokens`.

    One backend may serve several event loops (rlmopt's optimizer on the main loop and an
    in-process executor's loop in its thread share one loaded model): each loop gets its own queue
    and batching task, and the single worker thread runs their batches one at a time. `aclose`
    releases the calling loop's share; the worker thread stops when no loop is left, and a later
    request starts it again (so closing one user of a shared model does not break the others).
    """

    name = "local"

    def __init__(self, generate_fn: GenerateFn, max_batch: int = 32, max_wait_ms: float = 5.0):
        if max_batch < 1:
            raise ValueError(f"LocalBackend max_batch must be >= 1, got {max_batch}")
        self.generate_fn = generate_fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.batch_sizes: list[int] = []  # one entry per generate_fn call, for metrics and tests
        self._loops: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        self._lock = threading.Lock()  # _loops and _pool are shared by the loops' threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _loop_queue(self) -> _LoopQueue:
        loop = asyncio.get_running_loop()
        with self._lock:
            for other in [lp for lp in self._loops if lp.is_closed()]:
                del self._loops[other]
            lq = self._loops.get(loop)
            if lq is None:
                lq = self._loops[loop] = _LoopQueue(asyncio.Event())
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="local-llm")
        if lq.worker is None or lq.worker.done():
            lq.worker = loop.create_task(self._batch_loop(lq))
        return lq

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        lq = self._loop_queue()
        pending = _Pending(prompt, max_tokens, asyncio.get_running_loop().create_future())
        lq.queue.append(pending)
        lq.wakeup.set()
        return await pending.future

    def _take_batch(self, lq: _LoopQueue) -> list[_Pending]:
        head = lq.queue[0]
        batch = [p for p in lq.queue if p.max_tokens == head.max_tokens][: self.max_batch]
        chosen = {id(p) for p in batch}
        lq.queue = [p for p in lq.queue if id(p) not in chosen]
        return batch

    async def _batch_loop(self, lq: _LoopQueue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await lq.wakeup.wait()
            lq.wakeup.clear()
            while lq.queue:
                if len(lq.queue) < self.max_batch and self.max_wait_s > 0:
                    await asyncio.sleep(self.max_wait_s)  # let concurrent requests join the batch
                lq.queue = [p for p in lq.queue if not p.future.done()]  # drop cancelled
                if not lq.queue:
                    break
                batch = self._take_batch(lq)
                self.batch_sizes.append(len(batch))
                prompts = [p.prompt for p in batch]
                try:
                    with self._lock:
                        pool = self._pool
                    if pool is None:
                        raise RuntimeError("the backend was closed")
                    outputs = await loop.run_in_executor(
                        pool, self.generate_fn, prompts, batch[0].max_tokens)
                    if len(outputs) != len(batch):
                        raise ValueError(
                            f"generate_fn returned {len(outputs)} outputs for {len(batch)} prompts")
                    results = [_to_completion(out) for out in outputs]
                except Exception as exc:  # the model failing must not kill the server
                    error = BackendError("llm_error", f"local generate_fn failed: "
                                                      f"{type(exc).__name__}: {exc}")
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(error)
                    continue
                for p, result in zip(batch, results):
                    if not p.future.done():
                        p.future.set_result(result)

    async def aclose(self) -> None:
        """Stops the calling loop's batching task; the worker thread too when no loop is left."""
        with self._lock:
            lq = self._loops.pop(asyncio.get_running_loop(), None)
            live = [lp for lp in self._loops if not lp.is_closed()]
            pool = self._pool if not live else None
            if pool is not None:
                self._pool = None
        if lq is not None and lq.worker is not None:
            lq.worker.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _to_completion(out: tuple) -> Completion:
    text, finish = out[0], out[1]
    tokens = int(out[2]) if len(out) > 2 else 0
    return Completion(text=str(text), finish_reason=str(finish), tokens=tokens)


# JAX is imported only inside the two functions below, so executors that call a remote LLM never
# start it.

def load_sampler(checkpoint_dir: str, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                 **kw: Any) -> Sampler:
    """Loads an HF checkpoint directory (weights + tokenizer) into a `workflow_r1.sampler.Sampler`.

    dtype: weights and compute dtype, a dtype or its name (default float32); mesh: a
    jax.sharding.Mesh to shard over. Extra keywords go to `Sampler` (cache_size, impl, ...).
    """
    import jax.numpy as jnp
    import transformers

    from workflow_r1.model import checkpoint
    from workflow_r1.sampler import Sampler

    dtype = jnp.float32 if dtype is None else jnp.dtype(dtype)
    model = checkpoint.load(checkpoint_dir, mesh=mesh, dtype=dtype, param_dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint_dir))
    return Sampler(model, tokenizer, mesh=mesh, **kw)


def make_local_generate_fn(checkpoint_dir: str, *, temperature: float = 0.0, top_p: float = 1.0,
                           top_k: int = 0, seed: int = 0, stop_strings: Sequence[str] = (),
                           **sampler_kw: Any) -> GenerateFn:
    """generate_fn over our JAX sampler for `--llm local:DIR` (greedy by default, stop at EOS).

    `generate_fn(prompts: list[str], max_tokens: int) -> list[(text, finish_reason)]`: each prompt
    becomes a single user message with the chat template applied. Extra keywords go to
    `load_sampler` / `Sampler` (dtype, cache_size, mesh, ...). The sampler is `generate_fn.sampler`.
    """
    from workflow_r1.sampler.text import generate_text
    sampler = load_sampler(checkpoint_dir, **sampler_kw)

    def generate_fn(prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
        if not prompts:
            return []
        return generate_text(sampler, list(prompts), max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop_strings=stop_strings)

    generate_fn.sampler = sampler
    return generate_fn


# --------------------------------------------------------------------------------------------------
# Deterministic fake

_ECHO_CHARS = 4000  # how much of the prompt a fake reply quotes back (enough to check routing)
_REPAIR_ATTEMPT_RE = re.compile(re.escape(REPAIR_MARKER) + r" (\d+)\)")


class FakeBackend:
    """Deterministic, instant executor LLM for tests and benchmarks.

    It answers with every tag among think/answer/feedback that the prompt mentions, in that order.
    The `<think>` (or `<feedback>`) text quotes the prompt (angle brackets replaced) so a test can
    check which request a reply belongs to. The answer is the value of the first key of `answers`
    found in the prompt (case-insensitive), else `default_answer`.

    Fault injection, decided per request from the attempt number (read from the REPAIR_MARKER
    headers in the prompt), so it is independent of concurrency: the first `faulty_attempts` attempts of every
    request misbehave as `fault` says: "omit_tags" (no tags at all), "truncate" (finish_reason
    "length" and the answer tag cut off), or "error" (raise BackendError "llm_error").
    `delay_s` sleeps before replying, to simulate a slow model.
    """

    name = "fake"

    def __init__(self, answers: Mapping[str, str] | None = None, default_answer: str = "fake answer",
                 fault: str = "none", faulty_attempts: int = 0, delay_s: float = 0.0):
        if fault not in ("none", "omit_tags", "truncate", "error"):
            raise ValueError(f"FakeBackend fault {fault!r}; use none|omit_tags|truncate|error")
        self.answers = {k.lower(): v for k, v in (answers or {}).items()}
        self.default_answer = default_answer
        self.fault = fault
        self.faulty_attempts = faulty_attempts
        self.delay_s = delay_s
        self.calls = 0

    def _answer_for(self, prompt: str) -> str:
        low = prompt.lower()
        for key, value in self.answers.items():
            if key in low:
                return value
        return self.default_answer

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        # The attempt number is the highest quoted earlier attempt (quoted replies may themselves
        # quote the marker, so counting occurrences would overshoot).
        attempt = max((int(n) for n in _REPAIR_ATTEMPT_RE.findall(prompt)), default=0)
        faulty = self.fault != "none" and attempt < self.faulty_attempts
        if faulty and self.fault == "error":
            raise BackendError("llm_error", "FakeBackend injected error")
        digest = hashlib.sha256(prompt.encode()).hexdigest()[:8]
        echo = prompt[:_ECHO_CHARS].replace("<", "‹").replace(">", "›")
        reasoning = f"[fake {digest}] I read the request: {echo}"
        answer = self._answer_for(prompt)
        if faulty and self.fault == "omit_tags":
            text = f"{reasoning}\nMy answer is {answer}."
            return Completion(text, "stop", len(text.split()))
        parts = []
        if "<think>" in prompt:
            parts.append(f"<think>{reasoning}</think>")
        if "<feedback>" in prompt:
            parts.append(f"<feedback>{reasoning}\nThe solution looks correct.</feedback>")
        if "<answer>" in prompt:
            parts.append(f"<answer>{answer}</answer>")
        if not parts:
            parts.append(reasoning)
        text = "\n".join(parts)
        if faulty and self.fault == "truncate":
            text = text[: text.rfind("<")] if "<" in text else text[: len(text) // 2]
            return Completion(text, "length", len(text.split()))
        return Completion(text, "stop", len(text.split()))
