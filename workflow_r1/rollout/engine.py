"""The multi-turn rollout: questions x n samples through the policy's sampler and the operator executor.

For a batch of questions, each repeated `n` times (the rows of a group adjacent), every row opens
with the chat-templated system + user prompt, then the engine loops (docs/paper.md, The multi-turn
protocol):

  1. one assistant turn for every active row, in one batched `Sampler.generate_from(rows=active)`
     call that continues each row in its KV cache and stops each row at its end-of-turn token
     (sampled, so it carries loss mask 1), or at the row's token budget;
  2. each turn is parsed (`protocol.parse_turn`): an answer ends the row; a call of an operator in
     the pool goes to the executor, all rows' calls together and concurrently (an executor failure
     comes back as an observation, never as an exception); a malformed turn gets the WarningOp text;
  3. each result is wrapped as `<info>...</info>` (middle-truncated to 2048 characters) and appended
     as a tool message rendered by the chat template, with the next assistant header (mask 0);
  4. rows stop at the call cap (20 observation rounds), the turn cap (21 assistant turns), or when the
     response budget (8192 tokens in the paper, observations included) cannot hold the next turn or
     observation: an observation that does not fit ends the episode instead of being cut.

Finished rows are not fed to the sampler again. At the end every episode is decoded and scored with
the rule-based reward. Shapes: a batch of Q questions gives B = Q x n episodes.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from workflow_r1.env import protocol, reward
from workflow_r1.env.config import EnvConfig
from workflow_r1.rollout.episode import (FINISH_ANSWER, FINISH_BUDGET, FINISH_CALL_CAP, FINISH_TURN_CAP, Episode,
                                         Turn)
from workflow_r1.rollout.observation import ObservationTemplate


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How episodes are sampled (the `rollout` config section). Token counts are in tokens.

    prompts_per_step: questions per training step (all hosts together); each is sampled `n` times.
    temperature, top_p, top_k: sampling of the policy (paper: 1.0, 1.0, off); evaluation is greedy.
    max_prompt_tokens: questions whose opening prompt is longer are skipped (verl's overlong filter).
    max_response_tokens: budget of everything after the prompt, observations included (paper 8192).
    max_turn_tokens: cap on one assistant turn (0 = only the response budget, as in the paper).
    max_assistant_turns: generations per episode (paper 21: 20 tool rounds and the final answer).
    max_observation_chars: operator results are middle-truncated to this many characters (paper 2048).
    sampler_dtype: compute dtype of generation ("" = the policy's), e.g. bfloat16 rollouts from fp32
      training weights on CPU.
    template_newline: keep the chat template's newline after an assistant turn that an observation
      follows (False: the release's token stream; docs/paper.md, Our choices).
    pad_multiple: the training batch's length is rounded up to a multiple of this (fewer distinct
      shapes, so fewer compilations of the update, against padding that still costs compute).
    """

    prompts_per_step: int = 512
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int = 1280
    max_response_tokens: int = 8192
    max_turn_tokens: int = 0
    max_assistant_turns: int = protocol.MAX_ASSISTANT_TURNS
    max_observation_chars: int = protocol.MAX_OBSERVATION_CHARS
    sampler_dtype: str = ""
    template_newline: bool = True
    pad_multiple: int = 512

    def __post_init__(self):
        for name in ("prompts_per_step", "n", "max_prompt_tokens", "max_response_tokens", "max_assistant_turns",
                     "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_turn_tokens < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0 and max_turn_tokens >= 0 are required")

    @property
    def cache_size(self) -> int:
        """Tokens one sampler row must hold: the longest prompt plus the whole response budget."""
        return self.max_prompt_tokens + self.max_response_tokens


