"""OpenAI-compatible backend against a fake chat-completions server in-process (127.0.0.1, random
port): request shape, retries with backoff on 5xx/429/timeouts/garbage, no retry on other 4xx,
the concurrency limit, and the end-to-end path executor -> OpenAIBackend -> fake server."""
import asyncio

import pytest
from aiohttp import web

from workflow_r1.executor import ExecutorClient, OpenAIBackend, ServerConfig, start_in_thread
from workflow_r1.executor.backends import BackendError
from workflow_r1.executor.server import serve_app_in_thread

pytestmark = pytest.mark.timeout(60)

GOOD = "<think>6 times 7 is 42.</think><answer>42</answer>"


class FakeOpenAI:
    """A scripted /v1/chat/completions: each request takes the next mode from `script`
    (then "ok" forever). Records every request body and the peak number of requests in flight."""

    def __init__(self, script=(), reply=GOOD, slow_s=1.0):
        self.script = list(script)
        self.reply = reply
        self.slow_s = slow_s
        self.requests: list[dict] = []
        self.arrivals: list[float] = []  # loop time of each request, seconds
        self.headers: list[dict] = []
        self.inflight = 0
        self.peak = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            self.arrivals.append(asyncio.get_running_loop().time())
            self.requests.append(await request.json())
            self.headers.append(dict(request.headers))
            mode = self.script.pop(0) if self.script else "ok"
            if mode == "slow":
                await asyncio.sleep(self.slow_s)
            if mode == "hold":
                await asyncio.sleep(0.1)
            if mode in ("500", "429", "400"):
                return web.Response(status=int(mode), text=f"injected {mode}")
            if mode == "429 retry-after 1":
                return web.Response(status=429, text="slow down", headers={"Retry-After": "1"})
            if mode == "tokens 1e400":  # json.loads reads 1e400 as inf
                return web.Response(content_type="application/json", text=(
                    '{"choices": [{"message": {"content": "%s"}, "finish_reason": "stop"}], '
                    '"usage": {"completion_tokens": 1e400}}' % self.reply))
            if mode == "garbage":
                return web.Response(text="this is {not json", content_type="application/json")
            if mode == "badshape":
                return web.json_response({"choices": []})
            reply, finish = self.reply, "stop"
            if mode == "notags":
                reply = "It is 42."
            if mode == "length":
                reply, finish = "<think>6 times 7 is", "length"
            if mode == "null":
                reply = None
            if mode == "5 MB":
                reply = GOOD + " " * 5_000_000
            usage = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
            if mode == "cached":  # the prompt-cache share, as OpenAI-compatible servers report it
                usage["prompt_tokens_details"] = {"cached_tokens": 4}
            return web.json_response({
                "id": "x", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                             "finish_reason": finish}],
                "usage": usage,
            })
        finally:
            self.inflight -= 1


@pytest.fixture()
def fake_openai():
    servers = []

    def make(*script, **kw):
        fake = FakeOpenAI(script, **kw)
        handle = serve_app_in_thread(fake.app)
        servers.append(handle)
        return fake, handle.url + "/v1"

    yield make
    for handle in servers:
        handle.stop()


def complete(backend: OpenAIBackend, prompt="What is 6 * 7?", max_tokens=1024):
    async def run():
        try:
            return await backend.complete(prompt, max_tokens)
        finally:
            await backend.aclose()
    return asyncio.run(run())


def test_reported_prompt_and_cached_tokens(fake_openai):
    _, url = fake_openai("cached")
    result = complete(OpenAIBackend(url))
    assert (result.tokens, result.prompt_tokens, result.cached_tokens) == (7, 10, 4)


def test_request_shape_and_reply(fake_openai):
    fake, url = fake_openai()
    backend = OpenAIBackend(url, api_key="sk-test", model="qwen-32b")
    result = complete(backend)
    assert (result.text, result.finish_reason, result.tokens) == (GOOD, "stop", 7)
    assert (result.prompt_tokens, result.cached_tokens) == (10, 0)
    [body] = fake.requests
    assert body == {"model": "qwen-32b", "messages": [{"role": "user", "content": "What is 6 * 7?"}],
                    "temperature": 0.0, "max_tokens": 1024}
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"


@pytest.mark.parametrize("script,requests", [
    (("500", "garbage", "ok"), 3),
    (("429", "ok"), 2),
    (("badshape", "ok"), 2),
])
def test_transient_failures_are_retried(fake_openai, script, requests):
    fake, url = fake_openai(*script)
    result = complete(OpenAIBackend(url, retries=2, backoff_base_s=0.01, seed=0))
    assert result.text == GOOD
    assert len(fake.requests) == requests


@pytest.mark.parametrize("script,kind,requests", [
    (("500", "500", "500", "ok"), "llm_http_error", 3),
    (("garbage",) * 3, "llm_bad_response", 3),
    (("400", "ok"), "llm_http_error", 1),  # a client error is not retried
])
def test_persistent_failures_raise_after_the_retries(fake_openai, script, kind, requests):
    fake, url = fake_openai(*script)
    with pytest.raises(BackendError) as err:
        complete(OpenAIBackend(url, retries=2, backoff_base_s=0.01, seed=0))
    assert err.value.kind == kind
    assert f"after {requests} attempt" in err.value.message
    assert len(fake.requests) == requests


