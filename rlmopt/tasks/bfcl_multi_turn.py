"""BFCL multi-turn (the Berkeley Function-Calling Leaderboard v4, from the pinned `bfcl-eval` wheel:
rlmopt/tasks/bfcl_package.py): the benchmark's data, function documents, executable environment
classes and multi-turn checker, with the tool-calling instruction as the optimizable prompt.

    --task=bfcl_multi_turn[:SPLIT][,docs=json|compact][,steps=N][,n=N]

SPLIT: base (default), long_context, miss_func or miss_param (200 entries each). `docs`: how the
function documents are shown, `json` (the benchmark's default prompt: the JSON list, indented) or
`compact` (one line per function: name, typed parameters, description without the class's shared
preamble; about a third of the tokens, for small-context task LMs). `steps`: the most steps of one
turn (BFCL's is 20; past it the episode is force-terminated and fails). `n`: the first N entries
by id number (0: all). Splits are the usual seeded 40/30/30 percent (rlmopt/task.py).

Components (the candidate): `system_prompt`, the tool-calling instruction (seed: BFCL's own default
system prompt, its `{functions}` placeholder filled with the entry's documents), `tool_guidance`
(free text on using the tools, shown after the documents; the documents themselves are benchmark
input and stay fixed), and `demonstrations` (worked examples; seed: one short format example
written for this project).

Rollout (`BfclEpisodeLM`), as BFCL's prompting handler runs it: the user turns arrive in order (a
miss_func holdout turn brings the held-out documents with BFCL's "I have updated some more
functions" message); in each turn the task LM replies, the reply is decoded (`decode`) and its calls
run in order in the benchmark's own environment instances (the package's
`execute_multi_turn_func_call`), their results go back to the LM, and the turn ends on a reply
that decodes to no call or does not decode. The task LM sees one text: the system prompt, then the
conversation so far ("User:", "Assistant:", "Tool result (CALL):" lines).

Decoding, execution and scoring: rlmopt/tasks/bfcl_calls.py.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from rlmopt.lm import BackendError
from rlmopt.task import Example, Field, Task
from rlmopt.tasks import bfcl_package
from rlmopt.tasks.bfcl_calls import Session, check, decode, guard  # noqa: F401 (re-exported)
from rlmopt.tasks.tool_calls import EpisodeCompletion, EpisodeUsage

SPLITS = ("base", "long_context", "miss_func", "miss_param")
FIELDS = (Field("accuracy", "exact_match", 0.5), Field("state_match", "exact_match", 0.25),
          Field("response_match", "exact_match", 0.25))  # scored by the checker, not the metric
CLASS_DOCS = {"GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
              "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json",
              "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
              "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json"}
# BFCL's default prompting system prompt (ret_fmt=python, json docs, plaintext, classic style).
SEED_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out. If the given "
    "question lacks the parameters required by the function, also point it out.\n\nYou should "
    "only return the function calls in your response.\n\nIf you decide to invoke any of the "
    "function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)]  You SHOULD NOT include any other text in "
    "the response.\n\nAt each turn, you should try your best to complete the tasks requested by "
    "the user within the current turn. Continue to output functions to call until you have "
    "fulfilled the user's request to the best of your ability. Once you have no more functions to "
    "call, the system will consider the current turn complete and proceed to the next turn or "
    "task.\n\nHere is a list of functions in {{docs_format}} format that you can invoke.\n"
    "{functions}\n")
SEED_DEMO = (
    "Example (a different toolset):\nUser: Make a folder 'notes' and list what is here.\n"
    "Assistant: [mkdir(dir_name='notes'), ls()]\nTool result (mkdir(dir_name='notes')): None\n"
    "Tool result (ls()): {\"current_directory_content\": [\"notes\"]}\nAssistant: Done.")
ADDED_FUNCTIONS = "I have updated some more functions you can choose from. What about now?"
_DOC_PREAMBLE = re.compile(r"^.*?Tool description: ", re.S)


@dataclass(frozen=True)
class Options:
    split: str = "base"
    docs: str = "json"
    steps: int = 20
    n: int = 0


def parse_spec(rest: str) -> Options:
    """Options from the text after `bfcl_multi_turn:` (`SPLIT,docs=compact,steps=4,n=12`)."""
    opts: dict[str, Any] = {}
    for n, part in enumerate(p.strip() for p in rest.split(",") if p.strip()):
        key, eq, value = part.partition("=")
        if not eq and n == 0:
            key, value = "split", key
        if key not in ("split", "docs", "steps", "n"):
            raise ValueError(f"bfcl_multi_turn option {part!r} not understood; use SPLIT, "
                             "docs=json|compact, steps=N, n=N")
        opts[key] = int(value) if key in ("steps", "n") and value.isdigit() else value
    o = Options(**opts)
    if o.split not in SPLITS or o.docs not in ("json", "compact") or \
            not isinstance(o.steps, int) or o.steps < 1 or not isinstance(o.n, int):
        raise ValueError(f"bfcl_multi_turn:{rest}: the split is one of {list(SPLITS)}, docs json or "
                         "compact, steps a positive integer, n a non-negative integer")
    return o


# -- data ------------------------------------------------------------------------------------------

def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_entries(split: str = "base") -> list[dict]:
    """The split's entries, each with `ground_truth` (per turn, the gold call strings), `function`
    (the documents shown from the start) and `holdout` (turn index -> documents added then, the
    miss_func split), in the package's order."""
    data = bfcl_package.data_dir()
    docs = {c: _jsonl(data / "multi_turn_func_doc" / f) for c, f in CLASS_DOCS.items()}
    gold = {g["id"]: g["ground_truth"]
            for g in _jsonl(data / "possible_answer" / f"BFCL_v4_multi_turn_{split}.json")}
    entries = []
    for e in _jsonl(data / f"BFCL_v4_multi_turn_{split}.json"):
        functions = [d for c in e["involved_classes"] for d in docs[c]]
        holdout = {}
        for turn, names in e.get("missed_function", {}).items():
            holdout[int(turn)] = [d for d in functions if d["name"] in names]
            functions = [d for d in functions if d["name"] not in names]
        entries.append({**e, "ground_truth": gold[e["id"]], "function": functions,
                        "holdout": holdout})
    return entries


