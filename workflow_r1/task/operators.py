"""The operator registry: one table that both the policy's prompt and the executor are built from.

Each operator has a name, the description and usage shown to the policy (appendix D.1 of the paper),
the input fields the executor parses out of the call's content and the format errors it answers when
they are missing, the executor prompt template, the tags that template asks the executor LLM to
produce and how its reply becomes the observation. The prompt's operator list is rendered from this
table, so the prompt the policy sees and the operators the executor runs cannot drift apart.

The words (descriptions and executor templates) are data: the files of the `faithful` prompt set in
`prompt_sets/faithful/` (our own wording of the paper's, docs/paper.md, Prompt sets). Other sets
replace them per run (`env.prompt_set`, `prompt_sets.py`); usages, input fields and tags stay fixed here, because the
parser, the executor and the reward depend on them.

Variant pools (docs/paper.md, Operators): Workflow-R1 offers seven operators; Workflow-R1-Search
swaps MultiAnswerGenerate for Search. WarningOp is never listed to the policy: the parser emits it.
"""
from __future__ import annotations

import pathlib
import string
from dataclasses import dataclass
from typing import Mapping, Sequence

# The content of a free-text operator (AnswerGenerate, PromptOptimizer, ...) is one field, named so.
FREE_TEXT_FIELD = "input"

# The built-in prompt sets, one directory of text files each (task/prompt_sets.py reads them).
PROMPT_SETS_DIR = pathlib.Path(__file__).resolve().parent / "prompt_sets"


def read_prompt_file(path: pathlib.Path) -> str:
    """A prompt file's text without the final newline(s) an editor adds."""
    return path.read_text(encoding="utf-8").rstrip("\n")


def builtin_text(prompt_set: str, filename: str) -> str:
    """The text of `filename` in the built-in prompt set `prompt_set`."""
    return read_prompt_file(PROMPT_SETS_DIR / prompt_set / filename)


@dataclass(frozen=True)
class InputCheck:
    """One check of an operator's parsed input, in the order the executor applies them.

    The check fails when fewer than `minimum` values are given across `fields` (a non-empty field
    counts 1, a lettered field counts its blocks); the executor then answers the format error
    "I did not follow the required format for the {name} operator. {message}", with `{usage}` in
    `message` replaced by the operator's usage.
    """

    fields: tuple[str, ...]
    message: str
    minimum: int = 1


@dataclass(frozen=True)
class OperatorSpec:
    """One operator.

    Attributes:
        name: the name the policy writes, `<tool>{name}: ...</tool>`.
        description: what the policy's operator list says about it (the faithful set's words).
        usage: the exact call syntax shown to the policy.
        input_fields: tags parsed out of the content (e.g. ("question", "solution")), each the
            stripped text of its first block ("" if absent) unless listed in `lettered_fields`; an
            empty tuple means the whole content, stripped, is one free-text field named `input`.
        template: the executor prompt (the faithful set's), a `str.format` template over
            `template_fields`; None for operators that call no LLM (Search, WarningOp).
        template_fields: placeholders the template may use; all of them are filled on every call.
        required_tags: tags the executor LLM must produce; a reply missing one is repaired (3 tries).
        uses_llm: whether the operator calls the executor LLM.
        input_checks: the format errors for missing input, checked in order before any LLM call.
        lettered_fields: (input tag, template field) pairs: every block of the tag is parsed, and
            the list fills the template field as "A: first\\n\\nB: second\\n\\n..." (ScEnsemble).
        reply_tag: the reply tag the observation reports, as "{label} {reply_tag}: TEXT"; a reply
            without it is passed through raw.
        reply_thought: also report the reply's `<think>` as "{label} thought process: ..." first.
        reply_label: the name the observation uses; None means `name`.
        samples: independent LLM calls per operator call; more than one are listed as
            "[Answer 1]\\n...\\n\\n[Answer 2]\\n..." (MultiAnswerGenerate).
    """

    name: str
    description: str
    usage: str
    input_fields: tuple[str, ...]
    template: str | None
    template_fields: tuple[str, ...]
    required_tags: tuple[str, ...]
    uses_llm: bool
    input_checks: tuple[InputCheck, ...] = ()
    lettered_fields: tuple[tuple[str, str], ...] = ()
    reply_tag: str = "answer"
    reply_thought: bool = True
    reply_label: str | None = None
    samples: int = 1


def _after_colon(what: str, end: str = "") -> InputCheck:
    """The free-text content must not be empty."""
    message = f"I need to write the {what} after the colon: {{usage}}{end}"
    return InputCheck((FREE_TEXT_FIELD,), message)


def _inside(tag: str) -> InputCheck:
    """Tag `tag` must be given, non-empty."""
    return InputCheck((tag,), f"I need to give the {tag} inside <{tag}></{tag}>.")


