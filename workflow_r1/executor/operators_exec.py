"""Execution of the nine operators (docs/paper.md, Operators) on an LLM and a search backend.

`OperatorRunner.run(name, content)` parses the operator's input fields out of `content`, fills the
operator's prompt template (the executor's prompt set, by default the registry's faithful wording in
`workflow_r1.task.operators`, or a caller-supplied override: how a trainer sends its `env.prompt_set`
and how rlmopt tries candidate prompts), calls the executor LLM with the repair
loop, and formats the observation text. The seven LLM operators are one procedure driven by their
registry entry (`OperatorSpec`); Search and WarningOp call no LLM and have their own handlers.
Operators never raise: every failure becomes an `OpResult` whose `error_kind` says what went wrong
and whose text tells the policy.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping

from workflow_r1.task.operators import FREE_TEXT_FIELD, OPERATORS, WARNING_TEXT, OperatorSpec
from workflow_r1.task.tags import all_tags, first_tag
from workflow_r1.executor.backends import REPAIR_MARKER, BackendError, Completion, LLMBackend
from workflow_r1.executor.options import ServerConfig
from workflow_r1.executor.search import SearchBackend, SearchError, render_results


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


def format_reply(spec: OperatorSpec, reply: str) -> str:
    """The observation of one LLM reply: "{label} thought process: ...\\n\\n{label} {tag}: ..." when
    the spec reports the thought and both tags parse; "{label} {tag}: ..." with only the reply tag;
    otherwise the raw reply (as in the release)."""
    label = spec.reply_label or spec.name
    value = first_tag(reply, spec.reply_tag)
    if not value:
        return reply
    think = first_tag(reply, "think") if spec.reply_thought else None
    if think:
        return f"{label} thought process: {think}\n\n{label} {spec.reply_tag}: {value}"
    return f"{label} {spec.reply_tag}: {value}"


def parse_input(spec: OperatorSpec, content: str) -> dict[str, str | list[str]]:
    """The operator's input fields parsed out of the call's `content` (see `OperatorSpec`)."""
    if not spec.input_fields:
        return {FREE_TEXT_FIELD: content.strip()}
    lettered = dict(spec.lettered_fields)
    return {name: all_tags(content, name) if name in lettered else first_tag(content, name) or ""
            for name in spec.input_fields}


def input_error(spec: OperatorSpec, fields: dict[str, str | list[str]]) -> OpResult | None:
    """The format-error observation of the first failing `spec.input_checks`, or None."""
    for check in spec.input_checks:
        given = sum(len(v) if isinstance(v, list) else bool(v)
                    for v in (fields[name] for name in check.fields))
        if given < check.minimum:
            return _format_error(spec.name, check.message.format(usage=spec.usage))
    return None


def template_values(spec: OperatorSpec, fields: dict[str, str | list[str]]) -> dict[str, str]:
    """The template's placeholder values: the input fields, lettered lists rendered."""
    values = dict(fields)
    for tag, placeholder in spec.lettered_fields:
        listed = values.pop(tag)
        values[placeholder] = "".join(f"{_letter(i)}: {s}\n\n" for i, s in enumerate(listed))
    return values  # type: ignore[return-value]  # every list was rendered above


def _format_error(op: str, message: str) -> OpResult:
    return OpResult(f"I did not follow the required format for the {op} operator. {message}",
                    error_kind="input_format")


