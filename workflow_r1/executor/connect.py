"""The executor a trainer or an evaluation talks to: a running service, or one started in-process.

    with connect(ExecutorConfig(url="http://10.0.0.5:8000")) as ex: ex.client.execute_many_sync(calls)
    with connect(ExecutorConfig(url="http://10.0.0.5:8000,http://10.0.0.6:8000")) as ex: ...  # replicas
    with connect(ExecutorConfig(llm="local", search="bm25")) as ex: ...   # embedded on 127.0.0.1

Several comma-separated URLs are replicas of one service: their calls are spread round-robin
(`executor.replicas.ReplicaClient`). Either way the caller gets a client over HTTP, so the embedded
default exercises exactly the code path of a separate service (docs/design.md). An unreachable URL is one line naming it and
the fix, before any rollout starts.
"""
from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from typing import Any

from workflow_r1 import bounds
from workflow_r1.executor.client import ExecutorClient
from workflow_r1.executor.factory import build_llm, build_search
from workflow_r1.executor.guard import load_token
from workflow_r1.executor.replicas import ReplicaClient, split_urls
from workflow_r1.executor.options import ProcessConfig, ServerConfig
from workflow_r1.executor.server import ServerHandle, start_in_thread


class ExecutorUnavailable(RuntimeError):
    """The configured executor cannot be reached or started; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    """The `executor` config section.

    url: base URL of a running executor service ("" = start one in this process on 127.0.0.1);
      several comma-separated URLs are replicas, and calls are spread over them.
    llm, search: for the embedded executor, the backend specs of `executor.factory` (llm: fake |
      local[:DIR] | openai:URL; search: none | bm25[:CORPUS] | remote:URL).
    model, api_key: model name and key for an `openai:` LLM ("" key: $OPERATOR_API_KEY).
    search_topk: passages per Search call (embedded; paper preset 5).
    search_snippet_chars: each Search passage cut to a snippet of at most this many characters,
      rendered as "Title / Snippet" blocks (paper preset 160); 0 = full text as "Title / Text"
      (embedded; docs/paper.md, Search).
    max_tokens, max_attempts: the executor LLM's generation limit per attempt and the attempts of the
      repair loop (paper 1024 and 3; embedded).
    local_max_batch: most prompts the embedded local LLM generates together.
    local_dtype: weight and compute dtype of the embedded local LLM.
    timeout_s: limit of one operator call as the client sees it, seconds.
    max_concurrency: calls in flight from this client.
    token_file: file holding the bearer token sent to a service started with one ("" =
      $WORKFLOW_R1_EXECUTOR_TOKEN if set; an embedded executor needs none).
    The settings it shares with a service take their defaults from `options.ServerConfig` and
    `options.ProcessConfig`.
    """

    url: str = ""
    llm: str = "local"
    search: str = "bm25"
    model: str = "default"
    api_key: str = ""
    search_topk: int = ServerConfig.search_topk
    search_snippet_chars: int = ServerConfig.search_snippet_chars
    max_tokens: int = ServerConfig.max_tokens
    max_attempts: int = ServerConfig.max_attempts
    local_max_batch: int = ProcessConfig.local_max_batch
    local_dtype: str = ProcessConfig.local_dtype
    timeout_s: float = 600.0
    max_concurrency: int = 256
    token_file: str = ""

    def __post_init__(self):
        for url in split_urls(self.url):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"executor.url={url!r} must start with http:// or https:// ('' = embedded; "
                                 "replicas separated by commas)")
        c = bounds.check
        c("executor.search_topk", self.search_topk, 1, 1000)
        c("executor.search_snippet_chars", self.search_snippet_chars, 0, 1 << 20, note=" (0: full text)")
        c("executor.max_tokens", self.max_tokens, 1, bounds.MAX_TOKENS)
        c("executor.max_attempts", self.max_attempts, 1, 100)
        c("executor.local_max_batch", self.local_max_batch, 1, 1 << 16)
        c("executor.timeout_s", self.timeout_s, 0, 7 * 86400, above=True, note=" seconds")
        c("executor.max_concurrency", self.max_concurrency, 1, 1 << 16)


@dataclasses.dataclass
class Executor:
    """A connected executor: `client` for calls, `url`, and the in-process server if embedded."""

    client: ExecutorClient | ReplicaClient
    url: str
    server: ServerHandle | None = None

    @property
    def embedded(self) -> bool:
        """Whether this executor runs in-process (until `close`)."""
        return self.server is not None

    def close(self) -> None:
        """Closes the client and stops an embedded server, dropping its backends (and their memory)."""
        self.client.close()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def health(url: str, timeout_s: float = 10.0) -> dict:
    """GET {url}/health; raises ExecutorUnavailable with a one-line message when it fails."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ExecutorUnavailable(
            f"executor {url} is unreachable ({reason}); start one with `python -m workflow_r1.executor "
            "--port=8000 --llm=...` or set --config.executor.url='' for an embedded executor") from None


def connect(cfg: ExecutorConfig) -> Executor:
    """Connects to `cfg.url`, or starts an executor in this process when it is empty."""
    urls = split_urls(cfg.url)
    if urls:
        for url in urls:
            health(url)
        try:
            token = load_token(cfg.token_file)
        except ValueError as exc:
            raise ExecutorUnavailable(f"executor.token_file: {exc}") from None
        if len(urls) > 1:
            return Executor(ReplicaClient(urls, timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency,
                                          token=token), cfg.url)
        return Executor(ExecutorClient(urls[0], timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency,
                                       token=token), urls[0])
    try:
        llm = build_llm(cfg.llm, api_key=cfg.api_key, model=cfg.model, concurrency=cfg.max_concurrency,
                        local_max_batch=cfg.local_max_batch, local_dtype=cfg.local_dtype)
        search = build_search(cfg.search)
    except (ValueError, FileNotFoundError) as exc:
        raise ExecutorUnavailable(f"embedded executor: {exc}") from None
    server = start_in_thread(llm, search, ServerConfig(search_topk=cfg.search_topk, max_tokens=cfg.max_tokens,
                                                        max_attempts=cfg.max_attempts, op_timeout_s=cfg.timeout_s,
                                                        search_snippet_chars=cfg.search_snippet_chars))
    client = ExecutorClient(server.url, timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency, token="")
    return Executor(client, server.url, server)
