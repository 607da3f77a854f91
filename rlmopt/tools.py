"""The agent's tool set (docs/rlmopt.md, Tools): every call from the REPL worker lands here, in the
harness process, so sealing and budgets hold whatever the agent's code does.

`ToolSet.call(name, args, kwargs)` dispatches to one of `TOOL_NAMES` and returns a JSON-able value;
a misuse returns {"error": "..."} instead of raising. The test split is sealed here: its count is
visible, but any test id, test split name or test record is refused by every tool.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter
from typing import Any

from rlmopt.harness import Harness
from rlmopt.lm import BackendError
from rlmopt.metrics import METRICS
from rlmopt.selection import pareto_frontier

NOTE_KINDS = ("fact", "hypothesis", "rule", "warning", "decision")
TOOL_NAMES = (
    "describe_task", "dataset_overview", "peek_examples", "view_example", "query_examples",
    "score_explain", "list_metrics", "list_components", "read_additional_instructions",
    "search_traces", "describe_failure_patterns", "peek_failures", "read_trace",
    "synthesize_failures", "synthesize_candidate", "merge_candidates", "call_subagent",
    "subagent_result", "run_candidate", "commit_prompt", "best_so_far", "remaining_budget", "pareto_frontier_status",
    "scratchpad_add", "scratchpad_read", "final", "skill_library",
)
SEALED = "the test split is sealed: its records cannot be read, queried or evaluated by any tool"


class ToolError(Exception):
    """A misuse the agent can fix; its message is returned as {"error": message}."""


class ToolSet:
    """The tools over one harness. `instructions`: optional operator guidance for
    read_additional_instructions; `library`: the cross-run skill library (rlmopt.library), or
    None (off: the skill_library tool says so)."""

    def __init__(self, harness: Harness, instructions: str = "", library: Any = None):
        self.h = harness
        self.instructions = instructions
        self.library = library
        self.finished = False
        self.agent_lm: Any = None  # set by the Agent using these tools; call_subagent's LM
        # set by the Agent too: agent.call_subagent (the agent loop imports this module, not the reverse)
        self.spawn: Any = None
        self.children: dict[str, Any] = {}  # handle -> subagent.SubagentRun started by these tools
        # time.monotonic() deadline of the code block whose tool calls are being served (set by
        # the Agent's dispatch); None outside an agent run: waits are then unbounded
        self.deadline: float | None = None

    async def call(self, name: str, args: list | tuple = (), kwargs: dict | None = None) -> Any:
        if name not in TOOL_NAMES:
            return {"error": f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}"}
        fn = getattr(self, name)
        try:
            inspect.signature(fn).bind(*args, **(kwargs or {}))
        except TypeError as exc:
            return {"error": f"{name}{inspect.signature(fn)}: {exc}"}
        try:
            out = fn(*args, **(kwargs or {}))
            if inspect.isawaitable(out):
                out = await out
        except ToolError as exc:
            return {"error": str(exc)}
        except ValueError as exc:  # e.g. a malformed candidate
            return {"error": f"{name}: {exc}"}
        return json.loads(json.dumps(out, default=str))

    # -- sealing helpers ---------------------------------------------------------------------------

    def _split(self, split: str) -> list:
        if split == "test":
            raise ToolError(SEALED)
        if split not in ("train", "val"):
            raise ToolError(f"split {split!r} unknown; use train or val")
        return getattr(self.h.splits, split)

    def _example_id(self, ex_id: Any) -> str:
        ex_id = str(ex_id)
        if self.h.split_of.get(ex_id) not in ("train", "val"):  # one answer for test and unknown
            raise ToolError(f"no train or val example has this id; list ids with peek_examples "
                            f"({SEALED})")
        return ex_id

    def _record(self, ex) -> dict:
        return {"id": ex.id, "split": self.h.split_of[ex.id], "inputs": dict(ex.inputs),
                "expected": dict(ex.expected)}

    def _cid(self, candidate: Any) -> str:
        if candidate is None:
            runs = [e["candidate"] for e in self.h.state.history if e["event"] == "run"]
            return runs[-1] if runs else self.h.state.best_id
        return self.h.resolve(candidate, register=False)[0]

    def _traces(self, candidate: Any) -> list[dict]:
        cid = self._cid(candidate)
        ids = [i for i in self.h.state.evaluated.get(cid, []) if self.h.split_of[i] != "test"]
        return [self.h.trace(cid, i) for i in ids]

    async def _sub(self, prompt: str, max_tokens: int = 512) -> str:
        if self.h.sub_lm is None:
            raise ToolError("no sub-LM is configured, so synthesis tools are off")
        try:
            return (await self.h.sub_lm.complete(prompt, max_tokens)).text.strip()
        except BackendError as exc:
            raise ToolError(f"sub-LM call failed ({exc.kind}): {exc.message}") from None

    # -- introspection -----------------------------------------------------------------------------

    def describe_task(self) -> dict:
        t = self.h.task
        return {"name": t.name, "description": t.description,
                "inputs": sorted({k for e in self.h.splits.train for k in e.inputs}),
                "fields": [{"name": f.name, "metric": f.metric, "weight": f.weight} for f in t.fields],
                "components": list(self.h.seed), "seed_candidate": self.h.seed,
                "split_sizes": self.h.splits.sizes(), "budget": self.h.config.budget}

    def dataset_overview(self) -> dict:
        out: dict[str, Any] = {"sizes": self.h.splits.sizes()}
        for split in ("train", "val"):
            exs = self._split(split)
            out[split] = {f.name: Counter(json.dumps(e.expected.get(f.name)) for e in exs)
                          .most_common(10) for f in self.h.task.fields}
        out["test"] = "count only (sealed)"
        return out

    def peek_examples(self, split: str = "train", n: int = 3, offset: int = 0) -> list[dict]:
        exs = self._split(split)
        return [self._record(e) for e in exs[int(offset):int(offset) + int(n)]]

    def view_example(self, example_id: str) -> dict:
        return self._record(self.h.examples[self._example_id(example_id)])

    def query_examples(self, contains: str = "", field: str | None = None, value: Any = None,
                       split: str = "train", limit: int = 10) -> list[dict]:
        out = []
        for e in self._split(split):
            text = json.dumps({**e.inputs, **e.expected}).lower()
            if contains and str(contains).lower() not in text:
                continue
            if field is not None and str(e.expected.get(field, e.inputs.get(field))) != str(value):
                continue
            out.append(self._record(e))
            if len(out) >= int(limit):
                break
        return out

    def score_explain(self, prediction: str, example_id: str | None = None,
                      expected: dict | None = None) -> dict:
        if example_id is not None:
            ex = self.h.examples[self._example_id(example_id)]
            expected = dict(ex.expected)
        if expected is None:
            raise ToolError("give example_id (train or val) or expected={field: gold}")
        pred = self.h.task.parse(str(prediction))
        scores = {f.name: METRICS[f.metric](pred.get(f.name, ""), expected.get(f.name, ""))
                  for f in self.h.task.fields}
        return {"parsed_prediction": pred, "expected": expected, "scores": scores}

    def list_metrics(self) -> dict:
        return {name: (fn.__doc__ or "").strip().split("\n")[0] for name, fn in METRICS.items()}

    def list_components(self) -> dict:
        return {name: {"chars": len(text), "text": text} for name, text in self.h.best.items()}

    def read_additional_instructions(self) -> str:
        return self.instructions or "(no additional instructions for this run)"

    # -- failure analysis --------------------------------------------------------------------------

    def search_traces(self, query: str, candidate: Any = None, limit: int = 10) -> list[dict]:
        q = str(query).lower()
        return [t for t in self._traces(candidate)
                if q in json.dumps(t).lower()][: int(limit)]

    def describe_failure_patterns(self, candidate: Any = None) -> dict:
        out = {}
        traces = self._traces(candidate)
        for f in self.h.task.fields:
            bad = [t for t in traces if t["scores"][f.name] < 1.0]
            pairs = Counter((json.dumps(t["expected"].get(f.name)), str(t["prediction"].get(f.name))[:80])
                            for t in bad)
            out[f.name] = {"failures": len(bad), "of": len(traces),
                           "common (expected, got)": pairs.most_common(8)}
        return out

    def peek_failures(self, candidate: Any = None, n: int = 5, field: str | None = None) -> list[dict]:
        traces = self._traces(candidate)
        key = (lambda t: t["scores"][field]) if field else (lambda t: sum(t["scores"].values()))
        return sorted([t for t in traces if min(t["scores"].values()) < 1.0], key=key)[: int(n)]

    def read_trace(self, candidate: Any, example_id: str) -> dict:
        cid, ex_id = self._cid(candidate), self._example_id(example_id)
        if (cid, ex_id) not in self.h.replies:
            raise ToolError(f"candidate {cid} has no rollout on {ex_id}; see search_traces")
        return self.h.trace(cid, ex_id)

    # -- synthesis (sub-LM) ------------------------------------------------------------------------

    async def synthesize_failures(self, field: str | None = None, candidate: Any = None) -> dict:
        names = [f.name for f in self.h.task.fields]
        if field is None:  # the weakest field of the running best
            ev = self.h.best_eval()
            field = min(names, key=lambda f: ev.fields[f])
        if field not in names:
            raise ToolError(f"field {field!r} unknown; fields: {names}")
        bad = self.peek_failures(candidate, n=12, field=field)
        if not bad:
            raise ToolError(f"no failures on field {field} to analyse; evaluate a candidate first")
        cases = "\n".join(f"- input {json.dumps(t['inputs'])[:300]} | expected "
                          f"{json.dumps(t['expected'].get(field))[:200]} | got "
                          f"{str(t['prediction'].get(field))[:200]!r}" for t in bad)
        summary = await self._sub(
            f"These outputs of a prompted model were scored wrong on field '{field}'.\n{cases}\n\n"
            "Name the root cause they share in two sentences, then propose one concrete rule to "
            "add to the prompt. Be specific.")
        self.h.gate.diagnosed()
        self.h.state.diagnoses += 1
        self.h.state.history.append({"event": "diagnosis", "field": field,
                                     "analysis": summary[:2000]})
        self.h.save()
        return {"field": field, "failures_analysed": len(bad), "analysis": summary}

    async def synthesize_candidate(self, candidate: Any = None) -> dict:
        traces = [t for t in self._traces(candidate) if min(t["scores"].values()) < 1.0][:12]
        if not traces:
            raise ToolError("this candidate has no failing rollouts to summarise")
        cases = "\n".join(f"- input {json.dumps(t['inputs'])[:300]} | expected "
                          f"{json.dumps(t['expected'])[:200]} | got {t['reply'][:200]!r}" for t in traces)
        text = await self._sub(f"Failing rollouts of one prompt:\n{cases}\n\nState the shared failure "
                               "mode in one sentence and one rule that would fix it.")
        return {"candidate_id": self._cid(candidate), "analysis": text}

    async def merge_candidates(self, a: Any, b: Any) -> dict:
        (ida, ca), (idb, cb) = self.h.resolve(a, register=False), self.h.resolve(b, register=False)
        merged = {}
        for comp in ca:
            if ca[comp] == cb[comp]:
                merged[comp] = ca[comp]
                continue
            merged[comp] = await self._sub(
                "Merge these two prompts into one that keeps every rule, table and template "
                f"variable of both. Reply with the merged prompt only.\n\n--- A ---\n{ca[comp]}\n\n"
                f"--- B ---\n{cb[comp]}", max_tokens=max(256, (len(ca[comp]) + len(cb[comp])) // 3))
        cid = self.h.register(merged)
        return {"candidate_id": cid, "candidate": merged, "parents": [ida, idb]}

    async def call_subagent(self, question: str, context: str = "", budget: int = 0) -> dict:
        """Starts a child agent (its own REPL, conversation and `budget` rollouts of this agent's
        budget) on `question`; returns its answer, proposed candidate and spending, or, when it
        is still running as this block's deadline nears, its handle (rlmopt/subagent.py,
        agent.call_subagent)."""
        if self.spawn is None:
            raise ToolError("sub-agents need the agent's LM; call_subagent works inside an agent run")
        return await self.spawn(self, question, context, budget)

    async def subagent_result(self, handle: str) -> dict:
        """The result of the sub-agent `handle` (as call_subagent returns it), waiting for it
        until shortly before this block's deadline; {"status": "running", ...} if it is not done
        by then. After a resume, a child of the earlier session answers from the harness history."""
        run = self.children.get(str(handle))
        if run is None:
            return self._recorded_subagent(str(handle))
        await self.wait_for(run.task)
        return run.report()

    def _recorded_subagent(self, handle: str) -> dict:
        events = [e for e in self.h.state.history if e.get("handle") == handle
                  and e.get("event") in ("subagent_start", "subagent")]
        if not events:
            raise ToolError(f"no sub-agent {handle!r} was started; handles are returned by "
                            "call_subagent")
        if events[-1]["event"] == "subagent":
            return events[-1]["result"]
        return {"handle": handle, "status": "lost", "error": "this sub-agent was still running "
                "when the run stopped; what it spent stays charged. Start another if you need it"}

    async def wait_for(self, task: asyncio.Future) -> None:
        """Waits for `task` until `wait_until()` (returns early when it is done)."""
        until = self.wait_until()
        timeout = None if until is None else max(0.0, until - time.monotonic())
        await asyncio.wait([task], timeout=timeout)

    def wait_until(self) -> float | None:
        """The latest monotonic time a tool may wait to: the block's deadline less a margin (a
        quarter of block_timeout_s, at most 5 s) for the block to read the result and finish."""
        if self.deadline is None:
            return None
        return self.deadline - min(5.0, 0.25 * self.h.config.block_timeout_s)

    def reserved(self) -> int:
        """Rollouts held by this agent's running sub-agents (their shares less what they spent)."""
        return sum(max(0, r.tools.budget - r.tools.spent) for r in self.children.values()
                   if r.running())

    def left(self) -> int:
        """Rollouts this agent may spend or give away: the budget left less its children's hold."""
        return max(0, self.h.budget_left() - self.reserved())

    # -- evaluation and state ----------------------------------------------------------------------

    async def run_candidate(self, candidate: Any, n: int | None = None) -> dict:
        return await self.h.run_candidate(candidate, n, limit=self.left())

    def commit_prompt(self, candidate: Any, rationale: str = "") -> dict:
        return self.h.commit_prompt(candidate, rationale)

    def best_so_far(self) -> dict:
        ev = self.h.best_eval()
        return {"candidate_id": self.h.state.best_id, "composite": ev.composite, "fields": ev.fields,
                "candidate": self.h.best, "commits": len(self.h.state.commits)}

    def remaining_budget(self) -> dict:
        return {"budget": self.h.config.budget, "used": self.h.state.rollouts_used,
                "left": self.left()}

    def pareto_frontier_status(self) -> list[dict]:
        """Candidates evaluated on the whole validation split that are on the per-field frontier
        or best on at least one validation example."""
        full = [c for c in self.h.state.candidates
                if all((c, i) in self.h.replies for i in self.h.val_order)]
        evals = [self.h.scores(c, self.h.val_order) for c in full]
        on_front = set(pareto_frontier([e.fields for e in evals]))
        out = []
        for k, e in enumerate(evals):
            wins = sum(e.composites[j] >= max(o.composites[j] for o in evals) and e.composites[j] > 0
                       for j in range(len(self.h.val_order)))
            if k in on_front or wins:
                out.append({"candidate_id": e.candidate_id, "composite": e.composite,
                            "fields": e.fields, "field_frontier": k in on_front,
                            "best_on_examples": wins})
        return out

    def scratchpad_add(self, kind: str, text: str) -> dict:
        if kind not in NOTE_KINDS:
            raise ToolError(f"note kind {kind!r}; use one of {NOTE_KINDS}")
        self.h.state.scratchpad.append({"kind": kind, "text": str(text)[:2000]})
        self.h.save()
        return {"notes": len(self.h.state.scratchpad)}

    def scratchpad_read(self, kind: str | None = None) -> list[dict]:
        return [n for n in self.h.state.scratchpad if kind is None or n["kind"] == kind]

    def skill_library(self, query: str = "", limit: int = 5) -> dict:
        """What earlier runs learned (their accepted rules and failure modes, as text), this
        task's first; `query` keeps the entries that contain it."""
        if self.library is None:
            return {"entries": [], "note": "no skill library is configured for this run"}
        return {"entries": self.library.lookup(self.h.task.name, query, int(limit))}

    def final(self, candidate: Any = None) -> dict:
        """Ends the search; `candidate` (optional) is the agent's claimed best, held to the
        terms of Harness.claim: a refused claim does not end the search."""
        if candidate is not None:
            verdict = self.h.claim(candidate)
            if not verdict["accepted"]:
                raise ToolError(f"claim of {verdict['candidate_id']} refused: "
                                + "; ".join(verdict["reasons"])
                                + " (the search goes on; final() ends it without a claim)")
        self.finished = True
        self.h.save()
        return {"finished": True, "claimed": self.h.state.claimed_id}
