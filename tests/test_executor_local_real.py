"""The embedded executor: the real Qwen2.5-Coder-0.5B-Instruct through our JAX sampler, over HTTP."""

import pytest

from workflow_r1.executor.local_backend import LocalBackend, make_local_generate_fn
from workflow_r1.executor.client import ExecutorClient
from workflow_r1.executor.server import ServerConfig, start_in_thread


@pytest.mark.real_model
def test_answer_generate_with_real_model_knows_paris(qwen05b_dir):
    generate_fn = make_local_generate_fn(str(qwen05b_dir), cache_size=1024)
    calls = []

    def counting_fn(prompts, max_tokens):
        calls.append(len(prompts))
        return generate_fn(prompts, max_tokens)

    # 256 new tokens leave the 0.5B model room for its <think> and <answer>; CPU-sized.
    handle = start_in_thread(LocalBackend(counting_fn, max_batch=8, max_wait_ms=50),
                             config=ServerConfig(max_tokens=256))
    try:
        with ExecutorClient(handle.url, timeout_s=600) as client:
            obs, = client.execute_many_sync([("AnswerGenerate", "What is the capital of France?")])
    finally:
        handle.stop()
    print("AnswerGenerate ->", obs.text[:300].replace("\n", " | "), f"({obs.llm_calls} LLM calls)")
    assert obs.error_kind is None, obs
    assert "Paris" in obs.text
    assert obs.text.startswith("AnswerGenerate")
    assert sum(calls) == obs.llm_calls >= 1