def render_docs(docs: list[dict], fmt: str) -> str:
    """The function documents as shown to the task LM (module docstring, `docs`)."""
    if fmt == "json":
        return json.dumps(docs, indent=4)
    lines = []
    for d in docs:
        props = d.get("parameters", {}).get("properties", {})
        need = set(d.get("parameters", {}).get("required", []))
        params = ", ".join(f"{k}: {v.get('type', 'any')}" + ("" if k in need else " = optional")
                           for k, v in props.items())
        lines.append(f"- {d['name']}({params}): {_DOC_PREAMBLE.sub('', d['description'])}")
    return "\n".join(lines)


# -- the task --------------------------------------------------------------------------------------

class BfclTask(Task):
    """A Task whose reply is an episode trace (JSON) scored by the BFCL checker. `entries`: id ->
    entry (load_entries); `options`: the spec's options."""

    entries: dict[str, dict]
    options: Options
    gepa_components = ("system_prompt",)  # GEPA's wrapper optimizes the system prompt only

    def functions(self, entry: Mapping[str, Any], docs: list[dict] | None = None) -> str:
        return render_docs(entry["function"] if docs is None else docs, self.options.docs)

    def render(self, candidate: Mapping[str, str], example: Example) -> str:
        """The episode request: the entry id and its system prompt (components, documents in
        `{functions}`, appended when no component names it)."""
        entry = self.entries[example.id]
        system = super().render(candidate, Example(example.id,
                                                   {"functions": self.functions(entry)}, {}))
        return json.dumps({"id": example.id, "system": system})

    def parse(self, reply: str) -> dict[str, Any]:
        try:
            trace = json.loads(reply)
        except ValueError:
            trace = None
        turns = trace.get("turns", []) if isinstance(trace, dict) else []
        decoded = [[s["decoded"] for s in t if s.get("decoded")] for t in turns]
        return {f.name: json.dumps(decoded) for f in self.fields}

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        key = (example.id, prediction.get("accuracy", "[]"))
        if key not in self._scores:
            self._scores[key] = check(json.loads(key[1]), self.entries[example.id])
        return dict(self._scores[key])

    def format_demo(self, example: Example) -> str:
        """The entry's user turns, each with its gold calls in the python-call format."""
        lines = []
        for text, calls in zip(example.inputs["user_turns"], example.expected["accuracy"]):
            lines.append(f"User: {text}\nAssistant: [{', '.join(calls)}]")
        return "\n".join(lines)


def build(spec: str = "") -> BfclTask:
    """The task over `spec`'s split and options (module docstring)."""
    opts = parse_spec(spec)
    entries = load_entries(opts.split)
    entries.sort(key=lambda e: int(e["id"].rsplit("_", 1)[1]))
    if opts.n:
        entries = entries[:opts.n]
    examples = []
    for e in entries:
        users = [" ".join(m["content"] for m in turn if m["role"] == "user") or
                 "(the held-out functions are added here)" for turn in e["question"]]
        examples.append(Example(e["id"], {"user_turns": users,
                                          "involved_classes": e["involved_classes"]},
                                {f.name: e["ground_truth"] for f in FIELDS}))
    task = BfclTask(
        name="bfcl_multi_turn",
        description=("BFCL multi-turn (Berkeley Function-Calling Leaderboard v4, "
                     f"{opts.split} split): an assistant is given a list of functions and a "
                     "conversation whose user turns arrive one by one; in each turn it replies "
                     "with function calls (python-call format [f(a=1), g(b='x')], or a JSON list of "
                     "{\"name\", \"arguments\"}), which run in the benchmark's environments "
                     "(file system, messaging, trading, travel, vehicle, ...) and whose results it "
                     "sees, until it replies without calls. Scored by BFCL's own checker: the final "
                     "state after each turn and the gold calls' results (accuracy), plus the "
                     "per-turn state and response checks. The system prompt's {functions} is "
                     "filled with the entry's function documents."),
        examples=examples, fields=list(FIELDS),
        seed_candidate={"system_prompt": SEED_SYSTEM.replace(
                            "{{docs_format}}", "JSON" if opts.docs == "json" else "compact"),
                        "tool_guidance": "",
                        "demonstrations": SEED_DEMO},
        max_tokens=256)
    task.entries = {e["id"]: e for e in entries}
    task.options = opts
    task._scores = {}
    return task


