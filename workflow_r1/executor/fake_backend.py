"""A deterministic, instant executor LLM for tests and load benchmarks: `FakeBackend` answers with
the tags the prompt asks for, quotes the prompt, and injects faults (no tags, truncation, errors)
into a request's first attempts, counted from the repair loop's `REPAIR_MARKER`s. The interface
(`Completion`, `BackendError`) is backends.py's.
"""
from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Mapping

from workflow_r1.executor.backends import REPAIR_MARKER, BackendError, Completion

_ECHO_CHARS = 4000  # how much of the prompt a fake reply quotes back (enough to check routing)
_REPAIR_ATTEMPT_RE = re.compile(re.escape(REPAIR_MARKER) + r" (\d+)\)")


class FakeBackend:
    """Deterministic, instant executor LLM for tests and benchmarks.

    It answers with every tag among think/answer/feedback that the prompt mentions, in that order.
    The `<think>` (or `<feedback>`) text quotes the prompt (angle brackets replaced) so a test can
    check which request a reply belongs to. The answer is the value of the first key of `answers`
    found in the prompt (case-insensitive), else `default_answer`.

    Fault injection, decided per request from the attempt number (read from the REPAIR_MARKER
    headers in the prompt), so it is independent of concurrency: the first `faulty_attempts` attempts of every
    request misbehave as `fault` says: "omit_tags" (no tags at all), "truncate" (finish_reason
    "length" and the answer tag cut off), or "error" (raise BackendError "llm_error").
    `delay_s` sleeps before replying, to simulate a slow model.
    """

    name = "fake"

    def __init__(self, answers: Mapping[str, str] | None = None, default_answer: str = "fake answer",
                 fault: str = "none", faulty_attempts: int = 0, delay_s: float = 0.0):
        if fault not in ("none", "omit_tags", "truncate", "error"):
            raise ValueError(f"FakeBackend fault {fault!r}; use none|omit_tags|truncate|error")
        self.answers = {k.lower(): v for k, v in (answers or {}).items()}
        self.default_answer = default_answer
        self.fault = fault
        self.faulty_attempts = faulty_attempts
        self.delay_s = delay_s
        self.calls = 0

    def _answer_for(self, prompt: str) -> str:
        low = prompt.lower()
        for key, value in self.answers.items():
            if key in low:
                return value
        return self.default_answer

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        # The attempt number is the highest quoted earlier attempt (quoted replies may themselves
        # quote the marker, so counting occurrences would overshoot).
        attempt = max((int(n) for n in _REPAIR_ATTEMPT_RE.findall(prompt)), default=0)
        faulty = self.fault != "none" and attempt < self.faulty_attempts
        if faulty and self.fault == "error":
            raise BackendError("llm_error", "FakeBackend injected error")
        digest = hashlib.sha256(prompt.encode()).hexdigest()[:8]
        echo = prompt[:_ECHO_CHARS].replace("<", "‹").replace(">", "›")
        reasoning = f"[fake {digest}] I read the request: {echo}"
        answer = self._answer_for(prompt)
        if faulty and self.fault == "omit_tags":
            text = f"{reasoning}\nMy answer is {answer}."
            return Completion(text, "stop", len(text.split()))
        parts = []
        if "<think>" in prompt:
            parts.append(f"<think>{reasoning}</think>")
        if "<feedback>" in prompt:
            parts.append(f"<feedback>{reasoning}\nThe solution looks correct.</feedback>")
        if "<answer>" in prompt:
            parts.append(f"<answer>{answer}</answer>")
        if not parts:
            parts.append(reasoning)
        text = "\n".join(parts)
        if faulty and self.fault == "truncate":
            text = text[: text.rfind("<")] if "<" in text else text[: len(text) // 2]
            return Completion(text, "length", len(text.split()))
        return Completion(text, "stop", len(text.split()))
