"""Several executor URLs: calls spread round-robin over the replicas, results in call order, through
`connect` as the trainer and the evaluator use it. Each replica is a real HTTP executor whose fake
LLM answers with its own name, so every observation shows which replica served it."""
from __future__ import annotations

import asyncio

import pytest

from workflow_r1.executor import FakeBackend, start_in_thread
from workflow_r1.executor.connect import ExecutorConfig, ExecutorUnavailable, connect
from workflow_r1.executor.replicas import ReplicaClient, split_urls


@pytest.fixture(scope="module")
def replicas():
    handles = [start_in_thread(FakeBackend(default_answer=f"replica{i}")) for i in range(3)]
    yield [h.url for h in handles]
    for h in handles:
        h.stop()


def _served_by(observation) -> int:
    return int(observation.text.split("replica")[-1][0])


def test_round_robin_in_call_order(replicas):
    with connect(ExecutorConfig(url=",".join(replicas), timeout_s=30)) as ex:
        assert isinstance(ex.client, ReplicaClient)
        calls = [("AnswerGenerate", f"question number {i}") for i in range(5)]
        out = ex.client.execute_many_sync(calls)
        # In call order: each observation quotes its own question.
        assert [f"question number {i}" in o.text for i, o in enumerate(out)] == [True] * 5
        assert [_served_by(o) for o in out] == [0, 1, 2, 0, 1]
        # The next batch continues where the last one stopped, so the replicas stay evenly loaded.
        assert [_served_by(o) for o in ex.client.execute_many_sync(calls[:2])] == [2, 0]
        out = asyncio.run(ex.client.execute_many(calls[:3]))
        assert [_served_by(o) for o in out] == [1, 2, 0]
        assert all(o.error_kind is None for o in out)


def test_one_url_is_a_plain_client_and_a_dead_replica_is_named(replicas):
    with connect(ExecutorConfig(url=replicas[0])) as ex:
        assert not isinstance(ex.client, ReplicaClient)
    with pytest.raises(ExecutorUnavailable, match="http://127.0.0.1:9"):
        connect(ExecutorConfig(url=f"{replicas[0]},http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="'exec:8000' must start with http"):
        ExecutorConfig(url=f"{replicas[0]}, exec:8000")
    assert split_urls(" http://a:1, ,http://b:2 ") == ["http://a:1", "http://b:2"]
