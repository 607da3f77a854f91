"""Prompt sets: every word the policy and the executor LLM read, as data selected by `env.prompt_set`.

A prompt set is a directory of text files (docs/paper.md, Prompt sets):

    system.txt                    the system message
    policy.txt                    the user message, a `str.format` template over {operators},
                                  {max_calls} and {question}, each used
    <Operator>.description.txt    what the policy's operator list says about <Operator>
    <Operator>.template.txt       the executor prompt of an LLM operator, a `str.format` template over
                                  that operator's fields (`operators.validate_template`)
    demonstration.json            optional: a worked episode the conversation opens with, as chat
                                  turns (`Demonstration`); the question then follows in a user message

Built in: `faithful` (the default: our wording of every instruction and operator detail of the
paper's appendix D and the release, at the same strength) and `concise` (our earlier, shorter
wording, whose executor prompts add instructions the paper's operators do not have: a short-phrase
answer, "do not answer the query yourself", "not its letter"); `local` (the `local` preset's: the concise
set with a shorter user message that ends in one worked example, for the 0.5B policy of a laptop
run, which follows neither longer set's format; a deviation, docs/paper.md). Any other value of `env.prompt_set` is a
directory (local or a URI such as gs://bucket/prompts, `workflow_r1.storage`) whose files replace
those of `faithful`, one by one; a missing file keeps the faithful text. MultiAnswerGenerate runs
AnswerGenerate's template unless the set has its own file.

`load(spec)` reads and checks a set once; every problem is one line naming the set, the file and
the fix.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Mapping

from workflow_r1 import storage
from workflow_r1.task import operators

DEFAULT = "faithful"
BUILTIN = ("faithful", "concise", "local", "local_search")
# A built-in set's files go over these sets' files, in order, and all of them over the faithful ones.
_UNDER = {"local": ("concise",), "local_search": ("concise",)}
POLICY_FIELDS = ("operators", "max_calls", "question")

_SYSTEM, _POLICY, _DEMO = "system.txt", "policy.txt", "demonstration.json"
_DESCRIPTION, _TEMPLATE = ".description.txt", ".template.txt"


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """A worked episode the policy's conversation opens with (a prompt set's demonstration.json):
    the user message of `question`, then `messages` (assistant turns and the tool messages between
    them, as an episode records them), then a user message `then` over {question} that asks the
    real question. A small model follows turns it has seen far better than a description of them."""

    question: str
    messages: tuple[tuple[str, str], ...]
    then: str


def parse_demonstration(text: str, where: str = _DEMO) -> Demonstration:
    """A demonstration.json, checked: {"question": str, "messages": [{"role": "assistant" | "tool",
    "content": str}, ...] alternating from an assistant turn to an assistant turn, "then": a template
    over exactly {question}}. Raises ValueError naming `where` and the fix."""
    import json

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or set(data) != {"question", "messages", "then"}:
        raise ValueError(f"{where} must be an object with exactly the keys question, messages and then")
    question, messages = data["question"], data["messages"]

    def turn_ok(i: int, m: Any) -> bool:  # assistant turns at even places, tool messages between them
        return (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] == ("tool", "assistant")[i % 2 == 0]
                and isinstance(m["content"], str) and bool(m["content"].strip()))

    if (not isinstance(question, str) or not question.strip() or not isinstance(messages, list)
            or len(messages) % 2 == 0 or not all(turn_ok(i, m) for i, m in enumerate(messages))):
        raise ValueError(f"{where}: question must be a non-empty string and messages a list of "
                         '{"role", "content"} objects alternating assistant, tool, ..., assistant')
    then = data["then"]
    try:
        used = set(operators.template_placeholders(then)) if isinstance(then, str) else None
    except ValueError:
        used = None
    if used != {"question"}:
        raise ValueError(f"{where}: then must be a str.format template using exactly {{question}}")
    return Demonstration(question.strip(), tuple((m["role"], m["content"]) for m in messages), then)


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """The texts of one prompt set, checked.

    name: the `env.prompt_set` value it was loaded from.
    system, policy: the system message and the user-message template.
    descriptions: operator name -> description shown to the policy (every listable operator).
    templates: operator name -> executor prompt template (every LLM operator).
    """

    name: str
    system: str
    policy: str
    descriptions: Mapping[str, str]
    templates: Mapping[str, str]
    demonstration: Demonstration | None = None


def _slots() -> dict[str, tuple[str, str]]:
    """File name -> (kind, operator) for every file a set may hold."""
    slots = {_SYSTEM: ("system", ""), _POLICY: ("policy", ""), _DEMO: ("demonstration", "")}
    for name, spec in operators.OPERATORS.items():
        if name == "WarningOp":  # never listed to the policy, calls no LLM
            continue
        slots[name + _DESCRIPTION] = ("description", name)
        if spec.uses_llm:
            slots[name + _TEMPLATE] = ("template", name)
    return slots


def validate_policy(text: str, where: str = "policy.txt") -> None:
    """Check that `text` is usable as a set's user-message template: a `str.format` template using
    exactly {operators}, {max_calls} and {question}. Raises ValueError naming `where` and the fix."""
    try:
        used = set(operators.template_placeholders(text))
    except ValueError as exc:
        raise ValueError(f"{where} is not a str.format template ({exc}); write literal braces as '{{{{' and "
                         "'}}'") from None
    missing = [f for f in POLICY_FIELDS if f not in used]
    extra = sorted(used - set(POLICY_FIELDS))
    if missing or extra:
        raise ValueError(f"{where} must use exactly the placeholders {{operators}}, {{max_calls}} and "
                         f"{{question}}; missing {missing}, unknown {extra}")


def _read_dir(directory: pathlib.Path | storage.Path, label: str) -> dict[str, str]:
    """File name -> text of every prompt file in `directory` (local or a URI), each checked."""
    slots = _slots()
    texts = {}
    with storage.reading(label, "prompt set"):
        paths = sorted(directory.iterdir())
    for path in paths:
        if path.name.startswith("."):
            continue
        where = f"prompt set {label}: {path.name}"
        if path.name not in slots:
            raise ValueError(f"{where} is not a prompt file; use system.txt, policy.txt, demonstration.json, "
                             "<Operator>.description.txt or <Operator>.template.txt (LLM operators)")
        with storage.reading(path, f"prompt set {label}: file"):
            text = operators.read_prompt_file(path)
        if not text.strip():
            raise ValueError(f"{where} is empty; delete it to keep the faithful text")
        kind, op = slots[path.name]
        if kind == "policy":
            validate_policy(text, where)
        elif kind == "demonstration":
            parse_demonstration(text, where)
        elif kind == "template":
            try:
                operators.validate_template(op, text)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        texts[path.name] = text
    return texts


def write(directory: str | pathlib.Path, *, policy: str | None = None, templates: Mapping[str, str] | None = None,
          base: str | None = None) -> pathlib.Path:
    """Writes a prompt-set directory and checks it loads as `env.prompt_set=DIR` would.

    base: a set (built-in name or directory) whose files are copied first (None: none, so the
    faithful text fills every missing file); policy: the user-message template (policy.txt);
    templates: operator name -> executor prompt (<Operator>.template.txt, LLM operators only).
    The only place outside `load` that knows the files' names.
    """
    import shutil

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if base is not None:
        source = operators.PROMPT_SETS_DIR / base if base in BUILTIN else pathlib.Path(base)
        if source.resolve() != directory.resolve():
            for path in source.iterdir():
                if path.is_file() and not path.name.startswith(".") and path.name in _slots():
                    shutil.copyfile(path, directory / path.name)
    files = {}
    if policy is not None:
        validate_policy(policy, "the policy template")
        files[_POLICY] = policy
    for op, text in (templates or {}).items():
        if op not in operators.OPERATORS or operators.OPERATORS[op].template is None:
            raise ValueError(f"component {op!r} is not an LLM operator's template; a prompt set "
                             f"holds <Operator>{_TEMPLATE} files only for LLM operators")
        files[op + _TEMPLATE] = text
    for name, text in files.items():
        (directory / name).write_text(text + "\n", encoding="utf-8")
    load.cache_clear()  # the directory may have been loaded before with other texts
    load(str(directory))
    return directory


@functools.cache
def load(spec: str = DEFAULT) -> PromptSet:
    """The prompt set named `spec` (a built-in name or a directory, local or a URI), over the faithful one.

    Raises ValueError with a one-line message for an unknown name, a missing or unreadable directory
    or any bad file (unknown name, empty, a template with a wrong or missing placeholder).
    """
    faithful = _read_dir(operators.PROMPT_SETS_DIR / DEFAULT, DEFAULT)
    if spec in BUILTIN:
        directory, label = operators.PROMPT_SETS_DIR / spec, spec
    else:
        directory, label = storage.source(spec), spec
        with storage.reading(spec, "env.prompt_set"):
            found = directory.is_dir()
        if not found:
            raise ValueError(f"env.prompt_set {spec!r} is neither a built-in set {list(BUILTIN)} nor a "
                             "directory of prompt files")
    texts = dict(faithful)
    for under in _UNDER.get(spec, ()):
        texts.update(_read_dir(operators.PROMPT_SETS_DIR / under, under))
    texts.update(_read_dir(directory, label) if spec != DEFAULT else {})
    descriptions, templates = {}, {}
    for filename, (kind, op) in _slots().items():
        if kind == "description":
            descriptions[op] = texts[filename]
        elif kind == "template":
            own = texts.get(filename)
            # MultiAnswerGenerate samples AnswerGenerate's prompt unless the set words it apart.
            templates[op] = own if own is not None else texts["AnswerGenerate" + _TEMPLATE]
    demo = parse_demonstration(texts[_DEMO]) if _DEMO in texts else None
    return PromptSet(name=spec, system=texts[_SYSTEM], policy=texts[_POLICY], descriptions=descriptions,
                     templates=templates, demonstration=demo)