class Policy(Protocol):
    """What the engine needs of a sampler (`workflow_r1.sampler.Sampler` is one)."""

    def start(self, prompts: Sequence[Sequence[int]], row_offset: int = 0) -> Any: ...

    def generate_from(self, session: Any, max_new_tokens: int | Sequence[int], *, rows: Sequence[int],
                      temperature: float, top_p: float, top_k: int, seed: int) -> Any: ...

    def append(self, session: Any, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None: ...


# ([(operator, content)], {operator: executor prompt template}) -> [Observation]
Executor = Callable[[list[tuple[str, str]], Mapping[str, str]], list[Any]]


@dataclasses.dataclass
class RolloutStats:
    """Where a rollout's time went (seconds) and how much it generated (tokens)."""

    seconds_generate: float = 0.0
    seconds_executor: float = 0.0
    seconds_total: float = 0.0
    generated_tokens: int = 0
    rounds: int = 0
    skipped_questions: int = 0


class RolloutEngine:
    """Rolls out questions through `policy` and `execute`.

    Args:
      policy: the sampler (see `Policy`), holding the current policy parameters.
      tokenizer: the policy's HF tokenizer (chat template, decoding).
      execute: runs operator calls with the given executor prompt templates, e.g.
        `ExecutorClient(url).execute_many_sync`; must not raise.
      cfg: sampling and limits. env: the operator pool and the prompt set; every call carries the
        set's executor prompts, so a remote executor runs the same words as the policy's prompt set.
      score: `(response_text, golden_answers, assistant_texts) -> RewardBreakdown`; the workflow
        reward by default (a baseline that answers without tags brings its own).
    """

    def __init__(self, policy: Policy, tokenizer: Any, execute: Executor, cfg: RolloutConfig,
                 env: EnvConfig | None = None, score: Callable[..., reward.RewardBreakdown] = reward.compute_reward):
        self.policy, self.tokenizer, self.execute, self.cfg = policy, tokenizer, execute, cfg
        self.score = score
        self.env = env or EnvConfig()
        self.templates = self.env.operator_templates()
        self.observation = ObservationTemplate(tokenizer, template_newline=cfg.template_newline)
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.observation.end_of_turn)

    def encode_prompt(self, question: str) -> tuple[list[dict[str, str]], list[int]]:
        messages = self.env.messages(question)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return messages, [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def run(self, questions: Sequence[Any], *, n: int | None = None, seed: int = 0,
            greedy: bool = False, progress: Callable[[int, int], None] | None = None, row_offset: int = 0,
            ) -> tuple[list[Episode], RolloutStats]:
        """Rolls out every question `n` times (default cfg.n). Returns the episodes in row order
        (question-major, so the n rows of a group are adjacent) and the timing stats.

        Questions whose prompt exceeds `max_prompt_tokens` are skipped (counted in the stats).
        `progress(finished_rows, total_rows)` is called after every round. row_offset: the global
        index of this call's first row (a host's share of a multi-host batch samples what one
        process rolling out the whole batch would for those rows, and numbers its groups globally).
        """
        cfg, n = self.cfg, self.cfg.n if n is None else n
        t0 = time.perf_counter()
        stats = RolloutStats()
        episodes: list[Episode] = []
        for qi, q in enumerate(questions):
            messages, ids = self.encode_prompt(q.question)
            if len(ids) > cfg.max_prompt_tokens:
                stats.skipped_questions += 1
                continue
            for j in range(n):
                episodes.append(Episode(question=q, group=row_offset // n + qi, sample=j,
                                        messages=[dict(m) for m in messages], prompt_ids=list(ids)))
        if not episodes:
            stats.seconds_total = time.perf_counter() - t0
            return episodes, stats
        session = self.policy.start([e.prompt_ids for e in episodes], row_offset=row_offset)
        temperature = 0.0 if greedy else cfg.temperature
        while True:
            active = [r for r, e in enumerate(episodes) if not e.done]
            limits = [self._turn_limit(episodes[r]) for r in active]
            for r, lim in zip(active, limits):
                if lim <= 0:
                    episodes[r].finish_reason = FINISH_BUDGET
            active = [r for r, lim in zip(active, limits) if lim > 0]
            if not active:
                break
            limits = [lim for lim in limits if lim > 0]
            t = time.perf_counter()
            out = self.policy.generate_from(session, limits, rows=active, temperature=temperature,
                                            top_p=cfg.top_p, top_k=cfg.top_k,
                                            seed=(seed * 1_000_003 + stats.rounds) % (2 ** 31))
            stats.seconds_generate += time.perf_counter() - t
            stats.rounds += 1
            calls: list[tuple[int, str, str]] = []
            replies: dict[int, tuple[str, str | None]] = {}
            for r, toks, lps in zip(active, out.tokens, out.logprobs):
                ep = episodes[r]
                stats.generated_tokens += len(toks)
                text = self._turn_text(toks)
                action = protocol.parse_turn(text, self.env.pool)
                ep.add_turn(toks, lps, Turn(text=text, action=action.kind, operator=action.operator))
                if ep.response_length >= cfg.max_response_tokens:
                    ep.finish_reason = FINISH_BUDGET
                elif action.kind == "answer":
                    ep.finish_reason = FINISH_ANSWER
                elif ep.num_turns >= cfg.max_assistant_turns:
                    ep.finish_reason = FINISH_TURN_CAP
                elif ep.operator_rounds >= self.env.max_operator_calls:
                    ep.finish_reason = FINISH_CALL_CAP
                elif action.kind == "tool":
                    calls.append((r, action.operator, action.content))
                else:
                    replies[r] = (action.content, None)
            if calls:
                t = time.perf_counter()
                results = self.execute([(op, content) for _, op, content in calls], self.templates)
                dt = time.perf_counter() - t
                stats.seconds_executor += dt
                for (r, _, _), res in zip(calls, results):
                    replies[r] = (res.text, res.error_kind)
                    episodes[r].seconds_executor += dt
            self._append_observations(session, episodes, replies)
            if progress is not None:
                progress(sum(e.done for e in episodes), len(episodes))
        for ep in episodes:
            ep.response_text = self.tokenizer.decode(ep.response_ids, skip_special_tokens=True)
            score = self.score(ep.response_text, ep.question.golden_answers, [t.text for t in ep.turns])
            ep.reward, ep.reward_format, ep.reward_outcome = score.total, score.format, score.outcome
            ep.answer_source = score.answer_source
        stats.seconds_total = time.perf_counter() - t0
        return episodes, stats

    def _turn_limit(self, ep: Episode) -> int:
        left = self.cfg.max_response_tokens - ep.response_length
        return min(left, self.cfg.max_turn_tokens) if self.cfg.max_turn_tokens else left

    def _turn_text(self, token_ids: Sequence[int]) -> str:
        ids = list(token_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _append_observations(self, session: Any, episodes: list[Episode],
                             replies: dict[int, tuple[str, str | None]]) -> None:
        rows, blocks = [], []
        for r, (text, error_kind) in sorted(replies.items()):
            ep = episodes[r]
            info = protocol.format_observation(text, self.cfg.max_observation_chars)
            ids = self.observation.ids(info)
            turn = ep.turns[-1]
            turn.observation, turn.error_kind = text, error_kind
            turn.truncated_observation = len(text) > self.cfg.max_observation_chars
            if ep.response_length + len(ids) >= self.cfg.max_response_tokens:
                ep.finish_reason = FINISH_BUDGET  # the observation would not fit: end instead of cutting it
                continue
            ep.add_observation(ids, info)
            rows.append(r)
            blocks.append(ids)
        if rows:
            self.policy.append(session, rows, blocks)