class OperatorRunner:
    """Runs operators against `llm` (None: LLM operators answer llm_unavailable) and `search`
    (None: Search answers search_unavailable).

    Args (defaults: `options.ServerConfig`'s):
        max_tokens: executor generation limit per attempt (1024 in the paper).
        max_attempts: attempts of the repair loop (3 in the paper).
        search_topk: passages per Search call.
        search_snippet_chars: each passage's text cut to a snippet of at most this many characters
            ("Title / Snippet" blocks); 0 = the full text ("Title / Text" blocks).
        templates: operator name -> default prompt template (a prompt set's, checked by
            `task.prompt_sets.load`); an operator not in it uses the registry's.
    """

    def __init__(self, llm: LLMBackend | None, search: SearchBackend | None = None,
                 max_tokens: int = ServerConfig.max_tokens, max_attempts: int = ServerConfig.max_attempts,
                 search_topk: int = ServerConfig.search_topk,
                 search_snippet_chars: int = ServerConfig.search_snippet_chars,
                 templates: Mapping[str, str] | None = None):
        self.llm = llm
        self.search = search
        self.max_tokens = max_tokens
        self.max_attempts = max_attempts
        self.search_topk = search_topk
        self.search_snippet_chars = search_snippet_chars
        self.templates = dict(templates or {})
        # Operators that call no LLM; every other registry entry runs through `_llm_operator`.
        self._no_llm_handlers: dict[str, Callable[[str], Awaitable[OpResult]]] = {
            "Search": self._search,
            "WarningOp": self._warning,
        }
        missing = {n for n, s in OPERATORS.items() if not s.uses_llm} - set(self._no_llm_handlers)
        assert not missing, f"operators without an implementation: {missing}"

    @property
    def operator_names(self) -> list[str]:
        return list(OPERATORS)

    async def run(self, name: str, content: str, template: str | None = None) -> OpResult:
        """Execute operator `name` on `content`. `template` overrides the default prompt
        template (the caller validates it with `operators.validate_template`). Never raises
        except for an unknown name (KeyError), which the server rejects before calling."""
        spec = OPERATORS[name]
        try:
            if spec.uses_llm:
                return await self._llm_operator(spec, content, template)
            return await self._no_llm_handlers[name](content)
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
        error ends the loop (the backend already retried the transport); so does an empty last
        reply, which is an error (llm_bad_response), not an empty observation marked as success."""
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
            missing = [t for t in required_tags if not first_tag(completion.text, t)]
            if not truncated and not missing:
                break
            replies.append(completion.text)
            hints.append(repair_hint(truncated, missing))
        if not out.reply.strip():
            out.error = BackendError("llm_bad_response", "the executor LLM replied with empty text")
        return out

    # ---------------------------------------------------------------------------------------------
    # Operators

    async def _llm_operator(self, spec: OperatorSpec, content: str, template: str | None,
                            ) -> OpResult:
        """Every LLM operator: parse and check the input, fill the template, call the LLM
        `spec.samples` times with the repair loop, and format the reply (or the failure)."""
        op = spec.name
        if self.llm is None:
            return OpResult(f"Operator {op} is not available: this executor has no LLM backend.",
                            error_kind="llm_unavailable")
        fields = parse_input(spec, content)
        error = input_error(spec, fields)
        if error is not None:
            return error
        template = template or self.templates.get(op) or spec.template or ""
        prompt = template.format(**template_values(spec, fields))
        if spec.samples == 1:
            outs = [await self._llm(prompt, spec.required_tags)]
        else:
            # Independent samples, concurrently (the release runs them one after another).
            outs = await asyncio.gather(*(self._llm(prompt, spec.required_tags)
                                          for _ in range(spec.samples)))
        calls = sum(o.calls for o in outs)
        tokens = sum(o.tokens for o in outs)
        if all(o.error is not None for o in outs):
            return OpResult(
                f"Operator {op} failed: the executor LLM did not answer ({outs[0].error.message}). "
                "Continue without this result.",
                error_kind=outs[0].error.kind, llm_calls=calls, tokens=tokens)
        if spec.samples == 1:
            return OpResult(format_reply(spec, outs[0].reply), None, calls, tokens)
        blocks = []
        for i, o in enumerate(outs, 1):
            body = (f"(this attempt failed: {o.error.message})" if o.error is not None
                    else format_reply(spec, o.reply))
            blocks.append(f"[Answer {i}]\n{body}")
        return OpResult("\n\n".join(blocks), None, calls, tokens)

    async def _search(self, content: str) -> OpResult:
        spec = OPERATORS["Search"]
        fields = parse_input(spec, content)
        error = input_error(spec, fields)
        if error is not None:
            return error
        if self.search is None:
            return OpResult("Search is not available on this executor (started with --search "
                            "none).", error_kind="search_unavailable")
        query = fields[FREE_TEXT_FIELD]
        try:
            passages = await self.search.search(query, self.search_topk)
        except SearchError as exc:
            return OpResult(f"Search error: {exc}", error_kind="search_error")
        return OpResult(render_results(query, passages, self.search_snippet_chars))

    async def _warning(self, content: str) -> OpResult:
        return OpResult(WARNING_TEXT)


def _letter(i: int) -> str:
    # A..Z, then AA, AB, ... so any number of candidates gets a distinct label.
    label = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        label = chr(65 + rem) + label
    return label
