"""The deterministic harness: it owns the data, runs the task LM, scores, charges the budget and
keeps the optimization state (running best, commits, history, scratchpad, accounting).

Nothing here depends on an LM decision except through the candidate text an agent passes in.
Evaluations are cached per (candidate, example) in `replies.jsonl`, and the state is written to
`state.json` after every change, so a run directory resumes after a crash: `Harness.resume`
rebuilds every score from the cached replies without calling the task LM again.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rlmopt import gates
from rlmopt.config import RLMOptConfig
from rlmopt.lm import BackendError, Meter, MeteredLM
from rlmopt.task import Candidate, Example, Task, as_candidate, candidate_id, split

_MISMATCHES_SHOWN = 5
_ERROR_PREFIX = "[task LM error "  # the reply recorded for a failed task-LM call (scores as wrong)


@dataclass
class Evaluation:
    """Scores of one candidate on a list of examples of one split.

    per_example: example id -> field -> score in [0, 1]; composites: per-example S in `ids` order.
    """

    candidate_id: str
    split: str
    ids: list[str]
    per_example: dict[str, dict[str, float]]
    composites: list[float]
    fields: dict[str, float]
    composite: float


@dataclass
class State:
    """What a resumed run needs besides the reply cache (JSON-serialisable)."""

    candidates: dict[str, Candidate] = field(default_factory=dict)
    seed_id: str = ""
    best_id: str = ""
    commits: list[str] = field(default_factory=list)
    claimed_id: str | None = None
    evaluated: dict[str, list[str]] = field(default_factory=dict)  # candidate -> val ids, latest run
    history: list[dict] = field(default_factory=list)  # one entry per run_candidate / commit_prompt
    rollouts_used: int = 0
    gate: dict = field(default_factory=dict)
    scratchpad: list[dict] = field(default_factory=list)
    diagnoses: int = 0
    wall_s_before: float = 0.0
    executor_llm_calls_before: int = 0
    phase: str = "search"  # search | final | done


class Harness:
    """The harness of one run. `task_lm`, `sub_lm`, `judge_lm`: LMs (`lm.complete`); sub_lm=None
    turns the synthesis tools and the diagnose gate off; run_dir=None keeps everything in memory."""

    def __init__(self, task: Task, task_lm: Any, config: RLMOptConfig, *, sub_lm: Any = None,
                 judge_lm: Any = None, run_dir: str | os.PathLike | None = None,
                 meter: Meter | None = None):
        self.task, self.config = task, config
        self.splits = split(task, config.seed)
        self.meter = meter or Meter()
        self.task_lm = MeteredLM(task_lm, self.meter, "task")
        self.sub_lm = MeteredLM(sub_lm, self.meter, "sub") if sub_lm is not None else None
        self.judge_lm = MeteredLM(judge_lm, self.meter, "judge") if judge_lm is not None else None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.examples: dict[str, Example] = {e.id: e for e in task.examples}
        self.split_of = {e.id: name for name in ("train", "val", "test")
                         for e in getattr(self.splits, name)}
        self.val_order = [e.id for e in self.splits.val]
        random.Random(config.seed).shuffle(self.val_order)
        self.replies: dict[tuple[str, str], str] = {}
        self._scored: dict[tuple[str, str], dict[str, float]] = {}  # field scores of a cached reply
        self.gate = gates.DiagnoseGate(config.noise_band_k, enabled=sub_lm is not None)
        self.state = State()
        self._t0 = time.monotonic()
        seed = dict(task.seed_candidate)
        self.state.seed_id = self.state.best_id = self.register(seed)
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._load()

    # -- persistence -------------------------------------------------------------------------------

    def _identity(self) -> dict:
        """What a run directory must match to be resumed: task, seed and the split it produced."""
        return {"task": self.task.name, "seed": self.config.seed, "val": self.val_order,
                "seed_candidate": self.state.seed_id}

    def _load(self) -> None:
        assert self.run_dir is not None
        cache = self.run_dir / "replies.jsonl"
        if cache.exists():
            for line in cache.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:  # a line cut short by a crash: that reply is asked again
                    continue
                self.replies[(r["candidate"], r["id"])] = r["reply"]
        path = self.run_dir / "state.json"
        if path.exists():
            data = json.loads(path.read_text())
            if data.get("identity") != self._identity():
                raise ValueError(f"run directory {self.run_dir} holds another run (task, seed, "
                                 "split or seed prompt differ); choose another run directory")
            self.state = State(**data["state"])
            self.meter = Meter.from_dict(data["meter"])
            for lm in (self.task_lm, self.sub_lm, self.judge_lm):
                if lm is not None:
                    lm.meter = self.meter
            if self.state.gate:
                self.gate = gates.DiagnoseGate(**self.state.gate)
            self.gate.enabled = self.sub_lm is not None

    def save(self) -> None:
        if self.run_dir is None:
            return
        self.state.gate = vars(self.gate).copy()
        data = {"identity": self._identity(),
                "state": vars(self.state) | {"wall_s_before": self.wall_clock_s(),
                                             "executor_llm_calls_before": self.executor_llm_calls()},
                "meter": self.meter.to_dict()}
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.run_dir / "state.json")

    def wall_clock_s(self) -> float:
        """Seconds of this run, summed over resumed sessions."""
        return self.state.wall_s_before + (time.monotonic() - self._t0)

    def executor_llm_calls(self) -> int:
        """The environment tasks' executor-LLM calls (the task LM's `llm_calls`: the calls behind
        each workflow or episode), summed over resumed sessions; 0 for other tasks."""
        return self.state.executor_llm_calls_before + int(getattr(self.task_lm.lm, "llm_calls", 0))

    # -- candidates --------------------------------------------------------------------------------

    def register(self, candidate: Candidate) -> str:
        cid = candidate_id(candidate)
        self.state.candidates.setdefault(cid, dict(candidate))
        return cid

    def resolve(self, value: Any, register: bool = True) -> tuple[str, Candidate]:
        """(id, candidate) from a candidate id, a prompt string or a component mapping; a string or
        partial mapping fills the other components from the running best. register=False leaves
        a new candidate out of the state (it is kept only once evaluated or committed)."""
        if isinstance(value, str) and value in self.state.candidates:
            return value, self.state.candidates[value]
        cand = as_candidate(value, self.state.candidates[self.state.best_id])
        return (self.register(cand) if register else candidate_id(cand)), cand

    @property
    def seed(self) -> Candidate:
        return self.state.candidates[self.state.seed_id]

    @property
    def best(self) -> Candidate:
        return self.state.candidates[self.state.best_id]

    def budget_left(self) -> int:
        return self.config.budget - self.state.rollouts_used

    # -- evaluation --------------------------------------------------------------------------------

    async def _reply(self, cid: str, candidate: Candidate, ex: Example,
                     sem: asyncio.Semaphore) -> str:
        async with sem:
            try:
                c = await self.task_lm.complete(self.task.render(candidate, ex), self.task.max_tokens)
                return c.text
            except BackendError as exc:  # a failed call scores as an empty reply
                return f"{_ERROR_PREFIX}{exc.kind}: {exc.message}]"

    async def evaluate(self, cid: str, ids: list[str]) -> tuple[Evaluation, int]:
        """Scores candidate `cid` on example `ids` (task LM concurrently, cached); returns the
        evaluation and the number of task-LM calls made. Charges nothing."""
        candidate = self.state.candidates[cid]
        todo = [i for i in dict.fromkeys(ids) if (cid, i) not in self.replies]
        sem = asyncio.Semaphore(self.config.task_concurrency)
        replies = await asyncio.gather(*(self._reply(cid, candidate, self.examples[i], sem)
                                         for i in todo))
        lines = []
        for i, reply in zip(todo, replies):
            self.replies[(cid, i)] = reply
            self._scored.pop((cid, i), None)  # a concurrent evaluation of the same pair wrote first
            if not reply.startswith(_ERROR_PREFIX):  # a failed call is asked again after a resume
                lines.append(json.dumps({"candidate": cid, "id": i, "reply": reply}))
        if lines and self.run_dir is not None:
            with open(self.run_dir / "replies.jsonl", "a") as fh:
                fh.write("\n".join(lines) + "\n")
        return self.scores(cid, ids), len(todo)

    def scores(self, cid: str, ids: list[str]) -> Evaluation:
        """The evaluation of `cid` on `ids` from cached replies."""
        per_example = {i: dict(self._example_scores(cid, i)) for i in ids}
        weights = self.task.weights
        total = sum(weights.values())
        composites = [sum(weights[f] * per_example[i][f] for f in weights) / total for i in ids]
        fields = {f: sum(per_example[i][f] for i in ids) / len(ids) for f in weights}
        splits = {self.split_of[i] for i in ids}
        return Evaluation(cid, "+".join(sorted(splits)), list(ids), per_example, composites,
                          fields, sum(composites) / len(composites))

    def _example_scores(self, cid: str, i: str) -> dict[str, float]:
        """The field scores of the cached reply of `cid` on example `i` (a pair's reply is written
        once, so its scores are computed once)."""
        key = (cid, i)
        if key not in self._scored:
            self._scored[key] = self.task.score(self.task.parse(self.replies[key]), self.examples[i])
        return self._scored[key]

    def trace(self, cid: str, ex_id: str) -> dict:
        """One rollout: input, gold, raw reply, parsed prediction and per-field scores."""
        ex = self.examples[ex_id]
        reply = self.replies[(cid, ex_id)]
        pred = self.task.parse(reply)
        return {"candidate": cid, "id": ex_id, "inputs": dict(ex.inputs),
                "expected": dict(ex.expected), "reply": reply, "prediction": pred,
                "scores": self.task.score(pred, ex)}

    async def evaluate_seed(self) -> Evaluation:
        """The uncharged seed evaluation on the whole validation split (the initial baseline)."""
        ev, _ = await self.evaluate(self.state.seed_id, self.val_order)
        self.state.evaluated.setdefault(self.state.seed_id, list(self.val_order))
        self.save()
        return ev

    def best_eval(self) -> Evaluation:
        return self.scores(self.state.best_id, self.val_order)

    async def run_candidate(self, candidate: Any, n: int | None = None,
                            limit: int | None = None) -> dict:
        """Scores a candidate on the first `n` validation examples of the seeded order (all when
        None) and returns the structured feedback record. Charges one rollout per task-LM call
        (cached examples are free); refused without charge when the budget (or `limit`, a
        sub-agent's remaining share of it) cannot cover it or the diagnose gate refuses."""
        if not all((self.state.best_id, i) in self.replies for i in self.val_order):
            await self.evaluate_seed()  # the baseline every feedback record compares against
        cid, cand = self.resolve(candidate, register=False)
        chars = sum(len(t) for t in cand.values())
        if chars > self.config.max_candidate_chars:  # it could never be committed: not evaluated
            return {"error": f"length guard: {chars} characters exceed max_candidate_chars="
                             f"{self.config.max_candidate_chars}; shorten the candidate (nothing "
                             "was charged)", "budget_left": self.budget_left()}
        n_val = len(self.val_order)
        n = n_val if n is None else max(1, min(int(n), n_val))
        ids = self.val_order[:n]
        cost = sum((cid, i) not in self.replies for i in ids)
        left = self.budget_left() if limit is None else min(limit, self.budget_left())
        if cost > left:
            return {"error": f"budget: this evaluation needs {cost} rollouts but {left} "
                             "are left; use a smaller n or stop", "budget_left": left}
        refusal = self.gate.admit()
        if refusal:
            self.state.history.append({"event": "refused", "candidate": cid})
            self.save()
            return {"error": refusal, "budget_left": self.budget_left()}
        self.register(cand)
        ev, calls = await self.evaluate(cid, ids)
        self.state.rollouts_used += calls
        best = self.scores(self.state.best_id, ids)
        warning = self.gate.observe(ev.composite, best.composite, gates.standard_error(best.composites))
        self.state.evaluated[cid] = ids
        self.state.history.append({"event": "run", "candidate": cid, "n": n, "charged": calls,
                                   "composite": ev.composite, "fields": ev.fields,
                                   "best_same_examples": best.composite,
                                   "budget_left": self.budget_left()})
        record = await self.feedback(ev, best)
        record["charged"] = calls  # this call's own charge (others may evaluate concurrently)
        if warning:
            record["warning"] = warning
            record["summary"] += "\n" + warning
        self.save()
        return record

    async def feedback(self, ev: Evaluation, best: Evaluation) -> dict:
        """The structured feedback record: composite, per-field scores, mismatches, judge notes."""
        weights = self.task.weights
        total = sum(weights.values())
        metric = {f.name: f.metric for f in self.task.fields}
        lines = [f"candidate {ev.candidate_id} on {len(ev.ids)} validation examples: "
                 f"composite={ev.composite:.3f} (running best {best.composite:.3f} on the same "
                 f"examples; budget left {self.budget_left()})"]
        for f in weights:
            lines.append(f"  {f} (w={weights[f] / total:.2f}): {ev.fields[f]:.3f} [{metric[f]}]")
        mismatches = []
        for i in ev.ids:
            for f, s in ev.per_example[i].items():
                if s < 1.0 and len(mismatches) < _MISMATCHES_SHOWN:
                    t = self.trace(ev.candidate_id, i)
                    mismatches.append({"id": i, "field": f, "score": s,
                                       "expected": t["expected"].get(f), "got": t["prediction"].get(f)})
        if mismatches:
            lines.append("MISMATCHES:")
            lines += [f"  {m['id']} {m['field']}: expected={m['expected']!r}, got={str(m['got'])[:200]!r}"
                      for m in mismatches]
        judge = []
        if self.judge_lm is not None:
            for m in mismatches[:3]:
                q = (f"A model's output field '{m['field']}' was {str(m['got'])[:500]!r}; the "
                     f"reference is {m['expected']!r}. In one sentence, what is wrong with the output?")
                try:
                    note = (await self.judge_lm.complete(q, 96)).text.strip()
                except BackendError as exc:
                    note = f"(judge failed: {exc.kind})"
                judge.append({"id": m["id"], "field": m["field"], "rationale": note})
                lines.append(f"  judge on {m['id']}: {note}")
        return {"candidate_id": ev.candidate_id, "n": len(ev.ids), "composite": ev.composite,
                "fields": ev.fields, "mismatches": mismatches, "judge": judge,
                "best_composite_same_examples": best.composite, "budget_left": self.budget_left(),
                "summary": "\n".join(lines)}

    def commit_prompt(self, candidate: Any, rationale: str = "") -> dict:
        """Asks the harness to make `candidate` the running best. Accepted only if it passes the
        guards, has been evaluated on the whole validation split, keeps every field above the floor
        and clears the significance gate (gates.py). A refused candidate is not added to the
        state (its history entry names its id), so refusals cannot grow state.json."""
        cid, cand = self.resolve(candidate, register=False)
        if cid == self.state.best_id:
            reasons = ["this candidate is already the running best"]
        else:
            reasons = gates.guard_reasons(cand, self.seed, str(rationale or ""), self.config)
            reasons += self.task.check(cand)
            if not self._evaluated_on_validation(cid):
                reasons.append("not evaluated on the whole validation split: call "
                               "run_candidate(candidate) with n=None first")
            else:
                ev, best = self.scores(cid, self.val_order), self.best_eval()
                reasons += gates.score_reasons(ev.fields, best.fields, ev.composites,
                                               best.composites, self.config, len(self.val_order))
        accepted = not reasons
        if accepted:
            self.register(cand)
            self.state.commits.append(cid)
            self.state.best_id = cid
        self.state.history.append({"event": "commit", "candidate": cid, "accepted": accepted,
                                   "reasons": reasons, "rationale": str(rationale)[:500]})
        self.save()
        best = self.best_eval()
        return {"accepted": accepted, "candidate_id": cid, "reasons": reasons,
                "best_id": self.state.best_id, "best_composite": best.composite}

    def _evaluated_on_validation(self, cid: str) -> bool:
        return self.state.evaluated.get(cid) == self.val_order or all(
            (cid, i) in self.replies for i in self.val_order)

    def proposal_reasons(self, candidate: Candidate) -> list[str]:
        """Why `candidate` could not even be proposed: the placeholder and length guards and the
        task's checks (a commit's guards without the rationale and score rules)."""
        return (gates.guard_reasons(candidate, self.seed, None, self.config)
                + self.task.check(candidate))

    def claim(self, candidate: Any) -> dict:
        """Names `candidate` the agent's claimed best (`final(candidate=...)`), which the final
        stage scores on validation without charge. So a claim is held to a commit's terms except
        the score rules: the guards of `proposal_reasons` and an evaluation on the whole
        validation split (charged by run_candidate). A refused claim is not added to the state
        (its history entry names its id) and the earlier claim stands."""
        cid, cand = self.resolve(candidate, register=False)
        reasons = self.proposal_reasons(cand)
        if not reasons and not self._evaluated_on_validation(cid):
            reasons.append("not evaluated on the whole validation split: call "
                           "run_candidate(candidate) with n=None first")
        if not reasons:
            self.state.claimed_id = self.register(cand)
        self.state.history.append({"event": "claim", "candidate": cid, "accepted": not reasons,
                                   "reasons": reasons})
        self.save()
        return {"accepted": not reasons, "candidate_id": cid, "reasons": reasons,
                "claimed": self.state.claimed_id}
