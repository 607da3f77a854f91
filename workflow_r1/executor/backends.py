"""The executor LLM's interface, which every backend implements: `await backend.complete(prompt,
max_tokens)` returns a `Completion` or raises `BackendError`, whose `kind` becomes the observation's
`error_kind`.

The backends, one module each:
- `openai_backend.OpenAIBackend`: any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang,
  hosted APIs); temperature 0, retries with exponential backoff and jitter, a concurrency limit.
- `local_backend.LocalBackend`: batches concurrent requests into one call of a synchronous
  `generate_fn(prompts, max_tokens)` run in a worker thread (the embedded JAX sampler, built by
  `local_backend.make_local_generate_fn` from a checkpoint directory via `load_sampler`).
- `fake_backend.FakeBackend`: deterministic and instant, for tests and load benchmarks.

Transport retries live in the backend; the operator's repair loop (missing tags, truncation) lives
in `operators_exec.py`, which marks each earlier reply it quotes back with `REPAIR_MARKER`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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
