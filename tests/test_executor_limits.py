"""What one request, a slow or absent caller, a stranger or a bad neighbour can do to the executor
(issue #12): prompt amplification, admission and slow-client limits, cancellation of abandoned
calls, the request guard (JSON only, loopback Host, bearer token), remote Search under fan-out, odd
LLM and retriever replies, and command-line ranges. Over real HTTP on 127.0.0.1 with in-process
fake backends. (The client's malformed-reply table is in test_executor.py; odd OpenAI replies in
test_executor_openai.py; the fuzz loop in test_executor_fuzz.py.)"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from workflow_r1.executor import (BM25Search, Completion, ExecutorClient, FakeBackend, RemoteSearch,
                                  ServerConfig, start_in_thread)
from workflow_r1.executor.connect import ExecutorConfig, ExecutorUnavailable, connect
from workflow_r1.executor.guard import TOKEN_ENV
from workflow_r1.executor.operators_exec import OperatorRunner
from workflow_r1.executor.search import SearchError
from workflow_r1.executor.server import _REGISTRY_SHAPES, serve_app_in_thread

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


def http(url: str, body: bytes | None = None, method: str = "POST",
         headers: dict | None = None) -> tuple[int, dict, dict]:
    """A raw HTTP request; returns (status, parsed JSON body, reply headers)."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def call(op: str, content: str, template: str | None = None) -> bytes:
    body = {"operator": op, "content": content}
    if template is not None:
        body["template"] = template
    return json.dumps(body).encode()


