"""LM clients for rlmopt: the executor's backends (OpenAI-compatible, embedded local JAX, fake)
behind a meter that counts calls and tokens per role, plus scripted fakes for tests.

Every LM is `await lm.complete(prompt, max_tokens) -> Completion` (workflow_r1.executor.backends).
A conversation is sent as one user message whose text is the transcript (`render_chat`), so all
three backends serve the optimizer unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from workflow_r1.executor.backends import BackendError, Completion, LLMBackend
from workflow_r1.executor.factory import build_llm

__all__ = ["BackendError", "Completion", "Meter", "MeteredLM", "ScriptedLM", "FunctionLM",
           "build_lm", "render_chat"]


@dataclass
class Meter:
    """Calls and tokens per role ("task", "optimizer", "sub", "judge", "subagent"). Prompt tokens
    and cached prompt tokens (the part a server served from its prompt cache, a subset of the
    prompt tokens) come from the backend when it reports them (an OpenAI-compatible `usage`),
    else prompt tokens are estimated as characters / 4 and cached tokens are 0; completion tokens
    come from the backend when it reports them, else the same estimate. `estimated_prompt` counts
    the calls whose prompt tokens were estimated (a completion that sums several calls, such as a
    tool-calling episode, says so with `prompt_estimated`)."""

    calls: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    estimated_prompt: dict[str, int] = field(default_factory=dict)

    def add(self, role: str, prompt: str, completion: Completion) -> None:
        self.calls[role] = self.calls.get(role, 0) + 1
        reported = int(getattr(completion, "prompt_tokens", 0) or 0)
        if not reported or getattr(completion, "prompt_estimated", False):
            self.estimated_prompt[role] = self.estimated_prompt.get(role, 0) + 1
        p = reported or len(prompt) // 4
        self.prompt_tokens[role] = self.prompt_tokens.get(role, 0) + p
        cached = min(int(getattr(completion, "cached_tokens", 0) or 0), p)
        self.cached_tokens[role] = self.cached_tokens.get(role, 0) + cached
        out = completion.tokens or len(completion.text) // 4
        self.completion_tokens[role] = self.completion_tokens.get(role, 0) + out

    def merge(self, other: "Meter") -> None:
        """Adds every count of `other` (a child agent's meter) to this one."""
        for name in ("calls", "prompt_tokens", "completion_tokens", "cached_tokens",
                     "estimated_prompt"):
            mine = getattr(self, name)
            for role, v in getattr(other, name).items():
                mine[role] = mine.get(role, 0) + v

    def to_dict(self) -> dict:
        return {"calls": dict(self.calls), "prompt_tokens": dict(self.prompt_tokens),
                "completion_tokens": dict(self.completion_tokens),
                "cached_tokens": dict(self.cached_tokens),
                "estimated_prompt": dict(self.estimated_prompt)}

    @classmethod
    def from_dict(cls, d: dict) -> "Meter":
        return cls(dict(d.get("calls", {})), dict(d.get("prompt_tokens", {})),
                   dict(d.get("completion_tokens", {})), dict(d.get("cached_tokens", {})),
                   dict(d.get("estimated_prompt", {})))


class MeteredLM:
    """An LM whose every call is counted in `meter` under `role`."""

    def __init__(self, lm: LLMBackend, meter: Meter, role: str):
        self.lm, self.meter, self.role = lm, meter, role
        self.name = getattr(lm, "name", "lm")

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        try:
            out = await self.lm.complete(prompt, max_tokens)
        except BackendError:  # a failed call is still a call
            self.meter.add(self.role, prompt, Completion("", "error"))
            raise
        self.meter.add(self.role, prompt, out)
        return out


class FunctionLM:
    """A deterministic LM: `fn(prompt) -> text`. For tests and the synthetic task's oracle."""

    name = "function"

    def __init__(self, fn: Callable[[str], str]):
        self.fn = fn
        self.prompts: list[str] = []

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.prompts.append(prompt)
        text = self.fn(prompt)
        return Completion(text, "stop", max(1, len(text) // 4))


class ScriptedLM:
    """Replies from a fixed list, in order (the last one repeats). A scripted optimizer."""

    name = "scripted"

    def __init__(self, replies: Iterable[str]):
        self.replies = list(replies)
        self.prompts: list[str] = []

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        self.prompts.append(prompt)
        i = min(len(self.prompts) - 1, len(self.replies) - 1)
        return Completion(self.replies[i], "stop", max(1, len(self.replies[i]) // 4))


def render_chat(messages: Sequence[dict]) -> str:
    """A conversation as one transcript: each message under a `### ROLE` header."""
    return "\n\n".join(f"### {m['role'].upper()}\n{m['content']}" for m in messages) + \
        "\n\n### ASSISTANT\n"


_CACHE: dict[tuple, LLMBackend] = {}


def build_lm(spec: str, *, api_key: str = "", model: str = "default",
             timeout_s: float = 300.0) -> LLMBackend:
    """`fake` | `openai:URL` | `local` (the bundled 0.5B) | `local:CHECKPOINT_DIR`
    (workflow_r1.executor.factory.build_llm). The same spec returns the same backend, so one
    embedded model serves as both task and optimizer LM."""
    key = (spec, api_key, model)
    if key not in _CACHE:
        _CACHE[key] = build_llm(spec, api_key=api_key, model=model, timeout_s=timeout_s,
                                local_max_batch=32)
    return _CACHE[key]
