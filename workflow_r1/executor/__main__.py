"""Command line: run the executor service until SIGINT/SIGTERM.

    python -m workflow_r1.executor --port=8000 --llm=fake --search=bm25
    python -m workflow_r1.executor --llm=openai:http://localhost:8001/v1 --model=Qwen/Qwen2.5-32B-Instruct
    python -m workflow_r1.executor --search=remote:http://localhost:8002 --llm=fake
    python -m workflow_r1.executor --llm=local    # the bundled real model, on this machine

Prints one line "workflow_r1.executor listening on http://HOST:PORT" once it accepts requests
(with --port=0 the port is picked by the OS, so read it from that line).
Environment fallbacks (as in the release): OPERATOR_BASE_URL, OPERATOR_API_KEY, OPERATOR_MODEL_NAME;
the bearer token: $WORKFLOW_R1_EXECUTOR_TOKEN unless --token_file is given (docs/executor.md).
Every numeric flag is range-checked before anything starts: each bad one is one line naming the
flag and its valid range.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

from absl import app, flags

from workflow_r1.executor.factory import build_llm, build_search
from workflow_r1.executor.guard import TOKEN_ENV, is_loopback, load_token
from workflow_r1.executor.httpio import UPSTREAM_REPLY_BYTES
from workflow_r1.executor.ranges import BACKEND_RANGES, range_errors
from workflow_r1.executor.server import ExecutorService, ServerConfig, start_site

__all__ = ["build_llm", "build_search", "new_event_loop", "main"]

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Bind address.")
_PORT = flags.DEFINE_integer("port", 8000, "Port; 0 picks a free one.")
_LLM = flags.DEFINE_string("llm", "fake", "Executor LLM: fake | openai:URL | local | "
                           "local:CHECKPOINT_DIR (local alone: the bundled model).")
# The key's default is read in main, not here, so --help never prints it.
_API_KEY = flags.DEFINE_string("api_key", "", "API key of the OpenAI-compatible server; empty: "
                               "$OPERATOR_API_KEY.")
_MODEL = flags.DEFINE_string("model", os.environ.get("OPERATOR_MODEL_NAME", "default"),
                             "Model name sent to the OpenAI-compatible server.")
_LLM_TIMEOUT_S = flags.DEFINE_float("llm_timeout_s", 600.0, "Per HTTP attempt to the LLM, seconds.")
_LLM_RETRIES = flags.DEFINE_integer("llm_retries", 2, "Retries of a failed LLM HTTP request.")
_LLM_CONCURRENCY = flags.DEFINE_integer("llm_concurrency", 256, "LLM requests in flight at once.")
_LOCAL_MAX_BATCH = flags.DEFINE_integer("local_max_batch", 32,
                                        "Most prompts the local backend generates together.")
_LOCAL_MAX_WAIT_MS = flags.DEFINE_float("local_max_wait_ms", 5.0,
                                        "How long the local backend waits to fill a batch, ms.")
_LOCAL_DTYPE = flags.DEFINE_enum("local_dtype", "bfloat16", ["bfloat16", "float32"],
                                 "Weight and compute dtype of a local model.")
_FAKE_DELAY_S = flags.DEFINE_float("fake_delay_s", 0.0, "Simulated fake-LLM latency, seconds.")
_SEARCH = flags.DEFINE_string("search", "bm25",
                              "Search: bm25 | bm25:CORPUS.jsonl | remote:URL | none.")
_SEARCH_TIMEOUT_S = flags.DEFINE_float("search_timeout_s", 30.0,
                                       "Per request to a remote retrieval server, seconds (time "
                                       "queued for a connection not included).")
_MAX_REPLY_BYTES = flags.DEFINE_integer("max_reply_bytes", UPSTREAM_REPLY_BYTES,
                                        "Longest reply read from the LLM or the retrieval server, "
                                        "bytes; a longer one is an error.")
_TOPK = flags.DEFINE_integer("topk", 3, "Passages per Search call.")
_SEARCH_SNIPPET_CHARS = flags.DEFINE_integer(
    "search_snippet_chars", ServerConfig.search_snippet_chars, "Cut each Search passage to a snippet of at most this many characters "
    "(Title / Snippet blocks, the paper preset's 160); 0: full text.")
_PROMPT_SET = flags.DEFINE_string(
    "prompt_set", ServerConfig.prompt_set, "Executor prompts of calls that send no template: faithful | concise | a "
    "directory of prompt files (docs/paper.md, Prompt sets).")
_MAX_CONTENT_CHARS = flags.DEFINE_integer("max_content_chars", ServerConfig.max_content_chars,
                                          "Longest call content (and template) accepted, chars.")
_MAX_PROMPT_CHARS = flags.DEFINE_integer("max_prompt_chars", ServerConfig.max_prompt_chars,
                                         "Longest LLM prompt a call may render from its template "
                                         "and content, chars.")
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", ServerConfig.max_body_bytes,
                                       "Longest request body accepted, bytes.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", ServerConfig.max_batch,
                                  "Most calls in one /execute_batch request.")
_MAX_INFLIGHT = flags.DEFINE_integer("max_inflight", ServerConfig.max_inflight,
                                     "Most operator calls running at once; beyond: 503 with "
                                     "Retry-After.")
_OP_TIMEOUT_S = flags.DEFINE_float("op_timeout_s", ServerConfig.op_timeout_s,
                                   "Wall-clock limit on one operator call, seconds.")
_READ_TIMEOUT_S = flags.DEFINE_float("read_timeout_s", ServerConfig.read_timeout_s,
                                     "Limit on receiving one request body, seconds.")
_IDLE_TIMEOUT_S = flags.DEFINE_float("idle_timeout_s", ServerConfig.idle_timeout_s,
                                     "Close a connection without a complete request for this "
                                     "long, seconds.")
_HEADER_TIMEOUT_S = flags.DEFINE_float("header_timeout_s", ServerConfig.header_timeout_s,
                                       "Close a connection whose request headers are not complete "
                                       "this long after their first byte, seconds.")
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", ServerConfig.max_connections,
                                        "Most open connections (lowered to 3/4 of the open-file "
                                        "limit); at the cap the oldest idle one is closed.")
_TOKEN_FILE = flags.DEFINE_string("token_file", "", "File holding the bearer token callers must "
                                  f"send; empty: ${TOKEN_ENV}, if set (else no token).")
_SHUTDOWN_TIMEOUT_S = flags.DEFINE_float("shutdown_timeout_s", 30.0,
                                         "On SIGTERM, how long to let calls in flight finish, s.")
_LOOP = flags.DEFINE_enum("loop", "auto", ["auto", "uvloop", "asyncio"],
                          "Event loop; auto uses uvloop when installed (about 1.5x the calls/s).")


async def serve(service: ExecutorService, host: str, port: int, shutdown_timeout_s: float,
                banner: str = "") -> None:
    """Run `service` on host:port in the running loop until SIGINT or SIGTERM."""
    runner, url = await start_site(service, host, port, shutdown_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"workflow_r1.executor listening on {url}{banner}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop if `kind` is uvloop (or auto and it is installed), else asyncio."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
            return uvloop.new_event_loop()
        except ImportError:
            if kind == "uvloop":
                raise SystemExit("--loop=uvloop: the uvloop package is not installed; "
                                 "use --loop=asyncio")
    return asyncio.new_event_loop()


# The ServerConfig fields set from flags of the same name (ranges in ServerConfig.RANGES).
_SERVER_FLAGS = {"max_content_chars": _MAX_CONTENT_CHARS, "max_prompt_chars": _MAX_PROMPT_CHARS,
                 "max_body_bytes": _MAX_BODY_BYTES, "max_batch": _MAX_BATCH,
                 "max_inflight": _MAX_INFLIGHT, "op_timeout_s": _OP_TIMEOUT_S,
                 "read_timeout_s": _READ_TIMEOUT_S, "idle_timeout_s": _IDLE_TIMEOUT_S,
                 "header_timeout_s": _HEADER_TIMEOUT_S, "max_connections": _MAX_CONNECTIONS,
                 "search_topk": _TOPK, "search_snippet_chars": _SEARCH_SNIPPET_CHARS}
_BACKEND_FLAGS = {"port": _PORT, "llm_timeout_s": _LLM_TIMEOUT_S, "llm_retries": _LLM_RETRIES,
                  "llm_concurrency": _LLM_CONCURRENCY, "local_max_batch": _LOCAL_MAX_BATCH,
                  "local_max_wait_ms": _LOCAL_MAX_WAIT_MS, "fake_delay_s": _FAKE_DELAY_S,
                  "search_timeout_s": _SEARCH_TIMEOUT_S, "max_reply_bytes": _MAX_REPLY_BYTES,
                  "shutdown_timeout_s": _SHUTDOWN_TIMEOUT_S}
_PROG = "python -m workflow_r1.executor"


def check_flags() -> list[str]:
    """One line per numeric flag outside its range (empty when all are valid)."""
    ranges = {**{flag.name: ServerConfig.RANGES[field] for field, flag in _SERVER_FLAGS.items()},
              **BACKEND_RANGES}
    values = {flag.name: flag.value for flag in (*_SERVER_FLAGS.values(), *_BACKEND_FLAGS.values())}
    return range_errors(values, ranges, prefix="--")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    errors = check_flags()
    if errors:
        raise SystemExit("\n".join(f"{_PROG}: {line}" for line in errors))
    # Backends are built before the loop starts (they open loop-bound resources lazily), so a bad
    # option fails fast with its message instead of inside the event loop.
    try:
        token = load_token(_TOKEN_FILE.value)
        config = ServerConfig(token=token, prompt_set=_PROMPT_SET.value,
                              **{name: flag.value for name, flag in _SERVER_FLAGS.items()})
        api_key = _API_KEY.value or os.environ.get("OPERATOR_API_KEY", "")
        llm = build_llm(_LLM.value, api_key=api_key, model=_MODEL.value,
                        timeout_s=_LLM_TIMEOUT_S.value, retries=_LLM_RETRIES.value,
                        concurrency=_LLM_CONCURRENCY.value, local_max_batch=_LOCAL_MAX_BATCH.value,
                        local_max_wait_ms=_LOCAL_MAX_WAIT_MS.value, local_dtype=_LOCAL_DTYPE.value,
                        fake_delay_s=_FAKE_DELAY_S.value, max_reply_bytes=_MAX_REPLY_BYTES.value)
        search = build_search(_SEARCH.value, timeout_s=_SEARCH_TIMEOUT_S.value,
                              max_reply_bytes=_MAX_REPLY_BYTES.value)
        service = ExecutorService(llm, search, config)  # reads and checks the prompt set
    except (ValueError, OSError) as exc:  # OSError: an unreadable corpus or checkpoint
        raise SystemExit(f"{_PROG}: {exc}") from None
    if not token and not is_loopback(_HOST.value):
        print(f"{_PROG}: warning: listening on {_HOST.value} without a bearer token: anyone who "
              f"can reach this port can spend its LLM; set ${TOKEN_ENV} or --token_file",
              file=sys.stderr, flush=True)
    banner = f" (llm={_LLM.value}, search={_SEARCH.value}{', token required' if token else ''})"
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop(_LOOP.value)) as runner:
            runner.run(serve(service, _HOST.value, _PORT.value, _SHUTDOWN_TIMEOUT_S.value, banner))
    except OSError as exc:  # the address is in use, or not one of this machine's
        raise SystemExit(f"{_PROG}: cannot listen on {_HOST.value}:{_PORT.value} ({exc.strerror or exc})") from None
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
