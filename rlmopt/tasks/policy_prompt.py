"""The policy-prompt task: optimise the user-message template the Workflow-R1 policy reads.

A candidate has one component, `policy`: a prompt set's `policy.txt`, a `str.format` template over
exactly {operators}, {max_calls} and {question} (`prompt_sets.validate_policy`); the other texts of
the set (system message, operator descriptions, executor templates) stay those of the task's base
prompt set. One example is one question. Evaluating a candidate runs the real multi-turn rollout
engine (`workflow_r1.rollout.RolloutEngine`, greedy, one episode per question) with that template,
the policy (the bundled 0.5B or an HF checkpoint through the sampler, or the scripted stand-in of
`policy_sim`) and an executor, and scores the episode with the environment's reward
(`workflow_r1.task.reward.compute_reward`). Output fields (weights):

    answer_em     0.5  the reward's outcome: the last <answer> matches a golden answer (SQuAD norm.)
    answer_f1     0.2  best token F1 of that answer
    format_valid  0.2  the reward's format term is 0: think (tool info think)* answer
    answered      0.1  the policy itself ended the episode with an <answer> (no cap, budget or
                       warning answered for it)

The reply the harness caches per (candidate, question) is the episode's JSON trace (finish reason,
operator calls, turns, token counts, the whole conversation and the decoded response), so
`read_trace` and the failure tools show every turn and observation.

`PolicyRolloutLM` is the harness's task LM for this task. The harness asks for one example at a
time; the runner gathers the requests that arrive together (one evaluation's examples), groups
them by template and rolls each group out in one `engine.run` call, so the sampler decodes the
questions of a candidate as one batch. `write_prompt_set` writes a candidate as a prompt-set
directory that `--config.env.prompt_set=DIR` accepts in train and evaluate.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import pathlib
import tempfile
from typing import Any, Mapping, Sequence

from rlmopt.lm import BackendError, Completion
from rlmopt.metrics import token_f1
from rlmopt.task import Example, Field, Task
from rlmopt.tasks import questions as questions_lib
from workflow_r1.data.questions import Question
from workflow_r1.task import prompt_sets, reward
from workflow_r1.task.config import EnvConfig
from workflow_r1.rollout.engine import RolloutConfig, RolloutEngine
from workflow_r1.envs.workflow import WorkflowEnvironment
from workflow_r1.rollout.episode import FINISH_ANSWER, Episode

COMPONENT = "policy"
FIELDS = (Field("answer_em", "exact_match", 0.5), Field("answer_f1", "token_f1", 0.2),
          Field("format_valid", "exact_match", 0.2), Field("answered", "exact_match", 0.1))


@dataclasses.dataclass
class PolicyPromptTask(Task):
    """A Task whose candidate is {"policy": user template} and whose reply is an episode trace.

    prompt_set: the base set (a built-in name or a directory) whose other texts the episodes use.
    """

    prompt_set: str = prompt_sets.DEFAULT

    def render(self, candidate: Mapping[str, str], example: Example) -> str:
        """The request the rollout runner runs: the template, the question and its id, as JSON."""
        return json.dumps({"policy": candidate[COMPONENT], "id": example.id,
                           "question": example.inputs["question"]})

    def parse(self, reply: str) -> dict[str, Any]:
        try:
            trace = json.loads(reply)
        except ValueError:
            trace = None
        if not isinstance(trace, dict):  # a failed call's text or a bare answer: scored as a response
            trace = {"response_text": reply, "messages": [], "finish_reason": None}
        response = str(trace.get("response_text", ""))
        assistant = [m["content"] for m in trace.get("messages", []) if m.get("role") == "assistant"]
        answer = reward.extract_answer(response) or ""
        return {"answer_em": answer, "answer_f1": answer,
                "format_valid": float(reward.format_reward(response) == 0.0),
                "answered": trace.get("finish_reason"), "calls": trace.get("operator_rounds", 0),
                "turns": len(assistant), "response": response, "assistant_texts": assistant}

    def score(self, prediction: Mapping[str, Any], example: Example) -> dict[str, float]:
        gold = list(example.expected["answer_em"])
        texts = prediction.get("assistant_texts", [])
        r = reward.compute_reward(prediction.get("response", ""), gold, texts)
        own = prediction.get("answered") == FINISH_ANSWER and r.answer_source == reward.SOURCE_POLICY
        return {"answer_em": float(r.outcome == 1.0),
                "answer_f1": token_f1(prediction.get("answer_f1", ""), gold),
                "format_valid": float(r.format == 0.0), "answered": float(own)}

    def format_demo(self, example: Example) -> str:
        return questions_lib.format_demo(example, "Query")

    def check(self, candidate: Mapping[str, str]) -> list[str]:
        """Commit refusal: the template must stay a valid policy.txt (exactly its three placeholders,
        literal braces doubled)."""
        try:
            prompt_sets.validate_policy(candidate[COMPONENT], "the policy template")
        except ValueError as exc:
            return [f"policy guard: {exc}"]
        return []

    def export(self, candidate: Mapping[str, str], run_dir: Any) -> str:
        """The chosen template as a prompt-set directory, run_dir/prompt_set (pass it as
        `--config.env.prompt_set=DIR` to train or evaluate)."""
        return str(write_prompt_set(candidate, pathlib.Path(run_dir) / "prompt_set", base=self.prompt_set))


def build(questions: str = "bundled", n: int = 60, split_sizes: tuple[int, int, int] | None = None,
          prompt_set: str = prompt_sets.DEFAULT) -> PolicyPromptTask:
    """The task over the first `n` questions of `questions` (a `workflow_r1.data.load_questions`
    spec: "bundled", a Search-R1/FlashRAG .jsonl or .parquet file); the seed candidate is the
    `prompt_set`'s policy.txt. Default split: a third each."""
    qs, split_sizes = questions_lib.load_split("policy_prompt", questions, n, split_sizes)
    return PolicyPromptTask(
        name="policy_prompt",
        description=("Improve the user-message template of the Workflow-R1 policy. The policy reads it "
                     "(after the system message), then thinks in <think>, calls operators in <tool>, "
                     "reads their results in <info> and answers in <answer>; each question is one "
                     "greedy episode, scored by the environment's reward: exact match and token F1 of "
                     "the final answer, a valid think/tool/answer format, and whether the policy "
                     "answered by itself. The component is a str.format template that must use "
                     "exactly {operators}, {max_calls} and {question}; write literal braces as {{ }}."),
        examples=[_example(q) for q in qs], fields=list(FIELDS),
        seed_candidate={COMPONENT: prompt_sets.load(prompt_set).policy}, max_tokens=0,
        split_sizes=split_sizes, prompt_set=prompt_set)


