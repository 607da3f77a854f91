"""The Workflow-R1 environment (docs/paper.md, The multi-turn protocol), one episode at a time.

- open: the `env` section's system + user messages through the policy's chat template;
- step: the turn is decoded and parsed (`protocol.parse_turn`): an answer ends the episode; a call
  of an operator in the pool is a tool call for the executor; a malformed turn, or an operator
  outside the pool, gets the WarningOp text as its reply; the turn cap (21 assistant turns) and the
  call cap (20 observation rounds) end the episode (`protocol.should_stop`);
- execute: the calls of many episodes in one concurrent `execute` call (an executor failure comes
  back as an observation, never as an exception), with the prompt set's executor templates;
- observe: the result as `<info>...</info>` (middle-truncated to 2048 characters), rendered as a
  tool message by the chat template, with the next assistant header;
- score: the rule-based reward of the decoded response.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from workflow_r1 import policy as policy_lib
from workflow_r1.data.config import load_data
from workflow_r1.task import protocol, reward
from workflow_r1.task.config import EnvConfig
from workflow_r1.rollout.environment import Opening, Step
from workflow_r1.rollout.episode import Episode
from workflow_r1.rollout.observation import ObservationTemplate

# ([(operator, content)], {operator: executor prompt template}) -> [Observation]
Executor = Callable[[list[tuple[str, str]], Mapping[str, str]], list[Any]]


class WorkflowEnvironment:
    """The operator environment of the paper for one policy tokenizer.

    Args:
      tokenizer: the policy's HF tokenizer (chat template, decoding).
      execute: runs operator calls with the given executor prompt templates, e.g.
        `ExecutorClient(url).execute_many_sync`; must not raise.
      env: the operator pool and the prompt set; every call carries the set's executor prompts, so a
        remote executor runs the same words as the policy's prompt set.
      max_assistant_turns, max_observation_chars: the limits of `rollout.RolloutConfig`.
      template_newline: `RolloutConfig.template_newline` (docs/paper.md, Our choices).
      close_turns: `RolloutConfig.stop_at_action`: turns end at their action (`turn_complete`),
        and an observation after a turn that did not sample the end-of-turn token starts with it.
      score: `(response_text, golden_answers, assistant_texts) -> RewardBreakdown`; the workflow
        reward by default (a baseline that answers without tags brings its own).
    """

    def __init__(self, tokenizer: Any, execute: Executor, env: EnvConfig | None = None, *,
                 max_assistant_turns: int = protocol.MAX_ASSISTANT_TURNS,
                 max_observation_chars: int = protocol.MAX_OBSERVATION_CHARS, template_newline: bool = True,
                 close_turns: bool = False, score: Callable[..., reward.RewardBreakdown] = reward.compute_reward):
        self.tokenizer, self._execute, self.env, self._score = tokenizer, execute, env or EnvConfig(), score
        self.max_assistant_turns, self.max_observation_chars = max_assistant_turns, max_observation_chars
        self.templates = self.env.operator_templates()
        self.observation = ObservationTemplate(tokenizer, template_newline=template_newline)
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.observation.end_of_turn)
        self.close_turns = close_turns
        # Only a token that writes a '>' can complete an action: the turn is parsed after those alone.
        self._closing_ids = frozenset(i for i, t in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
                                      if t is not None and ">" in t) if close_turns else frozenset()

    @classmethod
    def of(cls, tokenizer: Any, execute: Executor, env: EnvConfig | None, rollout: Any,
           score: Callable[..., reward.RewardBreakdown] = reward.compute_reward) -> "WorkflowEnvironment":
        """The environment with the limits of a `rollout.RolloutConfig` (`rollout`)."""
        return cls(tokenizer, execute, env, max_assistant_turns=rollout.max_assistant_turns,
                   max_observation_chars=rollout.max_observation_chars, template_newline=rollout.template_newline,
                   close_turns=rollout.stop_at_action, score=score)

    def open(self, question: Any) -> Opening:
        messages = self.env.messages(question.question)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return Opening(messages, [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)])

    def step(self, episode: Episode, turn_ids: Sequence[int]) -> Step:
        ids = list(turn_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        action = protocol.parse_turn(text, self.env.pool)
        # The turn being decided counts; the observations already returned are the call rounds.
        finish = protocol.should_stop(action, episode.num_turns + 1, episode.operator_rounds,
                                      self.env.max_operator_calls, self.max_assistant_turns)
        return Step.of(text, action, finish)

    def turn_complete(self, turn_ids: Sequence[int]) -> bool:
        """The turn so far holds the action that decides it, which no later text can change
        (`protocol.turn_decided`); checked only after a token that writes a '>'."""
        if not turn_ids or turn_ids[-1] not in self._closing_ids:
            return False
        return protocol.turn_decided(self.tokenizer.decode(list(turn_ids), skip_special_tokens=False))

    def execute(self, calls: Sequence[tuple[str, str]]) -> list[tuple[str, str | None]]:
        return [(res.text, res.error_kind) for res in self._execute(list(calls), self.templates)]

    def observe(self, episode: Episode, text: str) -> tuple[list[int], str]:
        info = protocol.format_observation(text, self.max_observation_chars)
        episode.turns[-1].truncated_observation = len(text) > self.max_observation_chars
        ids = self.observation.ids(info)
        if self.close_turns and episode.response_ids and episode.response_ids[-1] != self.end_of_turn_id:
            ids = [self.end_of_turn_id] + ids  # a turn stopped at its action: closed as the chat template closes it
        return ids, info

    def score(self, episode: Episode) -> reward.RewardBreakdown:
        """The reward of the episode's decoded response (also stored as `episode.response_text`)."""
        episode.response_text = self.tokenizer.decode(episode.response_ids, skip_special_tokens=True)
        return self._score(episode.response_text, episode.question.golden_answers, [t.text for t in episode.turns])


class WorkflowSetup:
    """`env.kind=workflow`: the run's question files, its policy checkpoint (with its tokenizer), and
    the Workflow-R1 environment over the run's executor (`executor` section: embedded or a URL),
    connected when the environment is first built and closed by `close`."""

    def __init__(self, run: Any):
        self.run, self.executor = run, None

    def questions(self) -> tuple[list, list]:
        return load_data(self.run.data, self.run.run.seed)

    def policy(self, mesh: Any = None) -> tuple[Any, Any]:
        return policy_lib.load(self.run.model, mesh=mesh)

    def source_dir(self) -> Any:
        return policy_lib.checkpoint_dir(self.run.model)

    def environment(self, tokenizer: Any) -> WorkflowEnvironment:
        from workflow_r1.executor.connect import connect

        if self.executor is None:
            self.executor = connect(self.run.executor)
        return WorkflowEnvironment.of(tokenizer, self.executor.client.execute_many_sync, self.run.env, self.run.rollout)

    def executor_name(self) -> str:
        if self.executor is None:
            return "not connected"
        return "embedded " + self.run.executor.llm if self.executor.embedded else self.executor.url

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()  # idempotent
