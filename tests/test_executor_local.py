"""LocalBackend: concurrent requests are batched into one call of a synchronous generate_fn that
runs in a worker thread (the embedded JAX sampler plugs in here), with a Python fake generate_fn."""
import asyncio
import threading

import pytest

from workflow_r1.executor import ExecutorClient, LocalBackend, start_in_thread
from workflow_r1.executor.backends import BackendError

pytestmark = pytest.mark.timeout(60)


class RecordingGenerate:
    """generate_fn that answers each prompt with text derived from it and records every call."""

    def __init__(self, reply=lambda p: f"echo:{p}", fail=False):
        self.calls: list[tuple[list[str], int]] = []
        self.threads: set[str] = set()
        self.reply = reply
        self.fail = fail

    def __call__(self, prompts, max_tokens):
        self.calls.append((list(prompts), max_tokens))
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("device lost")
        return [(self.reply(p), "stop") for p in prompts]


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_concurrent_requests_share_one_generate_call():
    gen = RecordingGenerate()
    backend = LocalBackend(gen, max_batch=32, max_wait_ms=20)

    async def main():
        return await asyncio.gather(*(backend.complete(f"prompt {i}", 64) for i in range(8)))

    results = run(main)
    assert len(gen.calls) == 1
    prompts, max_tokens = gen.calls[0]
    assert sorted(prompts) == sorted(f"prompt {i}" for i in range(8)) and max_tokens == 64
    assert [r.text for r in results] == [f"echo:prompt {i}" for i in range(8)]  # routed back
    assert all(r.finish_reason == "stop" for r in results)
    assert backend.batch_sizes == [8]
    assert gen.threads == {"local-llm_0"}  # a worker thread, not the event loop's


def test_batches_respect_max_batch_and_max_tokens():
    gen = RecordingGenerate()
    backend = LocalBackend(gen, max_batch=4, max_wait_ms=5)

    async def main():
        jobs = [backend.complete(f"a{i}", 100) for i in range(10)]
        jobs += [backend.complete(f"b{i}", 200) for i in range(3)]
        return await asyncio.gather(*jobs)

    results = run(main)
    assert [r.text for r in results] == [f"echo:a{i}" for i in range(10)] + [f"echo:b{i}" for i in range(3)]
    assert [(len(p), m) for p, m in gen.calls] == [(4, 100), (4, 100), (2, 100), (3, 200)]


def test_requests_arriving_during_generation_form_the_next_batch():
    started, release = threading.Event(), threading.Event()
    calls = []

    def generate(prompts, max_tokens):
        calls.append(list(prompts))
        if len(calls) == 1:
            started.set()
            release.wait(10)
        return [(f"r:{p}", "stop", 3) for p in prompts]

    backend = LocalBackend(generate, max_batch=16, max_wait_ms=1)

    async def main():
        first = asyncio.ensure_future(backend.complete("first", 8))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        later = [asyncio.ensure_future(backend.complete(f"later {i}", 8)) for i in range(5)]
        await asyncio.sleep(0.05)
        release.set()
        return await first, await asyncio.gather(*later)

    first, later = run(main)
    assert calls == [["first"], [f"later {i}" for i in range(5)]]
    assert first.text == "r:first" and first.tokens == 3
    assert [r.text for r in later] == [f"r:later {i}" for i in range(5)]


def test_generate_failures_become_backend_errors_and_the_backend_recovers():
    gen = RecordingGenerate(fail=True)
    backend = LocalBackend(gen, max_wait_ms=1)

    async def main():
        results = await asyncio.gather(*(backend.complete(f"p{i}", 8) for i in range(3)),
                                       return_exceptions=True)
        gen.fail = False
        return results, await backend.complete("again", 8)

    failures, recovered = run(main)
    assert all(isinstance(e, BackendError) and e.kind == "llm_error" for e in failures)
    assert "device lost" in failures[0].message
    assert recovered.text == "echo:again"


def test_wrong_number_of_outputs_is_an_error():
    backend = LocalBackend(lambda prompts, n: [("only one", "stop")], max_wait_ms=1)

    async def main():
        return await asyncio.gather(backend.complete("a", 8), backend.complete("b", 8),
                                    return_exceptions=True)

    errors = run(main)
    assert all(isinstance(e, BackendError) and "2 prompts" in e.message for e in errors)


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        LocalBackend(lambda p, n: [], max_batch=0)


def test_executor_with_local_backend_batches_multi_answer_generate():
    gen = RecordingGenerate(reply=lambda p: "<think>France's capital.</think><answer>Paris</answer>")
    backend = LocalBackend(gen, max_batch=8, max_wait_ms=20)
    with start_in_thread(backend) as handle, ExecutorClient(handle.url, timeout_s=30) as client:
        multi, single = client.execute_many_sync(
            [("MultiAnswerGenerate", "What is the capital of France?"),
             ("AnswerGenerate", "What is the capital of France?")])
    assert multi.text == "\n\n".join(f"[Answer {i}]\nAnswerGenerate answer: Paris" for i in (1, 2, 3))
    assert single.text.endswith("AnswerGenerate answer: Paris")
    assert sum(backend.batch_sizes) == 4 and len(gen.calls) < 4  # batched, not one call each
    assert all(m == 1024 for _, m in gen.calls)  # the paper's executor max_tokens


def test_one_backend_serves_an_executor_thread_and_the_main_loop():
    """rlmopt shares one loaded model between its optimizer (main loop) and an in-process executor
    (its own loop in a thread): requests from both loops are answered, and closing one user (the
    executor stops) leaves the model serving the other, and a fresh user after both closed."""
    gen = RecordingGenerate(reply=lambda p: "<think>t</think><answer>Paris</answer>")
    backend = LocalBackend(gen, max_wait_ms=1)

    async def direct():
        return await asyncio.wait_for(backend.complete("optimizer prompt", 16), timeout=10)

    async def both():
        with start_in_thread(backend) as handle:
            client = ExecutorClient(handle.url, timeout_s=10)
            obs = await client.execute("AnswerGenerate", "Capital of France?")
            assert obs.text.endswith("AnswerGenerate answer: Paris")
            assert (await direct()).text.endswith("</answer>")  # used to hang here
            obs = await client.execute("AnswerGenerate", "Capital of France?")
            assert obs.error_kind is None
            await client.aclose()
        # the executor stopped and closed its share of the backend; the main loop still works
        assert (await direct()).text.endswith("</answer>")
        await backend.aclose()

    run(both)
    assert run(direct).text.endswith("</answer>")  # a new loop after every user closed
    assert {m for _, m in gen.calls} == {16, 1024} and len(gen.threads) <= 2
