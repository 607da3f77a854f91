"""The operator-environment task: optimise the executor's operator prompt templates.

A candidate maps operator names (AnswerGenerate, Review, Revise, ScEnsemble) to the executor prompt
templates of the Workflow-R1 environment. One example is one question; evaluating a candidate on
it runs a fixed operator workflow through the real HTTP executor with the candidate's templates
(the `template` field of `/execute`):

    AnswerGenerate(question) -> Review(question, answer) -> Revise(question, answer, feedback)
        -> ScEnsemble(question, [answer, revised answer])

and scores the ScEnsemble answer. Output fields (weights): `answer_em` (0.5, exact match against
any golden answer), `answer_f1` (0.3, best token F1), `format_valid` (0.1, share of the four steps
whose observation carries the operator's labelled answer or feedback, i.e. the executor LLM
produced the required tags), `call_economy` (0.1, 4 / executor-LLM calls: 1 when no step needed
a repair attempt). The reply the harness caches for an example is the workflow's JSON trace
(every step's operator, content, observation, error kind, calls and tokens), so `read_trace` and
the failure tools show the whole workflow.

`OperatorWorkflowLM` is the harness's task LM for this task: it owns an in-process executor
(`workflow_r1.executor.server.start_in_thread`) over the executor LLM (fake, simulated, the local
0.5B or an OpenAI-compatible URL). `simulated_executor_lm` is a deterministic executor LLM for
tests and CPU comparisons (module `operator_sim`). `write_prompt_set` writes a candidate as a
prompt-set directory that `--config.env.prompt_set=DIR` accepts in train and evaluate.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Sequence

from rlmopt.lm import Completion
from rlmopt.metrics import exact_match, token_f1
from rlmopt.task import Candidate, Example, Field, Task
from rlmopt.tasks import questions as questions_lib
from workflow_r1.data.questions import Question
from workflow_r1.task import operators, prompt_sets

WORKFLOW = ("AnswerGenerate", "Review", "Revise", "ScEnsemble")
FIELDS = (Field("answer_em", "exact_match", 0.5), Field("answer_f1", "token_f1", 0.3),
          Field("format_valid", "exact_match", 0.1), Field("call_economy", "exact_match", 0.1))


def answer_of(observation: str, operator: str) -> str:
    """The labelled reply of an operator observation ("{label} answer: X" / "Review feedback: X"),
    or "" when the executor passed a raw reply through (the LLM missed the required tags)."""
    spec = operators.OPERATORS[operator]
    label = spec.reply_label or spec.name
    marker = f"{label} {spec.reply_tag}: "
    at = observation.rfind(marker)
    return observation[at + len(marker):].strip() if at >= 0 else ""


class OperatorTask(Task):
    """A Task whose reply is a workflow trace (JSON) and whose candidate is a template set."""

    def render(self, candidate: Mapping[str, str], example: Example) -> str:
        """The request the workflow LM runs: the templates and the question, as JSON."""
        return json.dumps({"templates": dict(candidate), "question": example.inputs["question"]})

    def parse(self, reply: str) -> dict[str, Any]:
        try:
            trace = json.loads(reply)
        except ValueError:
            trace = None
        if not isinstance(trace, dict):  # a bare answer (score_explain) or a failed call's text
            trace = {"answer": reply.strip(), "steps": []}
        steps = trace.get("steps") or []
        calls = sum(int(s.get("llm_calls", 0)) for s in steps)
        valid = sum(bool(s.get("reply")) for s in steps)
        answer = str(trace.get("answer", ""))
        return {"answer_em": answer, "answer_f1": answer, "format_valid": valid / len(WORKFLOW),
                "calls": calls, "call_economy": min(1.0, len(WORKFLOW) / calls) if calls else 0.0}

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        gold = list(example.expected["answer_em"])
        answer = prediction.get("answer_em", "")
        return {"answer_em": exact_match(answer, gold), "answer_f1": token_f1(answer, gold),
                "format_valid": float(prediction.get("format_valid", 0.0)),
                "call_economy": float(prediction.get("call_economy", 0.0))}

    def format_demo(self, example: Example) -> str:
        return questions_lib.format_demo(example, "Question")

    def export(self, candidate: Mapping[str, str], run_dir: Any) -> str:
        """The chosen templates as a prompt-set directory, run_dir/prompt_set (pass it as
        `--config.env.prompt_set=DIR` to train or evaluate)."""
        return str(write_prompt_set(candidate, pathlib.Path(run_dir) / "prompt_set"))

    def check(self, candidate: Mapping[str, str]) -> list[str]:
        """Commit refusals: every component must stay a valid executor template of its operator
        (each of its placeholders kept, no others)."""
        reasons = []
        for op, text in candidate.items():
            try:
                operators.validate_template(op, text)
            except ValueError as exc:
                reasons.append(f"template guard: {exc}")
        return reasons


def build(questions: str = "bundled", n: int = 60,
          split_sizes: tuple[int, int, int] | None = None,
          prompt_set: str = prompt_sets.DEFAULT) -> OperatorTask:
    """The task over the first `n` questions of `questions` (a `workflow_r1.data.load_questions`
    spec: "bundled", a Search-R1/FlashRAG .jsonl or .parquet file); the seed candidate is the
    `prompt_set`'s templates of the workflow's operators. Default split: a third each."""
    qs, split_sizes = questions_lib.load_split("operator", questions, n, split_sizes)
    templates = prompt_sets.load(prompt_set).templates
    return OperatorTask(
        name="operator_env",
        description=("Improve the executor prompt templates of four Workflow-R1 operators. Each "
                     "question runs AnswerGenerate -> Review -> Revise -> ScEnsemble through the "
                     "executor; the ScEnsemble answer is scored against the golden answers (exact "
                     "match, token F1), plus the share of steps whose reply had the required tags "
                     "and 4 / LLM calls. Each component is a str.format template: keep its "
                     "placeholders (e.g. {input}, {question}) and write literal braces as {{ }}."),
        examples=[_example(q) for q in qs], fields=list(FIELDS),
        seed_candidate={op: templates[op] for op in WORKFLOW}, max_tokens=1024,
        split_sizes=split_sizes)


def _example(q: Question) -> Example:
    golds = list(q.golden_answers)
    return Example(q.id, {"question": q.question}, {"answer_em": golds, "answer_f1": golds,
                                                    "format_valid": 1.0, "call_economy": 1.0})


class OperatorWorkflowLM(questions_lib.ExecutorUser):
    """The task LM of the operator task: runs the workflow of one request (OperatorTask.render)
    through an executor. `llm` is the executor LLM (an executor backend); `url` an already
    running executor instead (then `llm` is ignored); `max_tokens` the in-process executor's
    generation limit per attempt (None: its default). Call `aclose` (or `close`) when done."""

    name = "operator_workflow"

    def __init__(self, llm: Any = None, url: str | None = None, timeout_s: float = 600.0,
                 max_tokens: int | None = None):
        super().__init__(llm, url, timeout_s, max_tokens)
        self.llm_calls = 0  # executor-LLM calls of every workflow run by this object

    async def _step(self, op: str, content: str, templates: Mapping[str, str],
                    steps: list[dict]) -> str:
        obs = (await self.client.execute_many([(op, content)], templates={op: templates[op]}))[0]
        reply = answer_of(obs.text, op) if obs.error_kind is None else ""
        steps.append({"operator": op, "content": content, "observation": obs.text,
                      "error_kind": obs.error_kind, "llm_calls": obs.llm_calls,
                      "tokens": obs.tokens, "reply": reply})
        return reply

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        """Runs the four-step workflow; the Completion's text is the JSON trace and its tokens the
        executor LLM's completion tokens. `max_tokens` is the executor's own setting, not used."""
        del max_tokens
        request = json.loads(prompt)
        templates, q = request["templates"], request["question"]
        steps: list[dict] = []
        first = await self._step("AnswerGenerate", q, templates, steps)
        feedback = await self._step(
            "Review", f"<question>{q}</question><solution>{first}</solution>", templates, steps)
        revised = await self._step(
            "Revise", f"<question>{q}</question><solution>{first}</solution>"
                      f"<feedback>{feedback}</feedback>", templates, steps)
        final = await self._step(
            "ScEnsemble", f"<query>{q}</query><solution>{first}</solution>"
                          f"<solution>{revised}</solution>", templates, steps)
        trace = {"question": q, "answer": final, "steps": steps}
        self.llm_calls += sum(s["llm_calls"] for s in steps)
        return Completion(json.dumps(trace), "stop", sum(s["tokens"] for s in steps))


def write_prompt_set(candidate: Mapping[str, str], directory: str | pathlib.Path) -> pathlib.Path:
    """Writes `candidate` as a prompt-set directory (`<Operator>.template.txt` per component; the
    other files keep the faithful text) and checks it loads as `env.prompt_set=DIR` would."""
    return prompt_sets.write(directory, templates=candidate)


def candidate_of_prompt_set(spec: str, ops: Sequence[str] = WORKFLOW) -> Candidate:
    """The templates of `ops` in a prompt set (a built-in name or a directory)."""
    templates = prompt_sets.load(spec).templates
    return {op: templates[op] for op in ops}