# Fixed text of the WarningOp observation (first person, as in the paper's appendix D.1).
WARNING_TEXT = (
    "WARNING!!! I did not follow the required format. If I want to use an operator, I should use "
    "<tool>OperatorName: input</tool>. If I want to give the final answer, I should use "
    "<answer>...</answer>."
)

OPERATORS: Mapping[str, OperatorSpec] = {
    spec.name: spec
    for spec in (
        OperatorSpec(
            name="AnswerGenerate",
            description=builtin_text("faithful", "AnswerGenerate.description.txt"),
            usage="<tool>AnswerGenerate: YOUR_QUESTION</tool>",
            input_fields=(),
            template=builtin_text("faithful", "AnswerGenerate.template.txt"),
            template_fields=("input",),
            required_tags=("think", "answer"),
            uses_llm=True,
            input_checks=(_after_colon("input"),),
        ),
        OperatorSpec(
            name="Custom",
            description=builtin_text("faithful", "Custom.description.txt"),
            usage="<tool>Custom: <task>YOUR_TASK_CONTENT</task><instruction>YOUR_INSTRUCTION"
            "</instruction></tool>",
            input_fields=("task", "instruction"),
            template=builtin_text("faithful", "Custom.template.txt"),
            template_fields=("task", "instruction"),
            required_tags=("answer",),
            uses_llm=True,
            input_checks=(InputCheck(("task", "instruction"), "I need to give the task inside "
                                     "<task></task> and the instruction inside "
                                     "<instruction></instruction>."),),
            reply_thought=False,
        ),
        OperatorSpec(
            name="PromptOptimizer",
            description=builtin_text("faithful", "PromptOptimizer.description.txt"),
            usage="<tool>PromptOptimizer: YOUR_QUERY</tool>",
            input_fields=(),
            template=builtin_text("faithful", "PromptOptimizer.template.txt"),
            template_fields=("input",),
            required_tags=("think", "answer"),
            uses_llm=True,
            input_checks=(_after_colon("input"),),
        ),
        OperatorSpec(
            name="Review",
            description=builtin_text("faithful", "Review.description.txt"),
            usage="<tool>Review: <question>ORIGINAL_QUESTION</question><solution>"
            "SOLUTION_TO_REVIEW</solution></tool>",
            input_fields=("question", "solution"),
            template=builtin_text("faithful", "Review.template.txt"),
            template_fields=("question", "solution"),
            required_tags=("feedback",),
            uses_llm=True,
            input_checks=(_inside("question"), _inside("solution")),
            reply_tag="feedback",
            reply_thought=False,
        ),
        OperatorSpec(
            name="Revise",
            description=builtin_text("faithful", "Revise.description.txt"),
            usage="<tool>Revise: <question>ORIGINAL_QUESTION</question><solution>"
            "SOLUTION_TO_REVISE</solution><feedback>FEEDBACK_RECEIVED</feedback></tool>",
            input_fields=("question", "solution", "feedback"),
            template=builtin_text("faithful", "Revise.template.txt"),
            template_fields=("question", "solution", "feedback"),
            required_tags=("think", "answer"),
            uses_llm=True,
            input_checks=(_inside("question"), _inside("solution"), _inside("feedback")),
        ),
        OperatorSpec(
            name="MultiAnswerGenerate",
            description=builtin_text("faithful", "MultiAnswerGenerate.description.txt"),
            usage="<tool>MultiAnswerGenerate: YOUR_QUESTION</tool>",
            input_fields=(),
            template=builtin_text("faithful", "AnswerGenerate.template.txt"),
            template_fields=("input",),
            required_tags=("think", "answer"),
            uses_llm=True,
            input_checks=(_after_colon("question"),),
            reply_thought=False,
            reply_label="AnswerGenerate",
            samples=3,
        ),
        OperatorSpec(
            name="ScEnsemble",
            description=builtin_text("faithful", "ScEnsemble.description.txt"),
            usage="<tool>ScEnsemble: <query>ORIGINAL_QUESTION</query><solution>CANDIDATE_1"
            "</solution>...<solution>CANDIDATE_N</solution></tool>",
            input_fields=("query", "solution"),
            template=builtin_text("faithful", "ScEnsemble.template.txt"),
            template_fields=("query", "solutions"),
            required_tags=("think", "answer"),
            uses_llm=True,
            input_checks=(
                _inside("query"),
                InputCheck(("solution",), "I need to give the candidate solutions, each inside "
                                          "<solution></solution>."),
                InputCheck(("solution",), "Ensembling a single solution is meaningless: I need at "
                                          "least two candidates, each inside its own "
                                          "<solution></solution>.", minimum=2),
            ),
            lettered_fields=(("solution", "solutions"),),
        ),
        OperatorSpec(
            name="Search",
            description=builtin_text("faithful", "Search.description.txt"),
            usage="<tool>Search: YOUR_QUERY</tool>",
            input_fields=(),
            template=None,
            template_fields=(),
            required_tags=(),
            uses_llm=False,
            input_checks=(_after_colon("query", end="."),),
        ),
        OperatorSpec(
            name="WarningOp",
            description="A special operator that returns a warning when the required output format "
            "was not followed. It is emitted by the parser, never called by the policy.",
            usage="(none: emitted by the parser)",
            input_fields=(),
            template=None,
            template_fields=(),
            required_tags=(),
            uses_llm=False,
        ),
    )
}

