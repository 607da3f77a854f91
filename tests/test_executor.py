"""Executor service over real HTTP on 127.0.0.1 (random free port) with the fake LLM backend:
every operator, input-format errors, the repair loop, concurrency and routing, 4xx handling,
a bounded fuzz loop, client-side failures, and the command-line entry point."""
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from workflow_r1.task.operators import OPERATORS, WARNING_TEXT
from workflow_r1.executor import (BM25Search, ExecutorClient, FakeBackend, ServerConfig,
                                  start_in_thread)

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
    return BM25Search(cache_dir=tmp_path_factory.mktemp("bm25"))


@pytest.fixture(scope="module")
def server(bm25):
    llm = FakeBackend(answers={"capital of France": "Paris"})
    with start_in_thread(llm, bm25, ServerConfig(max_content_chars=5000, max_body_bytes=64_000,
                                                 max_batch=8)) as handle:
        yield handle


@pytest.fixture()
def client(server):
    c = ExecutorClient(server.url, timeout_s=60)
    yield c
    c.close()


def http(url: str, body: bytes | None = None, method: str = "POST",
         content_type: str = "application/json") -> tuple[int, dict]:
    """A raw HTTP request (no client library in between); returns (status, parsed JSON body)."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _execute_many_in_new_loop(client: ExecutorClient, calls):
    """The async API: `client.execute_many(calls)` in a fresh event loop, its session closed after."""
    async def run():
        try:
            return await client.execute_many(calls)
        finally:
            await client.aclose()

    return asyncio.run(run())


# ------------------------------------------------------------------------------------------------
# Every operator

def test_every_operator_over_http(client):
    calls = [
        ("AnswerGenerate", "What is the capital of France?"),
        ("Custom", "<task>What is the capital of France?</task><instruction>Answer briefly.</instruction>"),
        ("PromptOptimizer", "capital of France? be precise"),
        ("Review", "<question>What is the capital of France?</question><solution>Lyon</solution>"),
        ("Revise", "<question>What is the capital of France?</question><solution>Lyon</solution>"
                   "<feedback>Lyon is not the capital.</feedback>"),
        ("MultiAnswerGenerate", "What is the capital of France?"),
        ("ScEnsemble", "<query>What is the capital of France?</query><solution>Paris</solution>"
                       "<solution>Lyon</solution><solution>Paris</solution>"),
        ("Search", "capital of France"),
        ("WarningOp", ""),
    ]
    assert {op for op, _ in calls} == set(OPERATORS)
    obs = dict(zip([op for op, _ in calls], client.execute_many_sync(calls)))
    assert all(o.error_kind is None for o in obs.values()), {k: o.text for k, o in obs.items()}

    # "Op thought process: ...\n\nOp answer: ..." for think+answer operators (docs/paper.md, Operators).
    for op in ("AnswerGenerate", "PromptOptimizer", "Revise", "ScEnsemble"):
        text = obs[op].text
        assert text.startswith(f"{op} thought process: "), op
        assert text.endswith(f"\n\n{op} answer: Paris"), op
        assert obs[op].llm_calls == 1 and obs[op].tokens > 0
    assert obs["Custom"].text == "Custom answer: Paris"
    assert obs["Review"].text.startswith("Review feedback: ")
    assert obs["MultiAnswerGenerate"].text == "\n\n".join(
        f"[Answer {i}]\nAnswerGenerate answer: Paris" for i in (1, 2, 3))
    assert obs["MultiAnswerGenerate"].llm_calls == 3
    # ScEnsemble lists the candidates as A:, B:, C: in the executor prompt (echoed by the fake).
    assert "A: Paris\n\nB: Lyon\n\nC: Paris" in obs["ScEnsemble"].text
    # The input fields reach the executor prompt.
    assert "Lyon is not the capital." in obs["Revise"].text
    assert obs["Search"].text.startswith(
        "Search results for 'capital of France':\n\n[1] Title: France\nText: France is a country")
    assert obs["Search"].llm_calls == 0
    assert obs["WarningOp"].text == WARNING_TEXT


FORMAT_ERRORS = [
    ("Custom", "no tags here", "<task></task>"),
    ("Review", "<solution>s</solution>", "<question></question>"),
    ("Review", "<question>q</question>", "<solution></solution>"),
    ("Revise", "<solution>s</solution><feedback>f</feedback>", "<question></question>"),
    ("Revise", "<question>q</question><feedback>f</feedback>", "<solution></solution>"),
    ("Revise", "<question>q</question><solution>s</solution>", "<feedback></feedback>"),
    ("ScEnsemble", "<solution>a</solution><solution>b</solution>", "<query></query>"),
    ("ScEnsemble", "<query>q</query>", "<solution></solution>"),
    ("ScEnsemble", "<query>q</query><solution>only one</solution>", "at least two"),
    ("AnswerGenerate", "   ", "after the colon"),
    ("MultiAnswerGenerate", "", "after the colon"),
    ("PromptOptimizer", "\n", "after the colon"),
    ("Search", " ", "after the colon"),
]


@pytest.mark.parametrize("op,content,mentions", FORMAT_ERRORS)
def test_missing_input_fields_give_the_format_error_observation(client, op, content, mentions):
    [obs] = client.execute_many_sync([(op, content)])
    assert obs.error_kind == "input_format"
    assert obs.text.startswith(f"I did not follow the required format for the {op} operator.")
    assert mentions in obs.text
    assert obs.llm_calls == 0


def test_custom_needs_only_one_of_task_and_instruction(client):
    [obs] = client.execute_many_sync([("Custom", "<instruction>Say hi.</instruction>")])
    assert obs.error_kind is None and obs.text == "Custom answer: fake answer"


# ------------------------------------------------------------------------------------------------
# Repair loop over HTTP

@pytest.mark.parametrize("fault,faulty,calls,repaired", [
    ("omit_tags", 1, 2, True),
    ("omit_tags", 2, 3, True),
    ("omit_tags", 3, 3, False),  # all three attempts fail: the last raw reply is returned
    ("truncate", 1, 2, True),
    ("truncate", 3, 3, False),
])
def test_repair_loop(fault, faulty, calls, repaired):
    llm = FakeBackend(fault=fault, faulty_attempts=faulty, default_answer="42")
    with start_in_thread(llm) as handle, ExecutorClient(handle.url, timeout_s=60) as c:
        [obs] = c.execute_many_sync([("AnswerGenerate", "What is 6 * 7?")])
    assert obs.llm_calls == calls and llm.calls == calls
    assert obs.error_kind is None
    if repaired:
        assert obs.text.startswith("AnswerGenerate thought process: ")
        assert obs.text.endswith("AnswerGenerate answer: 42")
        # The repair prompt quoted the failed replies back (the fake echoes its prompt).
        assert "previous reply (attempt 1)" in obs.text
    else:
        assert "AnswerGenerate answer:" not in obs.text  # raw passthrough, as in the release
        assert "previous reply (attempt 2)" in obs.text


def test_backend_error_becomes_an_error_observation():
    llm = FakeBackend(fault="error", faulty_attempts=1)
    with start_in_thread(llm) as handle, ExecutorClient(handle.url, timeout_s=60) as c:
        obs = c.execute_many_sync([("Review", "<question>q</question><solution>s</solution>"),
                                   ("MultiAnswerGenerate", "q")])
    assert [o.error_kind for o in obs] == ["llm_error", "llm_error"]
    assert obs[0].text.startswith("Operator Review failed: the executor LLM did not answer")
    assert obs[1].llm_calls == 3


# ------------------------------------------------------------------------------------------------
# Concurrency and routing

def test_200_simultaneous_calls_are_routed_to_their_callers():
    llm = FakeBackend(delay_s=0.3)  # every call sleeps, so they must overlap to finish
    n = 200
    calls = [("AnswerGenerate", f"routing probe {i:03d}-{i * 7919 % 1000:03d}") for i in range(n)]
    with start_in_thread(llm) as handle:
        client = ExecutorClient(handle.url, timeout_s=60, max_concurrency=n)
        observations = _execute_many_in_new_loop(client, calls)
        peak = handle.service.peak_inflight
    assert len(observations) == n
    for (_, content), obs in zip(calls, observations):
        assert obs.error_kind is None
        assert obs.text.count("routing probe") == 1 and content in obs.text
    assert peak >= 20  # the calls really were in flight together


def test_sync_api_from_several_threads(server):
    from concurrent.futures import ThreadPoolExecutor
    client = ExecutorClient(server.url, timeout_s=60)

    def work(t):
        calls = [("AnswerGenerate", f"thread {t} question {i}") for i in range(20)]
        return t, client.execute_many_sync(calls)

    try:
        with ThreadPoolExecutor(4) as pool:
            for t, observations in pool.map(work, range(4)):
                for i, obs in enumerate(observations):
                    assert f"thread {t} question {i}" in obs.text
    finally:
        client.close()


# ------------------------------------------------------------------------------------------------
# Validation and 4xx

def test_health_and_operator_listing(server):
    status, health = http(f"{server.url}/health", method="GET")
    assert status == 200 and health["status"] == "ok"
    assert health["llm"] == "fake" and health["search"] == "bm25"
    status, listing = http(f"{server.url}/operators", method="GET")
    assert status == 200
    by_name = {o["name"]: o for o in listing["operators"]}
    assert set(by_name) == set(OPERATORS)
    for name, spec in OPERATORS.items():
        assert by_name[name]["description"] == spec.description
        assert by_name[name]["usage"] == spec.usage
        assert by_name[name]["template"] == spec.template
    assert listing["variants"]["workflow_r1_search"][5] == "Search"


BAD_REQUESTS = [
    ("malformed JSON", b'{"operator": "AnswerGenerate", "content": ', 400, "bad_json"),
    ("not an object", b'["AnswerGenerate", "q"]', 400, "bad_request"),
    ("missing content", b'{"operator": "AnswerGenerate"}', 400, "bad_request"),
    ("content not a string", b'{"operator": "AnswerGenerate", "content": 5}', 400, "bad_request"),
    ("unknown field", b'{"operator": "Search", "content": "q", "topk": 9}', 400, "bad_request"),
    ("bad id type", b'{"operator": "Search", "content": "q", "id": [1]}', 400, "bad_request"),
    ("unknown operator", b'{"operator": "Teleport", "content": "q"}', 422, "unknown_operator"),
    ("content too long", json.dumps({"operator": "AnswerGenerate", "content": "x" * 5001}).encode(),
     413, "too_large"),
    ("body too large", b'{"operator": "Search", "content": "' + b"y" * 70_000 + b'"}', 413, "too_large"),
    ("bad template", b'{"operator": "AnswerGenerate", "content": "q", "template": "{nope}"}',
     422, "bad_template"),
    ("template on Search", b'{"operator": "Search", "content": "q", "template": "{input}"}',
     422, "bad_template"),
    ("invalid UTF-8", b'{"operator": "Search", "content": "\xff\xfe"}', 400, "bad_json"),
    ("lone surrogate", b'{"operator": "AnswerGenerate", "content": "a\\ud800b"}', 400, "bad_request"),
    ("deep nesting", b"[" * 20_000 + b"]" * 20_000, 400, "bad_json"),
]


@pytest.mark.parametrize("case,body,status,kind", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_4xx_with_a_message(server, case, body, status, kind):
    got, reply = http(f"{server.url}/execute", body)
    assert (got, reply["error"]) == (status, kind)
    assert reply["message"]


def test_unknown_operator_message_lists_the_operators(server):
    _, reply = http(f"{server.url}/execute", b'{"operator": "Teleport", "content": "q"}')
    assert reply["message"].startswith("Unknown operator: Teleport. Available operators: [")
    assert all(name in reply["message"] for name in OPERATORS)


def test_wrong_method_and_path_are_json_4xx(server):
    assert http(f"{server.url}/execute", method="GET")[0] == 405
    status, reply = http(f"{server.url}/nowhere", b"{}")
    assert status == 404 and "POST /execute" in reply["message"]


def test_batch_endpoint(server):
    body = {"calls": [{"operator": "Search", "content": "Mount Everest", "id": "a"},
                      {"operator": "Custom", "content": "bad", "id": 7},
                      {"operator": "AnswerGenerate", "content": "capital of France?"}]}
    status, reply = http(f"{server.url}/execute_batch", json.dumps(body).encode())
    assert status == 200
    results = reply["results"]
    assert [r["id"] for r in results] == ["a", 7, None]
    assert "[1] Title: Mount Everest" in results[0]["text"]
    assert results[1]["error_kind"] == "input_format"
    assert results[2]["text"].endswith("AnswerGenerate answer: Paris")
    assert all(r["latency_ms"] >= 0 for r in results)

    too_many = {"calls": [{"operator": "WarningOp", "content": ""}] * 9}
    assert http(f"{server.url}/execute_batch", json.dumps(too_many).encode())[0] == 413
    one_bad = {"calls": [{"operator": "WarningOp", "content": ""}, {"operator": "Nope", "content": ""}]}
    status, reply = http(f"{server.url}/execute_batch", json.dumps(one_bad).encode())
    assert status == 422 and reply["message"].startswith("calls[1]")
    assert http(f"{server.url}/execute_batch", b'{"calls": 3}')[0] == 400


def test_template_override_is_used(client):
    template = ("CANDIDATE PROMPT 17. Question: {input}\n"
                "Think in <think></think>, answer in <answer></answer>.")
    [obs] = asyncio.run(_one(client, "AnswerGenerate", "capital of France?", template))
    assert obs.error_kind is None
    assert "CANDIDATE PROMPT 17. Question: capital of France?" in obs.text
    assert obs.text.endswith("AnswerGenerate answer: Paris")


async def _one(client, op, content, template=None):
    try:
        return [await client.execute(op, content, template)]
    finally:
        await client.aclose()


def test_fuzz_only_4xx_and_server_stays_healthy(server):
    rng = random.Random(1234)
    pieces = [b"{", b"}", b"[", b"]", b'"operator"', b'"content"', b":", b",", b'"Search"',
              b'"AnswerGenerate"', b"null", b"1e999", b'"\\ud800"', b"\x00", b"\xff", b" ", b'"x"']
    statuses = []

    def random_body() -> bytes:
        kind = rng.randrange(5)
        if kind == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        if kind == 1:
            return b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        if kind == 2:  # valid JSON of the wrong shape
            value = rng.choice([None, 1, "s", [1, 2], {"operator": None}, {"content": "x"},
                                {"operator": "Search", "content": ["q"]},
                                {"operator": "Custom" * rng.randrange(2, 5), "content": "q"}])
            return json.dumps(value).encode()
        if kind == 3:  # oversized content or body
            return json.dumps({"operator": "Review", "content": "z" * rng.choice([5001, 80_000])}).encode()
        return json.dumps({"operator": "AnswerGenerate", "content": "q",
                           "template": rng.choice(["{", "{input!s}", "{0}", "{input.x}", ""])}).encode()

    for _ in range(150):
        path = rng.choice(["/execute", "/execute", "/execute_batch"])
        status, reply = http(f"{server.url}{path}", random_body(),
                             content_type=rng.choice(["application/json", "text/plain"]))
        statuses.append(status)
        assert 400 <= status < 500, (status, reply)
        assert reply["message"]
    assert len(set(statuses)) >= 3  # the loop exercised several error paths
    status, health = http(f"{server.url}/health", method="GET")
    assert status == 200 and health["status"] == "ok"
    [obs] = ExecutorClient(server.url).execute_many_sync([("Search", "Nile river")])
    assert "[1] Title: Nile" in obs.text


# ------------------------------------------------------------------------------------------------
# Failures seen by the client never raise

def test_unreachable_executor_gives_error_observations():
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ExecutorClient(f"http://127.0.0.1:{port}", timeout_s=10)
    try:
        obs = client.execute_many_sync([("AnswerGenerate", "q"), ("Search", "q")])
    finally:
        client.close()
    assert [o.error_kind for o in obs] == ["client_connection", "client_connection"]
    assert obs[0].text.startswith("Operator AnswerGenerate failed: cannot reach the executor")


def test_client_timeout_and_server_operator_timeout():
    slow = FakeBackend(delay_s=30)
    with start_in_thread(slow, config=ServerConfig(op_timeout_s=0.3)) as handle:
        with ExecutorClient(handle.url, timeout_s=0.3) as fast_client:
            [obs] = fast_client.execute_many_sync([("AnswerGenerate", "q")])
        assert obs.error_kind == "client_timeout"
        assert "did not answer within 0.3 s" in obs.text
        with ExecutorClient(handle.url, timeout_s=20) as patient:
            [obs] = patient.execute_many_sync([("AnswerGenerate", "q")])
        assert obs.error_kind == "timeout"
        assert obs.text.startswith("Operator AnswerGenerate failed: it took longer than 0.3 s")
        assert http(f"{handle.url}/health", method="GET")[0] == 200


# A fake executor that answers each call with the reply its `content` names: what a proxy, a crashed
# or a buggy executor may send. (status, content type, body); None = cut the connection mid-body;
# a "chunked" case is sent without Content-Length.
_DEEP = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # json.loads: RecursionError
_JSON = "application/json"
# A 200 whose body is empty, lacks "text", has a non-string "text", is a list, is not UTF-8, or nests too deep.
_ODD_200_BODIES = (b"", b'{"error_kind": null, "llm_calls": 1}', b'{"text": 5}', b'["text", "ok"]', b"\xff\xfe{", _DEEP)
_BAD_COUNTERS = ('"many"', "[3]", "Infinity", "1e400", "NaN")  # json.loads reads the last three as inf, inf, nan
_MALFORMED = {
    "502 html": (502, "text/html", b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
    "500 json": (500, _JSON, b'{"error": "internal", "message": "boom"}'),
    **{f"200 body {body[:24]!r}": (200, _JSON, body) for body in _ODD_200_BODIES},
    **{f"200 {key}={v}": (200, _JSON, b'{"text": "ok", "%s": %s}' % (key.encode(), v.encode()))
       for key in ("llm_calls", "tokens") for v in _BAD_COUNTERS},
    "closed mid-body": None,
    # Over the test client's reply cap (_REPLY_CAP), announced by Content-Length or not.
    "200 over the reply cap": (200, _JSON, b'{"text": "' + b"x" * 2_000_000 + b'"}'),
    "200 over the reply cap, chunked": (200, _JSON, b'{"text": "' + b"x" * 2_000_000 + b'"}'),
}
_REPLY_CAP = 1_000_000
_GOOD = (200, _JSON, b'{"text": "fine", "error_kind": null, "llm_calls": 2, "tokens": 7}')


def _malformed_app():
    from aiohttp import web

    async def execute(request):
        case = (await request.json())["content"]
        reply = _GOOD if case == "good" else _MALFORMED[case]
        if reply is None:  # promise 1000 bytes, send a few, drop the connection
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                           "Content-Length": "1000"})
            await resp.prepare(request)
            await resp.write(b'{"text": "par')
            request.transport.close()
            return resp
        status, content_type, body = reply
        if case.endswith("chunked"):
            resp = web.StreamResponse(status=status, headers={"Content-Type": content_type})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(body), 65_536):
                await resp.write(body[i:i + 65_536])
            await resp.write_eof()
            return resp
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_post("/execute", execute)
    return app


@pytest.fixture(scope="module")
def malformed_server():
    from workflow_r1.executor.server import serve_app_in_thread
    with serve_app_in_thread(_malformed_app) as handle:
        yield handle


@pytest.mark.parametrize("api", ["async", "sync"])
def test_malformed_replies_become_error_observations(malformed_server, api):
    """Whatever the executor sends back, every call of the batch comes back, in order, as an
    observation; the malformed ones as a client-side error, the good ones untouched."""
    cases = list(_MALFORMED)
    calls = [("AnswerGenerate", c) for case in cases for c in (case, "good")]
    if api == "sync":
        with ExecutorClient(malformed_server.url, timeout_s=30, max_reply_bytes=_REPLY_CAP) as c:
            observations = c.execute_many_sync(calls)
    else:
        observations = _execute_many_in_new_loop(
            ExecutorClient(malformed_server.url, timeout_s=30, max_reply_bytes=_REPLY_CAP), calls)
    assert len(observations) == len(calls)
    for case, bad, good in zip(cases, observations[::2], observations[1::2]):
        assert (good.text, good.error_kind, good.llm_calls, good.tokens) == ("fine", None, 2, 7), case
        expected = "client_connection" if case == "closed mid-body" else ("client_http_error", "client_error")
        assert bad.error_kind in expected, (case, bad)
        assert bad.text.startswith("Operator AnswerGenerate failed") and "Continue without" in bad.text, (case, bad)
        assert malformed_server.url.split("//")[1] not in bad.text, (case, bad)  # the address is logged only
        if "reply cap" in case:
            assert "over the limit of 1000000 bytes" in bad.text, (case, bad)
        assert isinstance(bad.llm_calls, int) and isinstance(bad.tokens, int) and bad.latency_ms >= 0


def test_client_rejects_bad_configuration():
    with pytest.raises(ValueError, match="http://"):
        ExecutorClient("localhost:8000")


# ------------------------------------------------------------------------------------------------
# Command line

def test_command_line_server(tmp_path):
    env = {**os.environ, "WORKFLOW_R1_CACHE": str(tmp_path), "PYTHONPATH": str(REPO)}
    prompts = tmp_path / "prompts"  # a prompt set replacing one executor prompt (task/prompt_sets.py)
    prompts.mkdir()
    (prompts / "AnswerGenerate.template.txt").write_text("PIRATE VOICE please: {input} <think> <answer>")
    proc = subprocess.Popen(
        [sys.executable, "-m", "workflow_r1.executor", "--port", "0", "--llm", "fake",
         "--search", "bm25", "--topk", "2", "--search_snippet_chars", "60", "--prompt_set", str(prompts),
         "--loop", "asyncio"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + proc.stdout.read()
        url = line.split("listening on ")[1].split()[0]
        with ExecutorClient(url, timeout_s=30) as client:
            search, answer = client.execute_many_sync(
                [("Search", "Who painted The Starry Night?"), ("AnswerGenerate", "q")])
        assert search.text.count("Title: ") == 2 and "Title: The Starry Night" in search.text
        assert all(len(s) <= 60 for s in re.findall(r"\nSnippet: (.*)", search.text))
        assert search.text.count("\nSnippet: ") == 2
        assert answer.text.startswith("AnswerGenerate thought process:") and "PIRATE VOICE please: q" in answer.text
        assert list((tmp_path / "bm25").iterdir())  # index cached under $WORKFLOW_R1_CACHE/bm25
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0  # SIGTERM shuts it down cleanly


def test_command_line_errors_name_the_fix():
    out = subprocess.run([sys.executable, "-m", "workflow_r1.executor", "--llm", "local:/nowhere"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "/nowhere does not exist" in out.stderr
    out = subprocess.run([sys.executable, "-m", "workflow_r1.executor", "--search", "elastic"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode != 0 and "bm25" in out.stderr
