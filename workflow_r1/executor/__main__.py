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

The flags are generated from the settings dataclasses (`options.ServerConfig`: limits and the
operators' settings, e.g. `--max_tokens` and `--max_attempts` of the operator LLM's repair loop;
`options.ProcessConfig`: address, backends, token, shutdown), one per field with its default and
help, so a new field is a new flag. `--topk` is the older name of `--search_topk`.
"""
from __future__ import annotations

import asyncio
import signal
import sys

from absl import app, flags

from workflow_r1.executor.factory import build_llm, build_search
from workflow_r1.executor.guard import TOKEN_ENV, is_loopback
from workflow_r1.executor.options import define_flags, flag_errors, from_flags
from workflow_r1.executor.server import ExecutorService, start_site

__all__ = ["build_llm", "build_search", "new_event_loop", "main"]

# One flag per field of options.ServerConfig and options.ProcessConfig (`--help` lists them).
_FLAGS = define_flags(flags.FLAGS)


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


_PROG = "python -m workflow_r1.executor"


def check_flags() -> list[str]:
    """One line per numeric flag outside its range (empty when all are valid)."""
    return flag_errors(_FLAGS, flags.FLAGS)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    errors = check_flags()
    if errors:
        raise SystemExit("\n".join(f"{_PROG}: {line}" for line in errors))
    # Backends are built before the loop starts (they open loop-bound resources lazily), so a bad
    # option fails fast with its message instead of inside the event loop.
    try:
        config, p = from_flags(_FLAGS)
        llm = build_llm(p.llm, api_key=p.llm_api_key(), model=p.model, timeout_s=p.llm_timeout_s,
                        retries=p.llm_retries, concurrency=p.llm_concurrency,
                        local_max_batch=p.local_max_batch, local_max_wait_ms=p.local_max_wait_ms,
                        local_dtype=p.local_dtype, fake_delay_s=p.fake_delay_s,
                        max_reply_bytes=p.max_reply_bytes)
        search = build_search(p.search, timeout_s=p.search_timeout_s, max_reply_bytes=p.max_reply_bytes)
        service = ExecutorService(llm, search, config)  # reads and checks the prompt set
    except (ValueError, OSError) as exc:  # OSError: an unreadable corpus or checkpoint
        raise SystemExit(f"{_PROG}: {exc}") from None
    if not config.token and not is_loopback(p.host):
        print(f"{_PROG}: warning: listening on {p.host} without a bearer token: anyone who "
              f"can reach this port can spend its LLM; set ${TOKEN_ENV} or --token_file",
              file=sys.stderr, flush=True)
    banner = f" (llm={p.llm}, search={p.search}{', token required' if config.token else ''})"
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop(p.loop)) as runner:
            runner.run(serve(service, p.host, p.port, p.shutdown_timeout_s, banner))
    except OSError as exc:  # the address is in use, or not one of this machine's
        raise SystemExit(f"{_PROG}: cannot listen on {p.host}:{p.port} ({exc.strerror or exc})") from None
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