VARIANT_POOLS: Mapping[str, tuple[str, ...]] = {
    "workflow_r1": (
        "AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise",
        "MultiAnswerGenerate", "ScEnsemble",
    ),
    "workflow_r1_search": (
        "AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise", "Search", "ScEnsemble",
    ),
    # Code-faithful behaviour of the release (docs/paper.md, Our choices): every operator is callable whatever the
    # prompt lists. Rendered as a prompt it lists all eight callable operators.
    "all": (
        "AnswerGenerate", "Custom", "PromptOptimizer", "Review", "Revise",
        "MultiAnswerGenerate", "ScEnsemble", "Search",
    ),
}

_VARIANT_ALIASES = {
    "workflow-r1": "workflow_r1",
    "workflow-r1-search": "workflow_r1_search",
    "search": "workflow_r1_search",
    "plain": "workflow_r1",
}


def pool_for(variant: str | Sequence[str]) -> tuple[str, ...]:
    """Operator names available to the policy in `variant`.

    `variant` is a registered name ("workflow_r1", "workflow_r1_search", "all"; the paper's spellings
    "Workflow-R1" / "Workflow-R1-Search" also work) or an explicit sequence of operator names.
    """
    if not isinstance(variant, str):
        names = tuple(variant)
        unknown = [n for n in names if n not in OPERATORS or n == "WarningOp"]
        if unknown:
            raise ValueError(
                f"operator pool has unknown or non-callable operators {unknown}; "
                f"choose from {[n for n in OPERATORS if n != 'WarningOp']}"
            )
        return names
    key = variant.strip().lower()
    key = _VARIANT_ALIASES.get(key, key)
    if key not in VARIANT_POOLS:
        raise ValueError(
            f"unknown operator-pool variant {variant!r}; use one of {sorted(VARIANT_POOLS)} "
            "or pass a sequence of operator names"
        )
    return VARIANT_POOLS[key]


def render_operator_list(pool: Sequence[str], descriptions: Mapping[str, str] | None = None) -> str:
    """The numbered operator descriptions and usages placed in the policy prompt; `descriptions`
    (a prompt set's) replaces the registry's per operator."""
    descriptions = descriptions or {}
    blocks = []
    for i, name in enumerate(pool, 1):
        spec = OPERATORS[name]
        description = descriptions.get(name, spec.description)
        blocks.append(f"{i}. {spec.name}\nDescription: {description}\nUsage: {spec.usage}")
    return "\n\n".join(blocks)


def template_placeholders(template: str) -> list[str]:
    """The `{field}` names a `str.format` template uses, in order (raises ValueError if malformed)."""
    return [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]


def validate_template(name: str, template: str) -> None:
    """Check that `template` is usable as the executor prompt of operator `name`.

    Only bare placeholders from the operator's `template_fields` are allowed (no attribute access,
    indexing, conversions or format specs, which would let a caller read object internals or
    allocate huge padded strings), and every field must be used at least once, or the operator's
    input would be silently dropped. Raises ValueError naming the problem and the fix.
    """
    spec = OPERATORS.get(name)
    if spec is None or spec.template is None:
        raise ValueError(f"operator {name!r} takes no prompt template (it calls no LLM)")
    allowed = set(spec.template_fields)
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"template for {name} is not a valid str.format template ({exc}); "
            "write literal braces as '{{' and '}}'"
        ) from None
    used = set()
    for _, field, spec_str, conversion in parsed:
        if field is None:
            continue
        if field not in allowed:
            raise ValueError(
                f"template for {name} uses placeholder {{{field}}}; allowed: "
                f"{sorted('{' + f + '}' for f in allowed)}"
            )
        if spec_str or conversion:
            raise ValueError(
                f"template for {name} uses a conversion or format spec on {{{field}}}; "
                "write the bare placeholder"
            )
        used.add(field)
    missing = allowed - used
    if missing:
        raise ValueError(
            f"template for {name} never uses {sorted('{' + f + '}' for f in missing)}; "
            "the operator's input would be dropped"
        )
