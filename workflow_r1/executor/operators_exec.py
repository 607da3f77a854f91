"""Execution of the nine operators (NOTES.md section 5.2) on an LLM backend and a search backend.

`OperatorRunner.run(name, content)` parses the operator's input fields out of `content`, fills the
operator's prompt template (from the registry in `workflow_r1.env.operators`, or a caller-supplied
override, which is how rlmopt tries candidate prompts), calls the executor LLM with the repair
loop, and formats the observation text. Operators never raise: every failure becomes an
`OpResult` whose `error_kind` says what went wrong and whose text tells the policy.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from workflow_r1.env.operators import FREE_TEXT_FIELD, OPERATORS, WARNING_TEXT, OperatorSpec
from workflow_r1.executor.backends import REPAIR_MARKER, BackendError, Completion, LLMBackend
from workflow_r1.executor.search import SearchBackend, SearchError, render_results

_TAG_RE_CACHE: dict[str, re.Pattern] = {}


def _tag_re(tag: str) -> re.Pattern:
    pattern = _TAG_RE_CACHE.get(tag)
    if pattern is None:
        pattern = _TAG_RE_CACHE[tag] = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
    return pattern


def parse_tag(text: str, tag: str) -> str:
    """Stripped content of the first `<tag>...</tag>`, or "" if absent."""
    match = _tag_re(tag).search(text)
    return match.group(1).strip() if match else ""


def parse_tags(text: str, tag: str) -> list[str]:
    """Stripped contents of every `<tag>...</tag>`, in order."""
    return [m.strip() for m in _tag_re(tag).findall(text)]


@dataclass
class OpResult:
    """An operator's observation text and metadata. error_kind None means success; otherwise one of
    input_format | llm_* (see backends.BackendError) | llm_unavailable | search_error |
    search_unavailable | internal."""

    text: str
    error_kind: str | None = None
    llm_calls: int = 0
    tokens: int = 0


@dataclass
class _LLMOutcome:
    reply: str
    calls: int = 0
    tokens: int = 0
    error: BackendError | None = None
    history: list[str] = field(default_factory=list)


def repair_prompt(prompt: str, replies: list[str], hints: list[str]) -> str:
    """The prompt for a repair attempt: the original request, each earlier reply quoted under
    REPAIR_MARKER with what was wrong with it, and a request to answer again.

    The release sends this as a multi-turn chat (user, assistant, user, ...). Our backends take
    one user message, so the conversation is rendered into it; the content is the same.
    """
    parts = [prompt]
    for i, (reply, hint) in enumerate(zip(replies, hints), 1):
        parts.append(f"{REPAIR_MARKER} {i}) -----\n{reply}\n----- End of previous reply -----\n{hint}")
    parts.append("Answer the original request above again, following its format exactly.")
    return "\n\n".join(parts)


def repair_hint(truncated: bool, missing: list[str]) -> str:
    hints = []
    if truncated:
        hints.append("Your reply was TRUNCATED. Be MORE CONCISE.")
    if missing:
        tags = ", ".join(f"<{t}></{t}>" for t in missing)
        hints.append(f"Your reply is MISSING required tags: {tags}. Include ALL required tags.")
    return " ".join(hints)


def format_with_think(op: str, reply: str, thought: bool = True) -> str:
    """"{op} thought process: ...\\n\\n{op} answer: ..." when both tags parse; "{op} answer: ..."
    with only an answer (or thought=False); otherwise the raw reply."""
    think, answer = parse_tag(reply, "think"), parse_tag(reply, "answer")
    if think and answer and thought:
        return f"{op} thought process: {think}\n\n{op} answer: {answer}"
    return f"{op} answer: {answer}" if answer else reply


def format_answer_only(op: str, reply: str) -> str:
    answer = parse_tag(reply, "answer")
    return f"{op} answer: {answer}" if answer else reply


def _format_error(op: str, message: str) -> OpResult:
    return OpResult(f"I did not follow the required format for the {op} operator. {message}",
                    error_kind="input_format")


class OperatorRunner:
    """Runs operators against `llm` (None: LLM operators answer llm_unavailable) and `search`
    (None: Search answers search_unavailable).

    Args:
        max_tokens: executor generation limit per attempt (1024 in the paper).
        max_attempts: attempts of the repair loop (3 in the paper).
        search_topk: passages per Search call.
    """

    def __init__(self, llm: LLMBackend | None, search: SearchBackend | None = None,
                 max_tokens: int = 1024, max_attempts: int = 3, search_topk: int = 3):
        self.llm = llm
        self.search = search
        self.max_tokens = max_tokens
        self.max_attempts = max_attempts
        self.search_topk = search_topk
        self._handlers: dict[str, Callable[[str, str | None], Awaitable[OpResult]]] = {
            "AnswerGenerate": self._answer_generate,
            "Custom": self._custom,
            "PromptOptimizer": self._prompt_optimizer,
            "Review": self._review,
            "Revise": self._revise,
            "MultiAnswerGenerate": self._multi_answer_generate,
            "ScEnsemble": self._sc_ensemble,
            "Search": self._search,
            "WarningOp": self._warning,
        }
        missing = set(OPERATORS) - set(self._handlers)
        assert not missing, f"operators without an implementation: {missing}"

    @property
    def operator_names(self) -> list[str]:
        return list(self._handlers)

    async def run(self, name: str, content: str, template: str | None = None) -> OpResult:
        """Execute operator `name` on `content`. `template` overrides the registry's prompt
        template (the caller validates it with `operators.validate_template`). Never raises
        except for an unknown name (KeyError), which the server rejects before calling."""
        handler = self._handlers[name]
        try:
            return await handler(content, template)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in one operator must not take the executor down
            return OpResult(f"Operator {name} failed with an internal executor error "
                            f"({type(exc).__name__}). Continue without this result.",
                            error_kind="internal")

    # ---------------------------------------------------------------------------------------------
    # The LLM call with its repair loop

    async def _llm(self, prompt: str, required_tags: tuple[str, ...]) -> _LLMOutcome:
        """Up to max_attempts calls; repeat when a required tag is missing or the reply was cut
        off (finish_reason "length"). Returns the last reply, possibly still malformed. A backend
        error ends the loop (the backend already retried the transport)."""
        out = _LLMOutcome(reply="")
        replies: list[str] = []
        hints: list[str] = []
        assert self.llm is not None
        for attempt in range(self.max_attempts):
            current = prompt if attempt == 0 else repair_prompt(prompt, replies, hints)
            try:
                completion: Completion = await self.llm.complete(current, self.max_tokens)
            except BackendError as exc:
                out.error = exc
                out.calls += 1
                return out
            out.calls += 1
            out.tokens += completion.tokens
            out.reply = completion.text
            truncated = completion.finish_reason == "length"
            missing = [t for t in required_tags if not parse_tag(completion.text, t)]
            if not truncated and not missing:
                return out
            replies.append(completion.text)
            hints.append(repair_hint(truncated, missing))
        return out

    def _llm_failure(self, op: str, outcome: _LLMOutcome) -> OpResult:
        assert outcome.error is not None
        return OpResult(
            f"Operator {op} failed: the executor LLM did not answer ({outcome.error.message}). "
            "Continue without this result.",
            error_kind=outcome.error.kind, llm_calls=outcome.calls, tokens=outcome.tokens)

    def _no_llm(self, op: str) -> OpResult:
        return OpResult(f"Operator {op} is not available: this executor has no LLM backend.",
                        error_kind="llm_unavailable")

    async def _call(self, spec: OperatorSpec, template: str | None, fields: dict[str, str],
                    ) -> _LLMOutcome:
        prompt = (template or spec.template or "").format(**fields)
        return await self._llm(prompt, spec.required_tags)

    # ---------------------------------------------------------------------------------------------
    # Operators

    async def _free_text(self, op: str, content: str, template: str | None,
                         thought: bool = True) -> OpResult:
        if self.llm is None:
            return self._no_llm(op)
        if not content.strip():
            return _format_error(op, f"I need to write the input after the colon: "
                                     f"{OPERATORS[op].usage}")
        out = await self._call(OPERATORS[op], template, {FREE_TEXT_FIELD: content.strip()})
        if out.error is not None:
            return self._llm_failure(op, out)
        return OpResult(format_with_think(op, out.reply, thought), None, out.calls, out.tokens)

    async def _answer_generate(self, content: str, template: str | None) -> OpResult:
        return await self._free_text("AnswerGenerate", content, template)

    async def _prompt_optimizer(self, content: str, template: str | None) -> OpResult:
        return await self._free_text("PromptOptimizer", content, template)

    async def _multi_answer_generate(self, content: str, template: str | None) -> OpResult:
        op = "MultiAnswerGenerate"
        if self.llm is None:
            return self._no_llm(op)
        if not content.strip():
            return _format_error(op, f"I need to write the question after the colon: "
                                     f"{OPERATORS[op].usage}")
        spec = OPERATORS[op]
        fields = {FREE_TEXT_FIELD: content.strip()}
        # Three independent samples, concurrently (the release runs them one after another).
        outs = await asyncio.gather(*(self._call(spec, template, fields) for _ in range(3)))
        calls = sum(o.calls for o in outs)
        tokens = sum(o.tokens for o in outs)
        if all(o.error is not None for o in outs):
            failed = self._llm_failure(op, outs[0])
            failed.llm_calls, failed.tokens = calls, tokens
            return failed
        blocks = []
        for i, o in enumerate(outs, 1):
            body = (f"(this attempt failed: {o.error.message})" if o.error is not None
                    else format_with_think("AnswerGenerate", o.reply, thought=False))
            blocks.append(f"[Answer {i}]\n{body}")
        return OpResult("\n\n".join(blocks), None, calls, tokens)

    async def _custom(self, content: str, template: str | None) -> OpResult:
        op = "Custom"
        if self.llm is None:
            return self._no_llm(op)
        task, instruction = parse_tag(content, "task"), parse_tag(content, "instruction")
        if not task and not instruction:
            return _format_error(op, "I need to give the task inside <task></task> and the "
                                     "instruction inside <instruction></instruction>.")
        out = await self._call(OPERATORS[op], template, {"task": task, "instruction": instruction})
        if out.error is not None:
            return self._llm_failure(op, out)
        return OpResult(format_answer_only(op, out.reply), None, out.calls, out.tokens)

    async def _review(self, content: str, template: str | None) -> OpResult:
        op = "Review"
        if self.llm is None:
            return self._no_llm(op)
        question, solution = parse_tag(content, "question"), parse_tag(content, "solution")
        if not question:
            return _format_error(op, "I need to give the question inside <question></question>.")
        if not solution:
            return _format_error(op, "I need to give the solution inside <solution></solution>.")
        out = await self._call(OPERATORS[op], template, {"question": question, "solution": solution})
        if out.error is not None:
            return self._llm_failure(op, out)
        feedback = parse_tag(out.reply, "feedback")
        text = f"Review feedback: {feedback}" if feedback else out.reply
        return OpResult(text, None, out.calls, out.tokens)

    async def _revise(self, content: str, template: str | None) -> OpResult:
        op = "Revise"
        if self.llm is None:
            return self._no_llm(op)
        fields = {t: parse_tag(content, t) for t in ("question", "solution", "feedback")}
        for tag, value in fields.items():
            if not value:
                return _format_error(op, f"I need to give the {tag} inside <{tag}></{tag}>.")
        out = await self._call(OPERATORS[op], template, fields)
        if out.error is not None:
            return self._llm_failure(op, out)
        return OpResult(format_with_think(op, out.reply), None, out.calls, out.tokens)

    async def _sc_ensemble(self, content: str, template: str | None) -> OpResult:
        op = "ScEnsemble"
        if self.llm is None:
            return self._no_llm(op)
        query, solutions = parse_tag(content, "query"), parse_tags(content, "solution")
        if not query:
            return _format_error(op, "I need to give the query inside <query></query>.")
        if not solutions:
            return _format_error(op, "I need to give the candidate solutions, each inside "
                                     "<solution></solution>.")
        if len(solutions) == 1:
            return _format_error(op, "Ensembling a single solution is meaningless: I need at "
                                     "least two candidates, each inside its own "
                                     "<solution></solution>.")
        listed = "".join(f"{_letter(i)}: {s}\n\n" for i, s in enumerate(solutions))
        out = await self._call(OPERATORS[op], template, {"query": query, "solutions": listed})
        if out.error is not None:
            return self._llm_failure(op, out)
        return OpResult(format_with_think(op, out.reply), None, out.calls, out.tokens)

    async def _search(self, content: str, template: str | None) -> OpResult:
        query = content.strip()
        if not query:
            return _format_error("Search", "I need to write the query after the colon: "
                                           "<tool>Search: YOUR_QUERY</tool>.")
        if self.search is None:
            return OpResult("Search is not available on this executor (started with --search "
                            "none).", error_kind="search_unavailable")
        try:
            passages = await self.search.search(query, self.search_topk)
        except SearchError as exc:
            return OpResult(f"Search error: {exc}", error_kind="search_error")
        return OpResult(render_results(query, passages))

    async def _warning(self, content: str, template: str | None) -> OpResult:
        return OpResult(WARNING_TEXT)


def _letter(i: int) -> str:
    # A..Z, then AA, AB, ... so any number of candidates gets a distinct label.
    label = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        label = chr(65 + rem) + label
    return label
