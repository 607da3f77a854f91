"""A seeded fuzz loop against the executor over real HTTP: a few thousand requests mutated from
valid ones (bytes flipped, inserted and cut; JSON values swapped for odd types; placeholders and
tags repeated; foreign hosts, content types, tokens, methods and paths; raw malformed HTTP), 16 at
a time. Every reply must be below 500, every request must finish (no hang), the server must stay
healthy and its memory flat."""
import asyncio
import json
import random
import re

import aiohttp
import pytest

from workflow_r1.executor import BM25Search, FakeBackend, ServerConfig, start_in_thread

pytestmark = pytest.mark.timeout(180)

REQUESTS = 3000
CONCURRENCY = 16
WARMUP = 300  # requests before the memory baseline (first-use allocations, caches)

SEEDS = [
    {"operator": "AnswerGenerate", "content": "What is the capital of France?"},
    {"operator": "Custom", "content": "<task>sum 2 and 3</task><instruction>be brief</instruction>"},
    {"operator": "Review", "content": "<question>q</question><solution>s</solution>", "id": 3},
    {"operator": "Revise", "content": "<question>q</question><solution>s</solution><feedback>f</feedback>"},
    {"operator": "ScEnsemble", "content": "<query>q</query><solution>a</solution><solution>b</solution>"},
    {"operator": "MultiAnswerGenerate", "content": "q", "id": "x"},
    {"operator": "Search", "content": "Nile river"},
    {"operator": "WarningOp", "content": ""},
    {"operator": "AnswerGenerate", "content": "q",
     "template": "Q: {input}\nThink in <think></think>, answer in <answer></answer>."},
]
ODD_VALUES = [None, True, 0, -1, 10**30, 1.5, float("inf"), "", "x" * 6000, [], {}, ["q"],
              {"operator": "Search"}, "{input}" * 700, "{input}" * 20, "<task>" * 800,
              "<solution>s</solution>" * 200, "\u0000\ud800", "Search", "Review"]
PIECES = [b"{", b"}", b"[", b"]", b'"', b"\\", b"\\u", b"\\ud800", b"1e999", b"null", b",", b":",
          b"\x00", b"\xff", b"{input}" * 300, b"<task>" * 300, b"</task>", b" " * 50]
HOSTS = [None] * 12 + ["evil.example", "localhost", "", "[::1]", "a" * 300]
CONTENT_TYPES = ["application/json"] * 14 + ["text/plain", "", "application/json; charset=utf-8",
                                            "multipart/form-data; boundary=x"]
ROUTES = [("POST", "/execute")] * 8 + [("POST", "/execute_batch")] * 3 + [
    ("GET", "/health"), ("GET", "/operators"), ("PUT", "/execute"), ("POST", "/nowhere"),
    ("GET", "/execute")]


def mutate_json(rng: random.Random) -> bytes:
    body = dict(rng.choice(SEEDS))
    for _ in range(rng.randrange(0, 3)):
        key = rng.choice([*body, "template", "extra", "id"])
        body[key] = rng.choice(ODD_VALUES)
    if rng.random() < 0.3:
        body = {"calls": [body] * rng.randrange(0, 10)}
    return json.dumps(body).encode()  # NaN and Infinity as JSON accepts them


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(4)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 1:
            data[at:at] = rng.choice(PIECES)
        elif op == 2:
            del data[at:at + rng.randrange(1, 20)]
        else:
            data = data[:at]
    return bytes(data)


def random_request(rng: random.Random, url: str, port: int):
    """("http", method, url, body, headers) or ("raw", bytes) for a malformed HTTP request."""
    body = mutate_json(rng)
    if rng.random() < 0.35:
        body = mutate_bytes(rng, body)
    if rng.random() < 0.05:
        head = (f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body) + rng.choice([0, 0, 5, -3])}\r\n\r\n").encode()
        return ("raw", mutate_bytes(rng, head) + body)
    method, path = rng.choice(ROUTES)
    headers = {}
    content_type = rng.choice(CONTENT_TYPES)
    if content_type:
        headers["Content-Type"] = content_type
    host = rng.choice(HOSTS)
    if host is not None:
        headers["Host"] = host
    if rng.random() < 0.05:
        headers["Authorization"] = rng.choice(["Bearer x", "Basic eA==", "Bearer " + "y" * 5000])
    return ("http", method, url + path, body if method != "GET" else None, headers)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


async def send_raw(port: int, data: bytes) -> int:
    """Send `data` on a fresh connection; the status of the reply, or 0 if the server just closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        line = await reader.readline()
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
    finally:
        writer.close()


def test_fuzzed_requests_never_get_5xx_hang_or_grow_memory(tmp_path):
    config = ServerConfig(max_content_chars=5000, max_prompt_chars=50_000, max_body_bytes=64_000,
                          max_batch=8, read_timeout_s=0.5, idle_timeout_s=1.0)
    rng = random.Random(20261130)
    statuses: dict[int, int] = {}
    with start_in_thread(FakeBackend(), BM25Search(cache_dir=tmp_path), config) as server:
        port = int(server.url.rsplit(":", 1)[1])
        requests = [random_request(rng, server.url, port) for _ in range(REQUESTS)]

        async def run() -> int:
            baseline = 0
            queue = list(enumerate(requests))
            timeout = aiohttp.ClientTimeout(total=20)  # a request that hangs fails the test
            async with aiohttp.ClientSession(timeout=timeout, skip_auto_headers=["Content-Type"]) as session:
                async def worker() -> None:
                    nonlocal baseline
                    while queue:
                        i, request = queue.pop(0)
                        if i == WARMUP:
                            baseline = rss_bytes()
                        if request[0] == "raw":
                            status = await asyncio.wait_for(send_raw(port, request[1]), 20)
                        else:
                            _, method, url, body, headers = request
                            async with session.request(method, url, data=body, headers=headers) as resp:
                                status = resp.status
                                reply = await resp.read()
                            if status >= 400:
                                assert json.loads(reply)["message"], (request, reply[:300])
                        statuses[status] = statuses.get(status, 0) + 1
                        assert status < 500, (status, request)

                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            return baseline

        baseline = asyncio.run(run())
        growth = rss_bytes() - baseline
        async def health() -> dict:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{server.url}/health") as resp:
                    return await resp.json()
        state = asyncio.run(health())
    assert sum(statuses.values()) == REQUESTS
    assert {200, 400, 403, 413, 415, 422} <= set(statuses), statuses  # many paths were exercised
    assert growth < 200 * 2**20, f"RSS grew {growth / 2**20:.0f} MB over the fuzz loop"
    assert state["status"] == "ok" and state["inflight"] == 0