def wait_for(predicate, what: str, limit_s: float = 20.0) -> None:
    """Poll `predicate` until true; fail naming `what` if it never becomes true (a hang guard, not a
    speed assertion)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


class SlowBackend:
    """An LLM that takes `delay_s` per call and counts calls started, finished and cancelled."""

    name = "slow"

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.started = self.finished = self.cancelled = 0

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.started += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return Completion("<think>t</think><answer>a</answer>", "stop", 3)


def health(url: str) -> dict:
    return http(f"{url}/health", method="GET")[1]


# ------------------------------------------------------------------------------------------------
# 1. Prompt amplification

def test_a_template_cannot_render_a_prompt_past_the_limit():
    with start_in_thread(FakeBackend(), config=ServerConfig(max_content_chars=5000)) as server:
        # 700 placeholders x 4000 characters: a 2.8 MB prompt from a 9 KB request.
        status, reply, _ = http(f"{server.url}/execute", call("AnswerGenerate", "z" * 4000, "{input}" * 700))
        assert (status, reply["error"]) == (413, "too_large")
        assert "2800000 characters" in reply["message"] and "--max_prompt_chars" in reply["message"]
        status, reply, _ = http(f"{server.url}/execute", call("AnswerGenerate", "z" * 4000, "{input} {input}"))
        assert status == 200 and reply["error_kind"] is None
        batch = {"calls": [json.loads(call("Review", "q")), json.loads(call("Custom", "x" * 10, "{input}" * 1))]}
        assert http(f"{server.url}/execute_batch", json.dumps(batch).encode())[0] == 422  # Custom's fields
    for name, (literal, placeholders) in _REGISTRY_SHAPES.items():  # the defaults fit every operator
        assert literal + placeholders * ServerConfig.max_content_chars <= ServerConfig.max_prompt_chars, name


# ------------------------------------------------------------------------------------------------
# 2. Nothing CPU-heavy on the event loop (the linear tag scan itself: test_tags.py)

def test_unclosed_tags_and_long_searches_do_not_hold_the_loop(tmp_path):
    bm25 = BM25Search(cache_dir=tmp_path)
    threads = []
    search_sync = bm25.search_sync

    def recording(query, topk):
        threads.append(threading.get_ident())
        return search_sync(query, topk)

    bm25.search_sync = recording
    with start_in_thread(FakeBackend(), bm25) as server:
        status, reply, _ = http(f"{server.url}/execute", call("Custom", "<task>" * 10_000))
        assert status == 200 and reply["error_kind"] == "input_format"
        http(f"{server.url}/execute", call("Search", "Nile river"))
        http(f"{server.url}/execute", call("Search", "Nile river " * 200))  # 2,200 characters
    short, long = threads
    assert short != long  # the short query ran on the loop's thread, the long one on a worker


# ------------------------------------------------------------------------------------------------
# 5. A call whose caller has gone is cancelled

def test_abandoned_calls_are_cancelled():
    llm = SlowBackend(delay_s=60)
    with start_in_thread(llm, config=ServerConfig(op_timeout_s=120)) as server:
        with ExecutorClient(server.url, timeout_s=0.3) as client:
            [obs] = client.execute_many_sync([("AnswerGenerate", "q")])
        assert obs.error_kind == "client_timeout"
        wait_for(lambda: health(server.url)["inflight"] == 0, "the abandoned call ended")
        assert (llm.started, llm.cancelled, health(server.url)["cancelled"]) == (1, 1, 1)


# ------------------------------------------------------------------------------------------------
# 6. Admission control and slow clients

def test_calls_past_max_inflight_get_503_and_the_client_retries():
    llm = SlowBackend(delay_s=0.4)
    with start_in_thread(llm, config=ServerConfig(max_inflight=2, max_batch=8)) as server:
        results = []
        workers = [threading.Thread(target=lambda: results.append(
            http(f"{server.url}/execute", call("AnswerGenerate", "q"))[0])) for _ in range(2)]
        for w in workers:
            w.start()
        wait_for(lambda: health(server.url)["inflight"] == 2, "two calls running")
        status, reply, headers = http(f"{server.url}/execute", call("AnswerGenerate", "q"))
        assert (status, reply["error"], headers["Retry-After"]) == (503, "busy", "1")
        assert "--max_inflight" in reply["message"]
        for w in workers:
            w.join()
        assert results == [200, 200]
        three = {"calls": [json.loads(call("WarningOp", ""))] * 3}
        status, reply, _ = http(f"{server.url}/execute_batch", json.dumps(three).encode())
        assert (status, reply["error"]) == (413, "too_large")  # could never fit: not worth retrying
        with ExecutorClient(server.url, timeout_s=60) as client:  # 6 calls, 2 at a time
            observations = client.execute_many_sync([("AnswerGenerate", "q")] * 6)
        assert [o.error_kind for o in observations] == [None] * 6
        assert health(server.url)["peak_inflight"] == 2 and llm.finished == 8


def test_idle_and_half_sent_connections_are_closed():
    with start_in_thread(FakeBackend(), config=ServerConfig(idle_timeout_s=0.3, read_timeout_s=0.3)) as server:
        port = int(server.url.rsplit(":", 1)[1])
        idle, half_header, half_body = (socket.create_connection(("127.0.0.1", port)) for _ in range(3))
        try:
            half_header.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            half_body.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                              b"application/json\r\nContent-Length: 100\r\n\r\n{\"operator\"")
            for sock in (idle, half_header, half_body):
                sock.settimeout(20)  # a hang guard: the server closes each well before
            assert idle.recv(100) == b"" and half_header.recv(100) == b""
            reply = half_body.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408") and b"--read_timeout_s" in reply
        finally:
            for sock in (idle, half_header, half_body):
                sock.close()
        assert http(f"{server.url}/execute", call("WarningOp", ""))[0] == 200


# ------------------------------------------------------------------------------------------------
# 7. Who may call

def test_only_json_from_loopback_names():
    with start_in_thread(FakeBackend()) as server:
        body = call("AnswerGenerate", "q")
        status, reply, _ = http(f"{server.url}/execute", body, headers={"Content-Type": "text/plain"})
        assert (status, reply["error"]) == (415, "bad_content_type")
        for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
            status, reply, _ = http(f"{server.url}/execute", body, headers={"Host": host})
            assert (status, reply["error"]) == (403, "bad_host"), host
        assert http(f"{server.url}/health", method="GET", headers={"Host": "evil.example"})[0] == 403
        for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
            assert http(f"{server.url}/execute", body, headers={"Host": host})[0] == 200, host


def test_bearer_token(monkeypatch, tmp_path):
    with start_in_thread(FakeBackend(), config=ServerConfig(token="s3cret")) as server:
        body = call("AnswerGenerate", "q")
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, reply, headers = http(f"{server.url}/execute", body, headers=auth)
            assert (status, reply["error"], headers["WWW-Authenticate"]) == (401, "unauthorized", "Bearer")
        assert http(f"{server.url}/operators", method="GET")[0] == 401
        assert http(f"{server.url}/health", method="GET")[0] == 200  # liveness probes need no token
        assert http(f"{server.url}/execute", body, headers={"Authorization": "Bearer s3cret"})[0] == 200
        with ExecutorClient(server.url, timeout_s=30, token="s3cret") as client:
            [ok] = client.execute_many_sync([("AnswerGenerate", "q")])
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        with ExecutorClient(server.url, timeout_s=30) as client:  # from the environment
            [from_env] = client.execute_many_sync([("AnswerGenerate", "q")])
        with ExecutorClient(server.url, timeout_s=30, token="") as client:
            [refused] = client.execute_many_sync([("AnswerGenerate", "q")])
        monkeypatch.delenv(TOKEN_ENV)
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        with connect(ExecutorConfig(url=server.url, token_file=str(token_file))) as executor:
            [from_file] = executor.client.execute_many_sync([("AnswerGenerate", "q")])
        token_file.write_text("\n")
        with pytest.raises(ExecutorUnavailable, match="token file .* is empty"):
            connect(ExecutorConfig(url=server.url, token_file=str(token_file)))
    assert ok.error_kind is None and from_env.error_kind is None and from_file.error_kind is None
    assert refused.error_kind == "unauthorized" and "bearer token" in refused.text


# ------------------------------------------------------------------------------------------------
# 4 and 8. Remote Search under fan-out, and odd retriever replies

class SlowRetriever:
    """A Search-R1 /retrieve that takes 0.1 s per request, or answers `huge` bytes."""

    def __init__(self, huge: int = 0):
        self.huge = huge
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/retrieve", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.json()
        if self.huge:
            return web.Response(text="x" * self.huge, content_type="application/json")
        await asyncio.sleep(0.1)
        docs = [{"document": {"id": "1", "contents": f'"Doc"\n{q}'}, "score": 1.0} for q in body["queries"]]
        return web.json_response({"result": [docs]})


def test_remote_search_queues_outside_its_timeout():
    """20 searches through 2 connections to a healthy 0.1 s retriever with a 0.35 s timeout: each
    waits up to ~1 s for a connection, but only the 0.1 s at the retriever counts, so none fails
    and none is sent twice."""
    retriever = SlowRetriever()
    with serve_app_in_thread(retriever.app) as handle:
        backend = RemoteSearch(handle.url, timeout_s=0.35, max_concurrency=2, backoff_s=0.01)

        async def run():
            try:
                return await asyncio.gather(*(backend.search(f"q{i}", 1) for i in range(20)),
                                            return_exceptions=True)
            finally:
                await backend.aclose()

        results = asyncio.run(run())
    assert [r[0].text if isinstance(r, list) else repr(r) for r in results] == [f"q{i}" for i in range(20)]
    assert retriever.requests == 20


def test_oversized_or_failing_retriever_replies_do_not_reach_the_policy_with_its_address():
    retriever = SlowRetriever(huge=100_000)
    with serve_app_in_thread(retriever.app) as handle:
        with pytest.raises(SearchError, match="over the limit of 50000 bytes"):
            asyncio.run(RemoteSearch(handle.url, max_reply_bytes=50_000).search("q", 3))
        address = handle.url.split("//")[1]
    with start_in_thread(FakeBackend(), RemoteSearch(f"http://{address}", retries=0)) as server:
        with ExecutorClient(server.url, timeout_s=30) as client:
            [obs] = client.execute_many_sync([("Search", "q")])
    assert obs.error_kind == "search_error" and address not in obs.text  # that server is gone now


def test_an_empty_llm_reply_is_an_error_not_an_empty_success():
    class Silent:
        name = "silent"

        async def complete(self, prompt, max_tokens):
            return Completion("  ", "stop", 0)

    for attempts in (1, 2):
        result = asyncio.run(OperatorRunner(Silent(), max_attempts=attempts).run("Custom", "<task>t</task>"))
        assert (result.error_kind, result.llm_calls) == ("llm_bad_response", attempts)
        assert "replied with empty text" in result.text


def test_a_corpus_with_a_byte_order_mark_is_read(tmp_path):
    corpus = tmp_path / "bom.jsonl"
    corpus.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "1", "contents": '"Nile"\nA river.'}).encode() + b"\n")
    assert BM25Search(corpus, cache_dir=tmp_path).search_sync("nile", 1)[0].title == "Nile"
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"id": "1", "contents": '"Caf\u00e9"\nx'}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.jsonl is not UTF-8"):
        BM25Search(latin1, cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------------
# 9. Command-line ranges

BAD_FLAGS = {"--port": "70000", "--llm_concurrency": "0", "--llm_retries": "-1",
             "--max_body_bytes": "0", "--llm_timeout_s": "0", "--op_timeout_s": "nan",
             "--max_inflight": "0", "--idle_timeout_s": "-1", "--max_prompt_chars": "0", "--topk": "0",
             "--max_connections": "0", "--header_timeout_s": "0", "--evict_idle_s": "0"}


def test_every_bad_flag_is_one_line_before_the_server_starts():
    args = [f"{flag}={value}" for flag, value in BAD_FLAGS.items()]
    out = subprocess.run([sys.executable, "-m", "workflow_r1.executor", "--llm=fake", "--search=none", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "listening" not in out.stdout
    lines = out.stderr.strip().splitlines()
    assert sorted(line.split(": ")[1].split("=")[0] for line in lines) == sorted(BAD_FLAGS), out.stderr
    assert all(line.startswith("python -m workflow_r1.executor: --") and "must be" in line for line in lines)
    assert "--port=70000: must be an integer in [0, 65535]" in out.stderr
    for spec, message in (("--llm=openai:http://h:99999/v1", "Port out of range"),
                          ("--search=remote:http://", "has no host"),
                          ("--search=bm25:/", "corpus /: a directory; pass a FlashRAG-format jsonl file")):
        out = subprocess.run([sys.executable, "-m", "workflow_r1.executor", spec], cwd=REPO,
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode != 0 and message in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr


def test_server_config_refuses_values_out_of_range():
    with pytest.raises(ValueError, match=r"max_inflight=0: must be an integer >= 1"):
        ServerConfig(max_inflight=0)
    with pytest.raises(ValueError, match=r"op_timeout_s=0: must be a finite number > 0"):
        ServerConfig(op_timeout_s=0)
    import dataclasses
    numeric = [f.name for f in dataclasses.fields(ServerConfig) if f.name not in ("token", "prompt_set")]
    assert sorted(ServerConfig.RANGES) == sorted(numeric)  # every numeric field is checked


# ------------------------------------------------------------------------------------------------
# 10. Encoded bodies and held connections (issue #29)

def test_encoded_bodies_are_refused_before_they_are_read():
    """A gzip bomb and a body labelled gzip that is not gzip both get 415 at once (nothing is
    inflated), and /health answers meanwhile; identity stays accepted."""
    import gzip
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # 64 MiB of zeros in ~64 kB
    with start_in_thread(FakeBackend()) as server:
        for encoding, body in (("gzip", bomb), ("gzip", b'{"operator": "WarningOp"}'),
                               ("deflate", bomb), ("br", b"x"), ("gzip, identity", bomb)):
            status, reply, _ = http(f"{server.url}/execute", body,
                                    headers={"Content-Encoding": encoding})
            assert (status, reply["error"]) == (415, "bad_content_encoding"), (encoding, reply)
            assert "Content-Encoding" in reply["message"]
        assert http(f"{server.url}/execute", call("WarningOp", ""),
                    headers={"Content-Encoding": "identity"})[0] == 200
        assert health(server.url)["status"] == "ok"


def _executor_process(*flags: str, nofile: int | tuple[int, int] | None):
    """`python -m workflow_r1.executor --llm=fake` on a free 127.0.0.1 port with RLIMIT_NOFILE
    `nofile` (soft = hard, or (soft, hard); None: this process's), set by the child itself (no
    preexec_fn, which would fork this threaded process); returns (process, url)."""
    argv = ["workflow_r1.executor", "--llm=fake", "--search=none", "--host=127.0.0.1", "--port=0",
            *flags]
    limits = (nofile, nofile) if isinstance(nofile, int) else nofile
    start = (f"import resource, runpy, sys; limits = {limits!r}; limits and resource.setrlimit("
             f"resource.RLIMIT_NOFILE, limits); sys.argv = {argv!r}; "
             "runpy.run_module('workflow_r1.executor', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", start], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()
    assert "listening on " in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split("listening on ", 1)[1].split()[0]


def test_held_sockets_do_not_make_legitimate_calls_fail():
    """An executor with 128 file descriptors; 300 sockets held open (silent, or stopped in the
    middle of their headers) past its connection cap: 14 calls still all succeed, since a newcomer
    is answered 503 (the client waits and retries) until the held sockets have been quiet for
    --evict_idle_s, and then closes the one quiet longest."""
    proc, url = _executor_process("--evict_idle_s=0.5", nofile=128)
    port = int(url.rsplit(":", 1)[1])
    held = []
    try:
        for k in range(300):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                break
            if k % 2:
                sock.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            held.append(sock)
        with ExecutorClient(url, timeout_s=60, max_concurrency=1) as client:
            observations = client.execute_many_sync([("WarningOp", "")] * 14)
        assert [o.error_kind for o in observations] == [None] * 14
        state = health(url)
        assert 0 < state["connections"] <= state["max_connections"] < 128, state
        assert state["evicted"] >= 1, state
        assert state["evicted"] + state["refused_connections"] >= 300 - state["max_connections"], state
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_a_connection_that_stops_in_its_headers_is_closed_after_the_header_timeout():
    cfg = ServerConfig(idle_timeout_s=60, header_timeout_s=0.3)
    with start_in_thread(FakeBackend(), config=cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        half, silent = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
        try:
            half.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            half.settimeout(20)  # a hang guard: the server closes it well before
            assert half.recv(100) == b""
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing sent: only the idle timeout applies
                silent.recv(100)
        finally:
            half.close()
            silent.close()
        assert http(f"{server.url}/execute", call("WarningOp", ""))[0] == 200


# ------------------------------------------------------------------------------------------------
# 11. No call lost to the connection cap (issue #50)

# name: (executor flags, RLIMIT_NOFILE (None: this process's), clients, calls in flight per
# client, calls per client). Both open more connections than the cap: 4 x 32 against the 96 of a
# 128-descriptor process (the trainer's 4 x 256 against 1,024, scaled down), and 3 x 16 against
# --max_connections=16.
OVERLOADS = {
    "descriptor_limit": ((), 128, 4, 32, 96),
    "max_connections": (("--max_connections=16",), None, 3, 16, 64),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", sorted(OVERLOADS))
def test_clients_past_the_connection_cap_lose_no_call(shape):
    """Several clients, each with its own connection pool, together open more connections than
    the executor's cap: every call succeeds (slower is fine), both through the connect-time 503 the
    client waits out and through the client's resend of a call on a reused connection."""
    flags, nofile, clients, concurrency, calls = OVERLOADS[shape]
    proc, url = _executor_process("--fake_delay_s=0.05", "--evict_idle_s=1", *flags, nofile=nofile)
    results: dict[int, list] = {}

    def run(k: int) -> None:
        with ExecutorClient(url, timeout_s=200, max_concurrency=concurrency) as client:
            results[k] = client.execute_many_sync([("AnswerGenerate", f"q{k}.{i}")
                                                   for i in range(calls)])

    try:
        workers = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        state = health(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    observations = [o for k in sorted(results) for o in results[k]]
    assert len(observations) == clients * calls
    lost = [(o.error_kind, o.text) for o in observations if o.error_kind is not None]
    assert not lost, f"{len(lost)} of {len(observations)} calls lost, e.g. {lost[:3]}; {state}"
    assert state["served"] == clients * calls, state  # each call ran once
    assert state["evicted"] + state["refused_connections"] > 0, state  # the cap was reached


def _trickle(socks: list, stop: threading.Event) -> threading.Thread:
    """A thread sending a byte to each of `socks` every 0.1 s until `stop`; a socket the server
    closed (to make room, or after its reply) is dropped from the list."""
    def run() -> None:
        while not stop.wait(0.1):
            for sock in list(socks):
                try:
                    sock.send(b" ")
                except OSError:
                    socks.remove(sock)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_slow_bodies_and_held_sockets_leave_health_and_a_client_served():
    """No token, a cap of 16 connections; 48 sockets held by another client: 16 whose headers are
    complete and whose bodies trickle in a byte at a time (each inside a handler, reading its body:
    they fill the cap), then 8 silent, 8 stopped in their headers and 16 more trickling ones (all
    refused). Once the held ones have been quiet for --evict_idle_s, /health answers 200 at once
    (6 of 6) and 24 calls all succeed."""
    cfg = ServerConfig(max_connections=16, evict_idle_s=0.5, header_timeout_s=60, read_timeout_s=60)
    with start_in_thread(FakeBackend(), config=cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        held, slow = [], []
        stop = threading.Event()
        try:
            for k in range(48):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                if 24 <= k < 32:
                    sock.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
                elif k < 16 or k >= 32:
                    sock.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: 100000\r\n\r\n{\"operator\"")
                    slow.append(sock)
                held.append(sock)

            dribbler = _trickle(slow, stop)
            time.sleep(1.0)  # every held socket is now older than evict_idle_s
            checks = [http(f"{server.url}/health", method="GET") for _ in range(6)]
            assert [status for status, _, _ in checks] == [200] * 6, checks[0][1]
            with ExecutorClient(server.url, timeout_s=60, max_concurrency=4) as client:
                observations = client.execute_many_sync([("AnswerGenerate", f"q{i}")
                                                         for i in range(24)])
            assert [o.error_kind for o in observations] == [None] * 24, observations[:2]
            status, state, _ = http(f"{server.url}/health", method="GET")
            assert status == 200 and state["evicted"] > 0, state
        finally:
            stop.set()
            for sock in held:
                sock.close()


def _assert_served(url: str, health_checks: int, token: str | None = None) -> None:
    """/health answers 200 every time, and a new client's 8 calls all succeed."""
    checks = [http(f"{url}/health", method="GET")[0] for _ in range(health_checks)]
    assert checks == [200] * health_checks, checks
    with ExecutorClient(url, timeout_s=20, max_concurrency=4, token=token) as client:
        observations = client.execute_many_sync([("AnswerGenerate", f"q{i}") for i in range(8)])
    assert [o.error_kind for o in observations] == [None] * 8, observations[:2]


@pytest.mark.timeout(120)
def test_a_silent_socket_flood_leaves_health_and_new_clients_served():
    """A client opens silent sockets at 20 a second, 3x cap / --evict_idle_s, so every slot of the
    cap (32) is younger than evict_idle_s (5 s) at any time. Sockets that have sent nothing for 1 s go
    first, so /health answers 200 every time (10 of 10) and a new client's 8 calls all succeed."""
    cfg = ServerConfig(max_connections=32, evict_idle_s=5.0, idle_timeout_s=60)
    with start_in_thread(FakeBackend(), config=cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        held, stop = [], threading.Event()

        def flood() -> None:
            while not stop.wait(0.05):
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    pass

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            wait_for(lambda: health(server.url).get("connections", 0) >= 31, "the cap filled", 30)
            time.sleep(2.0)  # the flood goes on: the cap stays full
            _assert_served(server.url, health_checks=10)
            state = health(server.url)
        finally:
            stop.set()
            flooder.join()
            for sock in held:
                sock.close()
    assert state["evicted"] > 0, state


@pytest.mark.timeout(120)
def test_bodies_trickling_after_their_refusal_leave_health_and_a_client_served():
    """A token is required; 24 sockets send a request without it whose 100 kB body trickles in a byte
    at a time. Each is answered 401 at once and its connection closed after the reply (its body is
    not read), so with a cap of 16 /health answers 200 (6 of 6) and a client with the token
    makes 8 calls."""
    cfg = ServerConfig(max_connections=16, evict_idle_s=5.0, header_timeout_s=60, read_timeout_s=60,
                       token="s3cret")
    with start_in_thread(FakeBackend(), config=cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        slow, stop = [], threading.Event()
        for _ in range(24):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"operator\"")
            slow.append(sock)

        dribbler = _trickle(slow, stop)
        try:
            time.sleep(1.0)
            _assert_served(server.url, health_checks=6, token="s3cret")
        finally:
            stop.set()
            dribbler.join()
            for sock in slow:
                sock.close()


def test_a_connection_with_a_call_in_flight_is_never_closed_for_a_newcomer():
    """A cap of 4 connections, each carrying a 1.5 s call, all older than --evict_idle_s: a fifth
    connection is answered 503 `busy` with Retry-After, and the four calls finish."""
    llm = SlowBackend(delay_s=1.5)
    with start_in_thread(llm, config=ServerConfig(max_connections=4, evict_idle_s=0.2)) as server:
        results = []
        with ExecutorClient(server.url, timeout_s=60, max_concurrency=4) as client:
            calls = threading.Thread(target=lambda: results.extend(
                client.execute_many_sync([("AnswerGenerate", "q")] * 4)))
            calls.start()
            wait_for(lambda: llm.started == 4, "four calls running")
            time.sleep(0.4)  # the four connections are now older than evict_idle_s
            status, reply, headers = http(f"{server.url}/health", method="GET")
            calls.join()
    assert (status, reply["error"], headers["Retry-After"]) == (503, "busy", "1")
    assert "--evict_idle_s" in reply["message"]
    assert [o.error_kind for o in results] == [None] * 4 and llm.cancelled == 0


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    """Started with a soft RLIMIT_NOFILE of 128 under a hard one of 1,024, the executor caps its
    connections at 3/4 of 1,024, not of 128."""
    proc, url = _executor_process(nofile=(128, 1024))
    try:
        assert health(url)["max_connections"] == 768
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class _ClosingServer:
    """A raw HTTP/1.1 server that answers the first request of its first connection with an
    executor reply (keep-alive) and closes the connection, without a byte of reply, at every
    other request (or at every request when `answer_fresh`: except a connection's first). It
    stands in for an executor that closes a pooled connection just as the client reuses it."""

    def __init__(self, answer_fresh: bool):
        self.answer_fresh = answer_fresh
        self.requests = 0
        self.connections = 0
        self.url = ""

    def reply(self, connection: int, request: int) -> bool:
        if self.answer_fresh:
            return request == 0
        return connection == 0 and request == 0

    def __enter__(self) -> "_ClosingServer":
        ready = threading.Event()
        outer = self

        class Conn(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport, self.buf, self.n = transport, b"", 0
                self.index = outer.connections
                outer.connections += 1

            def data_received(self, data):
                self.buf += data
                head, sep, rest = self.buf.partition(b"\r\n\r\n")
                if not sep:
                    return
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                if len(rest) < length:
                    return
                self.buf = rest[length:]
                outer.requests += 1
                n, self.n = self.n, self.n + 1
                if not outer.reply(self.index, n):
                    self.transport.close()
                    return
                body = json.dumps({"text": "ok", "error_kind": None}).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

        def main() -> None:
            loop = asyncio.new_event_loop()
            server = loop.run_until_complete(loop.create_server(Conn, "127.0.0.1", 0))
            self._loop, self._server = loop, server
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ready.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_call_on_a_reused_connection_closed_before_any_reply_is_sent_once_more():
    with _ClosingServer(answer_fresh=True) as server:  # reused connections are closed at once
        with ExecutorClient(server.url, timeout_s=30, max_concurrency=1) as client:
            first, second = (client.execute_many_sync([("AnswerGenerate", "q")])[0] for _ in range(2))
        assert (first.error_kind, second.error_kind, second.text) == (None, None, "ok")
        assert (server.requests, server.connections) == (3, 2)  # the second call was sent twice
    with _ClosingServer(answer_fresh=True) as server:
        with ExecutorClient(server.url, timeout_s=30, max_concurrency=2) as client:
            pair = client.execute_many_sync([("AnswerGenerate", "q")] * 2)  # two connections
            [third] = client.execute_many_sync([("AnswerGenerate", "q")])
        assert [o.error_kind for o in pair] == [None, None] and server.connections == 2
        # Once only: cut off on one pooled connection, resent on the other, cut off again.
        assert third.error_kind == "client_connection" and server.requests == 2 + 2
    with _ClosingServer(answer_fresh=False) as server:  # only the very first request is answered
        with ExecutorClient(server.url, timeout_s=30, max_concurrency=1) as client:
            first, second, third = (client.execute_many_sync([("AnswerGenerate", "q")])[0]
                                    for _ in range(3))
        assert first.error_kind is None
        assert second.error_kind == third.error_kind == "client_connection"
        # Once only: the second call's resend, on a new connection, is not sent again; the third
        # call went out on a new connection (none was pooled), so it is not sent again at all.
        assert server.requests == 1 + 2 + 1, server.requests