def test_odd_replies_are_classified(fake_openai):
    """A token count of 1e400 is unknown (0), not an internal error; null content is a bad reply,
    retried; a reply over the size cap fails at once, unread."""
    fake, url = fake_openai("tokens 1e400", "null", "ok", "5 MB")
    backend = OpenAIBackend(url, retries=2, backoff_base_s=0.01, seed=0)
    assert complete(backend).tokens == 0
    assert complete(backend).text == GOOD and len(fake.requests) == 3
    with pytest.raises(BackendError) as err:
        complete(backend)
    assert err.value.kind == "llm_bad_response" and "over the limit of 4194304 bytes" in err.value.message
    assert len(fake.requests) == 4
    fake, url = fake_openai(*["null"] * 3)
    with pytest.raises(BackendError) as err:
        complete(OpenAIBackend(url, retries=2, backoff_base_s=0.01, seed=0))
    assert err.value.kind == "llm_bad_response" and len(fake.requests) == 3


def test_retry_after_is_honoured(fake_openai):
    fake, url = fake_openai("429 retry-after 1", "ok")
    assert complete(OpenAIBackend(url, retries=1, backoff_base_s=0.01, seed=0)).text == GOOD
    assert fake.arrivals[1] - fake.arrivals[0] >= 0.95  # the backoff alone would wait 0.01 s


def test_timeouts_are_retried_then_reported(fake_openai):
    fake, url = fake_openai("slow", "slow", slow_s=1.0)
    with pytest.raises(BackendError) as err:
        complete(OpenAIBackend(url, timeout_s=0.2, retries=1, backoff_base_s=0.01))
    assert err.value.kind == "llm_timeout" and len(fake.requests) == 2


def test_unreachable_endpoint_is_a_connection_error():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BackendError) as err:
        complete(OpenAIBackend(f"http://127.0.0.1:{port}/v1", retries=1, backoff_base_s=0.01))
    assert err.value.kind == "llm_connection"


def test_concurrency_limit(fake_openai):
    fake, url = fake_openai(*["hold"] * 8)
    backend = OpenAIBackend(url, max_concurrency=2)

    async def run():
        try:
            return await asyncio.gather(*(backend.complete(f"q{i}", 16) for i in range(8)))
        finally:
            await backend.aclose()

    results = asyncio.run(run())
    assert all(r.text == GOOD for r in results)
    assert fake.peak == 2


def test_backoff_grows_with_jitter():
    backend = OpenAIBackend("http://127.0.0.1:9/v1", backoff_base_s=0.5, backoff_max_s=3.0, seed=1)
    delays = [backend._backoff_s(i) for i in range(6)]
    caps = [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]  # min(max, base * 2**i)
    for delay, cap in zip(delays, caps):
        assert 0.5 * cap <= delay <= cap


@pytest.mark.parametrize("url", ["localhost:8000/v1", "http://", "http://host:70000/v1",
                                 "http://host:port/v1", "http://bad host/v1"])
def test_bad_base_url_is_rejected(url):
    with pytest.raises(ValueError, match="OpenAI-compatible base URL .* e.g. http://localhost:8000/v1"):
        OpenAIBackend(url)


# ------------------------------------------------------------------------------------------------
# End to end: HTTP client -> executor -> OpenAIBackend -> fake server

def run_executor(url, calls, **backend_kw):
    backend = OpenAIBackend(url, backoff_base_s=0.01, **backend_kw)
    with start_in_thread(backend, config=ServerConfig(op_timeout_s=30)) as handle:
        with ExecutorClient(handle.url, timeout_s=30) as client:
            return client.execute_many_sync(calls)


def test_end_to_end_success_and_repair(fake_openai):
    fake, url = fake_openai("ok", "notags", "ok")
    ok, repaired = run_executor(url, [("AnswerGenerate", "What is 6 * 7?")]) + \
        run_executor(url, [("AnswerGenerate", "What is 6 * 7?")])
    assert ok.text == "AnswerGenerate thought process: 6 times 7 is 42.\n\nAnswerGenerate answer: 42"
    assert ok.llm_calls == 1 and ok.tokens == 7
    assert repaired.text == ok.text and repaired.llm_calls == 2 and repaired.tokens == 14
    # The repair request quoted the bad reply and named the missing tags.
    repair_prompt = fake.requests[2]["messages"][0]["content"]
    assert "It is 42." in repair_prompt
    assert "MISSING required tags: <think></think>, <answer></answer>" in repair_prompt
    assert repair_prompt.startswith(fake.requests[1]["messages"][0]["content"])


def test_end_to_end_truncated_reply_is_repaired(fake_openai):
    fake, url = fake_openai("length", "ok")
    content = "<question>q</question><solution>s</solution><feedback>f</feedback>"
    [obs] = run_executor(url, [("Revise", content)])
    assert obs.llm_calls == 2 and obs.text.endswith("Revise answer: 42")
    assert "TRUNCATED" in fake.requests[1]["messages"][0]["content"]


@pytest.mark.parametrize("script,kind", [
    (("500",) * 9, "llm_http_error"),
    (("garbage",) * 9, "llm_bad_response"),
    (("slow",) * 9, "llm_timeout"),
])
def test_end_to_end_failures_arrive_as_error_observations(fake_openai, script, kind):
    fake, url = fake_openai(*script, slow_s=1.0)
    obs = run_executor(url, [("AnswerGenerate", "q"), ("MultiAnswerGenerate", "q"), ("Search", "q")],
                       retries=1, timeout_s=0.2)
    assert obs[0].error_kind == kind and obs[1].error_kind == kind
    assert obs[0].text.startswith("Operator AnswerGenerate failed: the executor LLM did not answer")
    assert url.split("//")[1].split("/")[0] not in obs[0].text + obs[1].text  # host:port only in the log
    assert obs[2].error_kind == "search_unavailable"  # started without search
    assert len(fake.requests) == 2 * 4  # AnswerGenerate + 3 MultiAnswerGenerate calls, 2 attempts each