def _example(q: Question) -> Example:
    golds = list(q.golden_answers)
    return Example(q.id, {"question": q.question}, {"answer_em": golds, "answer_f1": golds,
                                                    "format_valid": 1.0, "answered": 1.0})


def write_prompt_set(candidate: Mapping[str, str], directory: str | pathlib.Path,
                     base: str = prompt_sets.DEFAULT) -> pathlib.Path:
    """Writes `candidate` as a prompt-set directory: the files of `base` (a built-in set or a
    directory) and the candidate's policy.txt; checks it loads as `env.prompt_set=DIR` would."""
    return prompt_sets.write(directory, policy=candidate[COMPONENT], base=base)


def load_policy(spec: str, task: Task, cache_size: int) -> tuple[Any, Any]:
    """(policy, tokenizer) named by `spec`: `scripted` (policy_sim), `local` (the bundled 0.5B) or
    `local:DIR` (an HF checkpoint directory, e.g. a training run's hf/ export), the last two through
    the sampler with room for `cache_size` tokens per row."""
    if spec == "scripted":
        from rlmopt.tasks import policy_sim

        return policy_sim.scripted_policy(task)
    kind, _, directory = spec.partition(":")
    if kind != "local":
        raise ValueError(f"policy {spec!r} unknown for the policy_prompt task; use scripted, local or "
                         "local:HF_DIR")
    if directory and not (pathlib.Path(directory).expanduser() / "config.json").is_file():
        raise ValueError(f"policy local:{directory} is not an HF checkpoint directory (config.json + "
                         "*.safetensors); pass a training run's hf/ export")
    from workflow_r1 import policy as policy_lib
    from workflow_r1.sampler import Sampler

    model, tokenizer = policy_lib.load(policy_lib.ModelConfig(checkpoint=directory))
    return Sampler(model, tokenizer, cache_size=cache_size), tokenizer


