"""What the two environment tasks (operator_env, policy_prompt) share: their questions and splits,
their worked-example format, and the executor their task LM talks to."""
from __future__ import annotations

from typing import Any

from rlmopt.task import Example
from workflow_r1.data.config import load_questions
from workflow_r1.data.questions import Question
from workflow_r1.executor.client import ExecutorClient


def load_split(task: str, questions: str, n: int,
               split_sizes: tuple[int, int, int] | None) -> tuple[list[Question], tuple[int, int, int]]:
    """The first `n` questions of `questions` (a `workflow_r1.data.load_questions` spec: "bundled",
    a Search-R1/FlashRAG .jsonl or .parquet file) and the split sizes (default: a third each)."""
    qs = load_questions(questions)[:n]
    if len(qs) < 3:
        raise ValueError(f"{task} task: {questions!r} gives {len(qs)} questions; need at least 3")
    third = len(qs) // 3
    return qs, split_sizes or (third, third, len(qs) - 2 * third)


def format_demo(example: Example, label: str) -> str:
    """A worked example ("{label}: question / Answer: first gold"), braces doubled so that a
    template it is pasted into stays a valid str.format text."""
    text = f"{label}: {example.inputs['question']}\nAnswer: {example.expected['answer_em'][0]}"
    return text.replace("{", "{{").replace("}", "}}")


class ExecutorUser:
    """An executor client for a task LM: an in-process executor over the executor LLM `llm` (an
    executor backend), or an already running one at `url` (then `llm` is ignored). `max_tokens`:
    the in-process executor's generation limit per LLM attempt (tokens; None = the executor's
    default); a running executor has its own. `close` stops what it started."""

    def __init__(self, llm: Any = None, url: str | None = None, timeout_s: float = 600.0,
                 max_tokens: int | None = None):
        self._server = None
        if url is None:
            from workflow_r1.executor.server import ServerConfig, start_in_thread
            config = ServerConfig() if max_tokens is None else ServerConfig(max_tokens=max_tokens)
            self._server = start_in_thread(llm=llm, config=config)
            url = self._server.url
        self.client = ExecutorClient(url, timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()
        self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
