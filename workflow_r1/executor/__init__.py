"""The operator executor: an HTTP service that runs the nine operators, and its client.

    python -m workflow_r1.executor --port=8000 --llm=fake|openai:URL|local:DIR --search=bm25|remote:URL|none

In-process (the embedded default): `start_in_thread(llm, search) -> handle` with `.url`/`.stop()`,
then `ExecutorClient(handle.url).execute_many_sync([(operator, content), ...])`.
"""
from workflow_r1.executor.backends import BackendError, Completion, LLMBackend
from workflow_r1.executor.fake_backend import FakeBackend
from workflow_r1.executor.local_backend import LocalBackend
from workflow_r1.executor.openai_backend import OpenAIBackend
from workflow_r1.executor.client import ExecutorClient, Observation
from workflow_r1.executor.search import BM25Search, Passage, RemoteSearch, SearchBackend
from workflow_r1.executor.server import (ExecutorService, ServerConfig, ServerHandle,
                                         start_in_thread)

__all__ = [
    "BackendError", "BM25Search", "Completion", "ExecutorClient", "ExecutorService", "FakeBackend",
    "LLMBackend", "LocalBackend", "Observation", "OpenAIBackend", "Passage", "RemoteSearch",
    "SearchBackend", "ServerConfig", "ServerHandle", "start_in_thread",
]