# -- the rollout -----------------------------------------------------------------------------------

def _transcript(system: str, lines: list[str]) -> str:
    return system + "\n\n" + "\n".join(lines) + "\nAssistant:"


class BfclEpisodeLM:
    """The task LM of the BFCL task: runs one episode per request (BfclTask.render) with `lm` as
    the assistant, in the benchmark's environments. The reply is the trace: per turn, per step the
    raw reply, its decoded calls and their results. `llm_calls` counts the assistant's calls; the
    Completion carries their summed tokens (reported, else characters / 4). An LM error ends the
    episode (recorded; the entry fails as force-terminated)."""

    name = "bfcl_episode"

    def __init__(self, lm: Any, task: BfclTask):
        self.lm, self.task = lm, task
        self.llm_calls = 0

    async def complete(self, prompt: str, max_tokens: int) -> EpisodeCompletion:
        request = json.loads(prompt)
        entry = self.task.entries[request["id"]]
        lines: list[str] = []
        turns: list[list[dict]] = []
        usage, error = EpisodeUsage(), None
        with Session(entry) as env:
            for k, messages in enumerate(entry["question"]):
                if k in entry["holdout"]:
                    messages = [{"role": "user", "content": self.task.functions(
                        entry, entry["holdout"][k]) + "\n" + ADDED_FUNCTIONS}]
                lines += [f"User: {m['content']}" for m in messages if m["role"] == "user"]
                steps: list[dict] = []
                forced = False
                for count in itertools.count(1):
                    text = _transcript(request["system"], lines)
                    try:
                        out = await self.lm.complete(text, max_tokens)
                    except BackendError as exc:  # the turn is lost: the entry fails
                        error = f"{exc.kind}: {exc.message}"
                        break
                    self.llm_calls += 1
                    usage.add(text, out)
                    lines.append(f"Assistant: {out.text.strip()}")
                    calls = decode(out.text)
                    step = {"reply": out.text, "decoded": calls or []}
                    steps.append(step)
                    if not calls:
                        break
                    results, _ = env.run(calls)
                    step["results"] = results
                    lines += [f"Tool result ({c}): {r}" for c, r in zip(calls, results)]
                    if count > self.task.options.steps:  # BFCL keeps this turn, drops the rest
                        forced = True
                        error = f"force-terminated after {count} steps in turn {k}"
                        break
                if error and not forced:
                    break
                turns.append(steps)
                if forced:
                    break
        trace = {"id": entry["id"], "turns": turns, "error": error}
        return usage.completion(json.dumps(trace))


# -- deterministic stand-ins (tests, CPU runs without a model) -------------------------------------

RULE = ("Reply with only the list of calls, nothing else; when the request is done, reply with "
        "plain text and no calls.")


def simulated_agent(task: BfclTask) -> "FunctionLM":
    """A task LM that knows the gold calls: at a turn's first step it replies with them, bare when
    the prompt contains RULE, else wrapped in prose (which does not decode, so the turn ends with
    no call); at a later step it replies "Done."."""
    from rlmopt.lm import FunctionLM

    plans = {}
    for e in task.entries.values():
        for turn, gold in zip(e["question"], e["ground_truth"]):
            for m in turn:
                plans.setdefault(m["content"], gold)

    def reply(prompt: str) -> str:
        head, user, tail = prompt.rpartition("\nUser: ")
        if not user or "\nAssistant: " in tail:
            return "Done."
        calls = "[" + ", ".join(plans.get(tail.removesuffix("\nAssistant:"), [])) + "]"
        return calls if RULE in prompt else f"Sure, I will run {calls} for you."
    return FunctionLM(reply)


def scripted_reflection(prompt: str) -> str:
    """A GEPA reflection LM (a plain callable): the quoted instruction plus RULE, in a ``` block."""
    m = re.search(r"```\n?(.*?)```", prompt, re.S)
    current = m.group(1).strip() if m else ""
    return f"```\n{current if RULE in current else (current + chr(10) * 2 + RULE).strip()}\n```"


def scripted_agent() -> "ScriptedLM":
    """An rlmopt optimizer that writes RULE into tool_guidance, evaluates it on the validation
    split, commits it and stops (it exercises the machinery, not search skill)."""
    from rlmopt.lm import ScriptedLM

    code = ("```python\n"
            "cand = dict(best_so_far()['candidate'])\n"
            f"cand['tool_guidance'] = (cand['tool_guidance'] + '\\n\\n' + {RULE!r}).strip()\n"
            "fb = run_candidate(cand)\n"
            "print(fb.get('summary', fb))\n"
            "print(commit_prompt(cand, 'asks for bare call lists, which the prose replies lack'))\n"
            "final()\n"
            "```")
    return ScriptedLM([code, "```python\nfinal()\n```"])
