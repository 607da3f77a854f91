"""Multi-turn tool calling over a small deterministic calendar-and-contacts environment, scored on
trajectories (rlmopt/metrics.py: tool precision and recall, argument match, sequence match,
final-state equality, JSON validity), with an optional LM step judge.

Point it at your own file: `--task=tool_calls:FILE` (default: the bundled set,
`tasks/data/tool_calls.json`, written for this project). FILE is a JSON list or .jsonl of

    {"id": "...", "request": "what the user asks",
     "state": {"contacts": {name: email}, "events": {id: {"title", "date", "time", "guests"}}},
     "calls": [{"name": tool, "arguments": {...}}, ...]}    # the gold trajectory

The gold final state is the environment's state after the gold calls (computed, so a file cannot
hold an inconsistent one). Tools (`CalendarEnv`): find_contact(name), list_events(date),
create_event(title, date, time) (new id ev<N+1>), cancel_event(event_id), invite(event_id, email).

An episode (`ToolEpisodeLM`, the harness's task LM for this task): each turn the task LM sees the
candidate (request filled in) and every earlier turn's calls and results, and replies with a JSON
list of calls (`[]`: done); at most `max_turns` turns; a reply that is not such a list ends the
episode. The cached reply is the episode's JSON trace. Fields (weights): tool_recall 0.2,
tool_precision 0.1, argument_match 0.2, sequence_match 0.1, final_state_equal 0.3, json_valid 0.1
(the share of turns whose reply parsed); with a step judge, step_judge 0.1 (the share of turns
with calls the judge LM calls useful). `simulated_agent` is a deterministic stand-in task LM.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rlmopt import metrics
from rlmopt.lm import Completion, FunctionLM
from rlmopt.task import Example, Field, Task

BUNDLED = Path(__file__).with_name("data") / "tool_calls.json"
CALL_FIELDS = ("tool_recall", "tool_precision", "argument_match", "sequence_match")
FIELDS = (Field("tool_recall", "tool_recall", 0.2), Field("tool_precision", "tool_precision", 0.1),
          Field("argument_match", "argument_match", 0.2),
          Field("sequence_match", "sequence_match", 0.1),
          Field("final_state_equal", "final_state_equal", 0.3),
          Field("json_valid", "json_valid", 0.1))
JUDGE_FIELD = Field("step_judge", "exact_match", 0.1)  # scored from the trace, not by the metric
SEED = {"system_prompt": "You help a user manage their calendar and contacts with tools.\n\n"
                         "User request: {request}",
        "tool_descriptions": "Tools:\n- find_contact(name): a contact's email\n"
                             "- list_events(date): the events of one day\n"
                             "- create_event(title, date, time): a new event; returns its id\n"
                             "- cancel_event(event_id): removes an event\n"
                             "- invite(event_id, email): adds a guest to an event"}


class CalendarEnv:
    """The deterministic tool environment over one state (deep-copied)."""

    TOOLS = ("find_contact", "list_events", "create_event", "cancel_event", "invite")

    def __init__(self, state: Mapping[str, Any]):
        self.state = copy.deepcopy(dict(state))
        self.state.setdefault("contacts", {})
        self.state.setdefault("events", {})

    def call(self, name: str, arguments: Mapping[str, Any]) -> Any:
        if name not in self.TOOLS:
            return {"error": f"unknown tool {name!r}"}
        try:
            return getattr(self, "_" + name)(**arguments)
        except TypeError as exc:
            return {"error": f"{name}: {exc}"}

    def _find_contact(self, name):
        email = self.state["contacts"].get(str(name))
        return {"name": name, "email": email} if email else {"error": f"no contact named {name!r}"}

    def _list_events(self, date):
        return [{"id": k, **v} for k, v in sorted(self.state["events"].items()) if v["date"] == date]

    def _create_event(self, title, date, time):
        ids = [int(k[2:]) for k in self.state["events"] if re.fullmatch(r"ev\d+", k)]
        new = f"ev{max(ids, default=0) + 1}"
        self.state["events"][new] = {"title": str(title), "date": str(date), "time": str(time),
                                     "guests": []}
        return {"id": new}

    def _cancel_event(self, event_id):
        if self.state["events"].pop(str(event_id), None) is None:
            return {"error": f"no event {event_id!r}"}
        return {"cancelled": event_id}

    def _invite(self, event_id, email):
        event = self.state["events"].get(str(event_id))
        if event is None:
            return {"error": f"no event {event_id!r}"}
        if email not in event["guests"]:
            event["guests"].append(str(email))
        return {"invited": email, "event_id": event_id}


def final_state(state: Mapping[str, Any], calls: list[dict]) -> dict:
    env = CalendarEnv(state)
    for c in calls:
        env.call(c["name"], c.get("arguments", {}))
    return env.state


class ToolCallTask(Task):
    """A Task whose reply is an episode trace (JSON) scored on its trajectory."""

    def render(self, candidate: Mapping[str, str], example: Example) -> str:
        """The episode request: the opening prompt (components, request filled) and the state."""
        opening = super().render(candidate, Example(example.id, {"request": example.inputs["request"]}, {}))
        return json.dumps({"prompt": opening, "state": example.inputs["state"]})

    def parse(self, reply: str) -> dict[str, Any]:
        try:
            trace = json.loads(reply)
        except ValueError:
            trace = None
        if not isinstance(trace, dict):  # a bare trajectory (score_explain) or a failed call's text
            calls = metrics.parse_calls(reply)
            trace = {"calls": calls or [], "turns": [{"valid": calls is not None}], "state": None}
        turns = trace.get("turns") or []
        out = {f: json.dumps(trace.get("calls", [])) for f in CALL_FIELDS}
        out["final_state_equal"] = trace.get("state")
        out["json_valid"] = sum(bool(t.get("valid")) for t in turns) / len(turns) if turns else 0.0
        verdicts = [t["judge"] for t in turns if "judge" in t]
        out["step_judge"] = sum(verdicts) / len(verdicts) if verdicts else 0.0
        return out

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        gold = example.expected
        out = {f: metrics.get_metric(f)(prediction.get(f, "[]"), gold[f]) for f in CALL_FIELDS}
        out["final_state_equal"] = metrics.final_state_equal(prediction.get("final_state_equal"),
                                                             gold["final_state_equal"])
        out["json_valid"] = float(prediction.get("json_valid", 0.0))
        if "step_judge" in self.weights:
            out["step_judge"] = float(prediction.get("step_judge", 0.0))
        return out


def _records(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("expected a JSON list of records (or a .jsonl file)")
    return data


def build(path: str = "", step_judge: bool = False) -> ToolCallTask:
    """The task over the records in `path` (default: the bundled set); `step_judge` adds the
    step_judge field (the task LM then needs a judge: `ToolEpisodeLM(judge=...)`)."""
    file = Path(path) if path else BUNDLED
    try:
        records = _records(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tool_calls file {file}: cannot read it ({exc})") from None
    examples = []
    for n, r in enumerate(records):
        missing = [k for k in ("request", "state", "calls") if k not in r]
        calls = metrics.parse_calls(r.get("calls"))
        if missing or calls is None:
            raise ValueError(f"{file} record {n + 1}: needs request, state and calls (a list of "
                             "{\"name\", \"arguments\"}); see rlmopt/tasks/tool_calls.py")
        unknown = sorted({c["name"] for c in calls} - set(CalendarEnv.TOOLS))
        if unknown:
            raise ValueError(f"{file} record {n + 1}: unknown tool(s) {unknown}; the environment "
                             f"has {list(CalendarEnv.TOOLS)}")
        expected = {f: calls for f in CALL_FIELDS}
        expected.update(final_state_equal=final_state(r["state"], calls), json_valid=1.0)
        examples.append(Example(str(r.get("id", f"tc{n:05d}")),
                                {"request": r["request"], "state": r["state"]}, expected))
    return ToolCallTask(
        name="tool_calls",
        description=("A multi-turn tool-calling assistant over a calendar-and-contacts environment. "
                     "Each turn the task model sees the prompt (the request in {request}) and the "
                     "earlier calls and results, and must reply with a JSON list of tool calls "
                     "[{\"name\": ..., \"arguments\": {...}}], or [] when done. Scored on the "
                     "trajectory against the gold calls and on the final environment state."),
        examples=examples, fields=list(FIELDS) + ([JUDGE_FIELD] if step_judge else []),
        seed_candidate=dict(SEED), max_tokens=192)


def _transcript(opening: str, turns: list[dict]) -> str:
    parts = [opening]
    for k, t in enumerate(turns, 1):
        parts.append(f"Turn {k} calls: {json.dumps(t['calls'])}\nTurn {k} results: "
                     f"{json.dumps(t['results'])}")
    return "\n\n".join(parts) + "\n\nYour reply:"  # the format is the prompt's to teach


@dataclass(frozen=True)
class EpisodeCompletion(Completion):
    """An episode's completion; `prompt_estimated`: some turn's prompt tokens were estimated
    (lm.Meter then marks the role's prompt tokens as estimated)."""

    prompt_estimated: bool = False


class EpisodeUsage:
    """What an episode's LM calls used, summed for the task role's meter: completion, prompt and
    cached tokens (reported by the backend, else characters / 4), and whether some turn's prompt
    tokens were estimated rather than reported."""

    def __init__(self) -> None:
        self.tokens = self.prompt_tokens = self.cached = 0
        self.estimated = False

    def add(self, prompt: str, out: Completion) -> None:
        self.tokens += out.tokens or len(out.text) // 4
        reported = getattr(out, "prompt_tokens", 0)
        self.estimated = self.estimated or not reported
        self.prompt_tokens += reported or len(prompt) // 4
        self.cached += getattr(out, "cached_tokens", 0) if reported else 0

    def completion(self, text: str) -> EpisodeCompletion:
        """The episode's Completion: `text` with the summed usage."""
        return EpisodeCompletion(text, "stop", self.tokens, prompt_tokens=self.prompt_tokens,
                                 cached_tokens=self.cached, prompt_estimated=self.estimated)


class ToolEpisodeLM:
    """The task LM of the tool-calling task: runs one episode per request (ToolCallTask.render)
    with `lm` as the assistant; `judge` (optional) rates each turn with calls. `llm_calls`
    counts the assistant's and the judge's calls (the record's executor_llm_calls); the
    Completion of an episode carries their summed prompt, cached and completion tokens (reported
    by the backend, else characters / 4), so the task role's meter counts every turn."""

    name = "tool_episode"

    def __init__(self, lm: Any, judge: Any = None, max_turns: int = 6):
        self.lm, self.judge, self.max_turns = lm, judge, max_turns
        self.llm_calls = 0

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        request = json.loads(prompt)
        env = CalendarEnv(request["state"])
        turns: list[dict] = []
        usage = EpisodeUsage()

        async def ask(lm: Any, text: str, limit: int) -> Completion:
            out = await lm.complete(text, limit)
            self.llm_calls += 1
            usage.add(text, out)
            return out

        for _ in range(self.max_turns):
            out = await ask(self.lm, _transcript(request["prompt"], turns), max_tokens)
            calls = metrics.parse_calls(out.text)
            turn = {"reply": out.text, "valid": calls is not None, "calls": calls or [],
                    "results": [env.call(c["name"], c["arguments"]) for c in calls or []]}
            if calls and self.judge is not None:
                question = (f"{_transcript(request['prompt'], turns)}\n\nThe assistant replied "
                       f"{json.dumps(calls)}. Is this a correct and useful next step for the "
                       "request? Answer yes or no.")
                verdict = await ask(self.judge, question, 4)
                turn["judge"] = float(verdict.text.strip().lower().startswith("yes"))
            turns.append(turn)
            if not calls:  # [] ends the episode, and so does a reply that is not a call list
                break
        trace = {"request": request["prompt"][-300:], "turns": turns,
                 "calls": [c for t in turns for c in t["calls"]], "state": env.state}
        return usage.completion(json.dumps(trace))


FORMAT_KEYWORD = "json list"
DATE_KEYWORD = "yyyy-mm-dd"
_MONTHS = ("January February March April May June July August September October November "
           "December").split()


def _loose_date(value: str) -> str:
    m = re.fullmatch(r"\d{4}-(\d{2})-(\d{2})", str(value))
    return f"{_MONTHS[int(m.group(1)) - 1]} {int(m.group(2))}" if m else value


def simulated_agent(task: ToolCallTask) -> FunctionLM:
    """A deterministic assistant that knows each request's gold calls: it replies with JSON only
    when the prompt asks for a "JSON list" (else with prose, which ends the episode), one gold
    call per turn, then []; it writes dates as YYYY-MM-DD only when the prompt says so (else
    "March 4"), so the arguments and the final state miss."""
    plans = {e.inputs["request"]: e.expected["sequence_match"] for e in task.examples}

    def reply(prompt: str) -> str:
        low = prompt.lower()
        plan = next((p for r, p in plans.items() if r in prompt), None)
        if plan is None or FORMAT_KEYWORD not in low:
            return "Sure, I will take care of that for you."
        done = prompt.count(" results: ")
        if done >= len(plan):
            return "[]"
        call = copy.deepcopy(plan[done])
        if DATE_KEYWORD not in low and "date" in call["arguments"]:
            call["arguments"]["date"] = _loose_date(call["arguments"]["date"])
        return json.dumps([call])
    return FunctionLM(reply)