class PolicyRolloutLM(questions_lib.ExecutorUser):
    """The task LM of the policy-prompt task: rolls out the requests of `PolicyPromptTask.render`.

    policy, tokenizer: the engine's Policy and the policy's tokenizer. `llm` is the executor LLM
    (an executor backend) of an in-process executor; `url` an already running executor instead.
    rollout: the engine's limits (n and temperature are ignored: one greedy episode a question).
    prompt_set: the base set; variant, max_calls: the operator pool and call limit (env section).
    batch_size: most questions of one template in one `engine.run` call. Call `aclose` when done.
    """

    name = "policy_rollout"

    def __init__(self, policy: Any, tokenizer: Any, *, llm: Any = None, url: str | None = None,
                 rollout: RolloutConfig | None = None, prompt_set: str = prompt_sets.DEFAULT,
                 variant: str = "workflow_r1", max_calls: int = 20, batch_size: int = 32,
                 timeout_s: float = 600.0, executor_max_tokens: int | None = None):
        self.policy, self.tokenizer = policy, tokenizer
        self.rollout = rollout or RolloutConfig(prompts_per_step=1, n=1)
        self.prompt_set, self.variant, self.max_calls = prompt_set, variant, max_calls
        self.batch_size = batch_size
        super().__init__(llm, url, timeout_s, executor_max_tokens)
        self._sets = tempfile.TemporaryDirectory(prefix="rlmopt-policy-sets-")
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.llm_calls = 0      # executor-LLM calls behind every operator call of this object
        self.engine_runs = 0    # engine.run calls (one per template group of gathered requests)

    # -- one batch ---------------------------------------------------------------------------------

    def _execute(self, calls: list[tuple[str, str]], templates: Mapping[str, str]) -> list[Any]:
        obs = self.client.execute_many_sync(calls, templates)
        self.llm_calls += sum(o.llm_calls for o in obs)
        return obs

    def _env(self, template: str) -> EnvConfig:
        """The environment of `template`: a prompt-set directory per template (the same files a
        hand-off writes), so the engine reads the candidate exactly as training would."""
        digest = hashlib.sha256(template.encode()).hexdigest()[:16]
        directory = pathlib.Path(self._sets.name) / digest
        if not directory.exists():
            write_prompt_set({COMPONENT: template}, directory, base=self.prompt_set)
        return EnvConfig(variant=self.variant, prompt_set=str(directory), max_operator_calls=self.max_calls)

    def rollout_traces(self, template: str, requests: Sequence[Mapping[str, str]]) -> list[str]:
        """One greedy episode per request (its `id` and `question`) with user template `template`,
        in one engine.run call; returns each episode's JSON trace, in request order."""
        engine = RolloutEngine(self.policy, self.rollout,
                               WorkflowEnvironment.of(self.tokenizer, self._execute, self._env(template), self.rollout))
        questions = [Question(r["id"], r["question"], (), "rlmopt") for r in requests]
        episodes, _ = engine.run(questions, n=1, greedy=True)
        self.engine_runs += 1
        by_id = {ep.question.id: ep for ep in episodes}
        return [trace(by_id[r["id"]]) if r["id"] in by_id else json.dumps(
            {"question": r["question"], "finish_reason": "skipped", "response_text": "", "messages": [],
             "note": f"prompt longer than rollout.max_prompt_tokens={self.rollout.max_prompt_tokens}"})
            for r in requests]

    # -- the harness's LM interface ----------------------------------------------------------------

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        """The JSON trace of the request's episode (tokens: the episode's response tokens).
        `max_tokens` is not used: the rollout config bounds the episode."""
        del max_tokens
        future = asyncio.get_running_loop().create_future()
        self._pending.append((json.loads(prompt), future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        text = await future
        return Completion(text, "stop", int(json.loads(text).get("response_tokens", 0)))

    async def _drain(self) -> None:
        while self._pending:
            seen = -1
            while seen != len(self._pending):  # let every request of this evaluation arrive
                seen = len(self._pending)
                for _ in range(3):
                    await asyncio.sleep(0)
            batch, self._pending = self._pending, []
            groups: dict[str, list[tuple[dict, asyncio.Future]]] = {}
            for request, future in batch:
                groups.setdefault(request["policy"], []).append((request, future))
            for template, items in groups.items():
                for start in range(0, len(items), self.batch_size):
                    chunk = items[start:start + self.batch_size]
                    try:
                        traces = await asyncio.to_thread(self.rollout_traces, template,
                                                         [r for r, _ in chunk])
                    except ValueError as exc:  # an invalid template: a failed call, scored 0
                        error: Exception = BackendError("bad_template", str(exc))
                        traces = None
                    except Exception as exc:  # noqa: BLE001 - handed to the waiting callers
                        error, traces = exc, None
                    for i, (_, future) in enumerate(chunk):
                        if future.done():
                            continue
                        if traces is None:
                            future.set_exception(error)
                        else:
                            future.set_result(traces[i])

    def close(self) -> None:
        self.client.close()
        super().close()
        self._sets.cleanup()


def trace(ep: Episode) -> str:
    """An episode as the JSON reply the harness caches (everything parse and read_trace need)."""
    return json.dumps({
        "question": ep.question.question, "finish_reason": ep.finish_reason,
        "operator_rounds": ep.operator_rounds, "operators": dict(ep.operator_counts()),
        "prompt_tokens": len(ep.prompt_ids), "response_tokens": ep.response_length,
        "turns": [{"action": t.action, "operator": t.operator, "error_kind": t.error_kind}
                  for t in ep.turns],
        "messages": ep.messages, "response_text": ep.response_text})
