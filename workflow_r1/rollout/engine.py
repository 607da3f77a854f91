"""The rollout engine: questions x n samples through the policy's sampler and an environment.

For a batch of questions, each repeated `n` times (the rows of a group adjacent), every row opens
with the environment's prompt (`Environment.open`), then the engine loops, one round at a time:

  1. `_generate`: one assistant turn for every active row, in one batched
     `Sampler.generate_from(rows=active)` call that continues each row in its KV cache and stops
     each row at its end-of-turn token (sampled, so it carries loss mask 1), or at the row's token
     budget;
  2. `_record_turns`: each turn goes to `Environment.step`, which ends the episode, asks for a tool
     call or gives a reply; a row whose response budget is spent ends here whatever the turn said;
  3. `_run_calls`: all rows' tool calls of the round in one `Environment.execute` (the Workflow-R1
     environment sends them to the executor concurrently);
  4. `_append_observations`: each result as the environment's observation tokens (mask 0); an
     observation that does not fit the response budget ends the episode instead of being cut.

Finished rows are not fed to the sampler again. At the end every episode is scored
(`Environment.score`). This is the "lockstep" engine; `rollout.engine = "pool"` runs the slot pool
of rollout/pool.py and "paged" the paged engine of rollout/paged.py instead (same environment,
same sampler, same episode rules: rollout/rules.py, same draws). Shapes: a batch of Q
questions gives B = Q x n episodes. The environment protocol is per episode
(rollout/environment.py), so the order of rows within a round is the engine's choice alone; the
environments themselves (the Workflow-R1 one, the synthetic operator task) are in `workflow_r1/envs/`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workflow_r1.task import protocol
from workflow_r1.rollout import paged, pool, rules
from workflow_r1.rollout.environment import Environment
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode


ENGINES = ("lockstep", "pool", "paged")


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
    engine: "lockstep" (every row of the host in one sampler session, advanced round by round),
      "pool" (rollout/pool.py: `max_rows_in_flight` slots, continuous batching, calls in flight
      while other rows decode, one prefill per group) or "paged" (rollout/paged.py: a paged KV
      cache with prefix caching; each call computes only the rows that have a turn to generate).
    max_rows_in_flight: the pool's slots per host (0 = every row of the host); its KV cache holds
      this many rows x cache_size tokens whatever the batch. For "paged", the most episodes admitted
      at once (0 = no limit but the pages). Unused by "lockstep".
    page_size: tokens per KV page ("paged").
    kv_cache_pages: pages of the host's paged KV cache (0 = enough for every row in flight at
      cache_size, so nothing is ever preempted); each holds page_size tokens' K and V of every layer.
    decode_burst: most tokens a "paged" call decodes per row before the engine admits, preempts
      and copies pages again (pages are reserved for this many tokens ahead).
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
    engine: str = "lockstep"
    max_rows_in_flight: int = 0
    page_size: int = 64
    kv_cache_pages: int = 0
    decode_burst: int = 128

    def __post_init__(self):
        for name in ("prompts_per_step", "n", "max_prompt_tokens", "max_response_tokens", "max_assistant_turns",
                     "pad_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} unknown; use one of {ENGINES}")
        if self.max_rows_in_flight < 0:
            raise ValueError(f"max_rows_in_flight={self.max_rows_in_flight} must be >= 0 (0 = every row of the host)")
        if self.page_size < 1 or self.decode_burst < 1 or self.kv_cache_pages < 0:
            raise ValueError(f"page_size={self.page_size} and decode_burst={self.decode_burst} must be >= 1, "
                             f"kv_cache_pages={self.kv_cache_pages} >= 0")
        if 0 < self.kv_cache_pages < self.pages_per_row:
            raise ValueError(f"kv_cache_pages={self.kv_cache_pages} cannot hold one longest episode "
                             f"({self.pages_per_row} pages of {self.page_size} tokens for cache_size "
                             f"{self.cache_size}); raise it to at least {self.pages_per_row}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_turn_tokens < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0 and max_turn_tokens >= 0 are required")

    @property
    def cache_size(self) -> int:
        """Tokens one sampler row must hold: the longest prompt plus the whole response budget."""
        return self.max_prompt_tokens + self.max_response_tokens

    @property
    def pages_per_row(self) -> int:
        """Pages one longest episode holds ("paged"): its prompt and whole response budget."""
        return -(-self.cache_size // self.page_size)

    def page_budget(self, rows_in_flight: int) -> int:
        """Pages of the host's paged KV cache: `kv_cache_pages`, or (0) every row in flight at its longest."""
        return self.kv_cache_pages or rows_in_flight * self.pages_per_row


class Policy(Protocol):
    """What the lock-step engine needs of a sampler (`workflow_r1.sampler.Sampler` is one). The pool
    (rollout/pool.py) also needs `start_pool`, `reset`, `prefill`, `fork` and `generate_from`'s
    per-row `seed` / `row_ids` / `step_offset` and `stop_after`, which only `Sampler` has."""

    def start(self, prompts: Sequence[Sequence[int]], row_offset: int = 0) -> Any: ...

    def generate_from(self, session: Any, max_new_tokens: int | Sequence[int], *, rows: Sequence[int],
                      temperature: float, top_p: float, top_k: int, seed: int) -> Any: ...

    def append(self, session: Any, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None: ...


@dataclasses.dataclass
class RolloutStats:
    """Where a rollout's time went (seconds) and how much it generated (tokens).

    seconds_executor: time the sampler waited for operator calls (lock-step: every round's calls;
      pool: only while no row had anything to decode).
    rounds: sampler calls that generated (lock-step: rounds; pool: `generate_from` calls).
    prefill_tokens: prompt tokens written into the KV cache (lock-step: every row's whole prompt;
      pool: a group's prompt once, plus its last token once per sample; paged: what the prefix
      cache did not hold).
    kv_cache_bytes: device bytes of the rollout's KV cache (0 for a policy that does not report it).
    prefix_hit_tokens, prefix_lookup_tokens ("paged"): tokens found in the prefix cache when an
      episode was admitted, of those it looked up (all its tokens but the last, each admission).
    preemptions ("paged"): episodes that gave their pages back for an older one.
    kv_bytes_peak ("paged"): most bytes of pages held by episodes in flight at once.
    """

    seconds_generate: float = 0.0
    seconds_executor: float = 0.0
    seconds_total: float = 0.0
    generated_tokens: int = 0
    rounds: int = 0
    skipped_questions: int = 0
    prefill_tokens: int = 0
    kv_cache_bytes: int = 0
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    preemptions: int = 0
    kv_bytes_peak: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_lookup_tokens, 1)

    def __add__(self, other: "RolloutStats") -> "RolloutStats":
        """Two rollouts of one step (its first batch and a refill): every count and time summed, the
        cache the larger (each rollout holds its own, one after the other)."""
        return RolloutStats(**{f.name: (max if f.name.startswith("kv_") else sum)(
            (getattr(self, f.name), getattr(other, f.name))) for f in dataclasses.fields(self)})


class RolloutEngine:
    """Rolls out questions through `policy` and an environment.

    Args:
      policy: the sampler (see `Policy`), holding the current policy parameters.
      cfg: sampling and limits.
      environment: a `rollout.environment.Environment`, e.g. `envs.workflow.WorkflowEnvironment`
        (the paper's operators behind the executor) or `envs.operators.OperatorTaskEnvironment`.
    """

    def __init__(self, policy: Policy, cfg: RolloutConfig, environment: Environment):
        self.policy, self.cfg, self.environment = policy, cfg, environment

    def encode_prompt(self, question: Any) -> tuple[list[dict[str, str]], list[int]]:
        """(messages, prompt ids) of a question (a `data.Question`, or its text for the Workflow-R1
        environment)."""
        if isinstance(question, str):
            question = _Text(question)
        opening = self.environment.open(question)
        return opening.messages, opening.prompt_ids

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
        t0 = time.perf_counter()
        stats = RolloutStats()
        episodes = self._open(questions, self.cfg.n if n is None else n, row_offset, stats)
        temperature = 0.0 if greedy else self.cfg.temperature
        if episodes and self.cfg.engine == "paged":
            rows = self.cfg.max_rows_in_flight or len(episodes)
            pages = self.cfg.page_budget(min(rows, len(episodes)))
            paged.PagedRollout(self, episodes, pages, seed=seed, temperature=temperature, row_offset=row_offset,
                               stats=stats, progress=progress).run()
            self._score(episodes)
        elif episodes and self.cfg.engine == "pool":
            pool.SlotPool(self, episodes, self.cfg.max_rows_in_flight or len(episodes), seed=seed,
                          temperature=temperature, row_offset=row_offset, stats=stats, progress=progress).run()
            self._score(episodes)
        elif episodes:
            session = self.policy.start([e.prompt_ids for e in episodes], row_offset=row_offset)
            stats.prefill_tokens = sum(len(e.prompt_ids) for e in episodes)
            while True:
                active, limits = self._active_rows(episodes)
                if not active:
                    break
                turns = self._generate(session, active, limits, temperature, seed, stats)
                calls, replies = self._record_turns(episodes, active, turns, stats)
                replies.update(self._run_calls(episodes, calls, stats))
                self._append_observations(session, episodes, replies)
                if progress is not None:
                    progress(sum(e.done for e in episodes), len(episodes))
            stats.kv_cache_bytes = getattr(session, "cache_bytes", 0)
            self._score(episodes)
        stats.seconds_total = time.perf_counter() - t0
        return episodes, stats

    # -------------------------------------------------------------------------------- the steps

    def _open(self, questions: Sequence[Any], n: int, row_offset: int, stats: RolloutStats) -> list[Episode]:
        """n episodes per question whose prompt fits, groups numbered globally (row_offset // n + index)."""
        episodes: list[Episode] = []
        for qi, q in enumerate(questions):
            opening = self.environment.open(q)
            if len(opening.prompt_ids) > self.cfg.max_prompt_tokens:
                stats.skipped_questions += 1
                continue
            for j in range(n):
                episodes.append(Episode(question=q, group=row_offset // n + qi, sample=j,
                                        messages=[dict(m) for m in opening.messages],
                                        prompt_ids=list(opening.prompt_ids)))
        return episodes

    def _active_rows(self, episodes: list[Episode]) -> tuple[list[int], list[int]]:
        """(rows that generate this round, each one's token cap); a row with no budget left ends."""
        active, limits = [], []
        for r, ep in enumerate(episodes):
            if ep.done:
                continue
            limit = rules.turn_limit(self.cfg, ep)
            if limit <= 0:
                ep.finish_reason = FINISH_BUDGET
                continue
            active.append(r)
            limits.append(limit)
        return active, limits

    def _generate(self, session: Any, active: list[int], limits: list[int], temperature: float, seed: int,
                  stats: RolloutStats) -> Any:
        """One assistant turn for every active row; each round samples with its own seed."""
        t = time.perf_counter()
        out = self.policy.generate_from(session, limits, rows=active, temperature=temperature,
                                        top_p=self.cfg.top_p, top_k=self.cfg.top_k,
                                        seed=rules.turn_seed(seed, stats.rounds))
        stats.seconds_generate += time.perf_counter() - t
        stats.rounds += 1
        return out

    def _record_turns(self, episodes: list[Episode], active: list[int], out: Any,
                      stats: RolloutStats) -> tuple[list[tuple[int, str, str]], dict[int, tuple[str, str | None]]]:
        """Each row's turn through `Environment.step`: ([(row, operator, content)] tool calls,
        {row: (reply text, None)}); a row whose response budget is spent ends here."""
        calls: list[tuple[int, str, str]] = []
        replies: dict[int, tuple[str, str | None]] = {}
        for r, toks, lps in zip(active, out.tokens, out.logprobs):
            ep = episodes[r]
            stats.generated_tokens += len(toks)
            kind, what = rules.end_turn(self.cfg, self.environment, ep, toks, lps)
            if kind == "call":
                calls.append((r, *what))
            elif kind == "reply":
                replies[r] = (what, None)
        return calls, replies

    def _run_calls(self, episodes: list[Episode], calls: list[tuple[int, str, str]],
                   stats: RolloutStats) -> dict[int, tuple[str, str | None]]:
        """{row: (observation text, error kind)} of the round's tool calls, run together."""
        if not calls:
            return {}
        t = time.perf_counter()
        results = self.environment.execute([(op, content) for _, op, content in calls])
        dt = time.perf_counter() - t
        stats.seconds_executor += dt
        for r, _, _ in calls:
            episodes[r].seconds_executor += dt
        return {r: res for (r, _, _), res in zip(calls, results)}

    def _append_observations(self, session: Any, episodes: list[Episode],
                             replies: dict[int, tuple[str, str | None]]) -> None:
        rows, blocks = [], []
        for r, (text, error_kind) in sorted(replies.items()):
            ids = rules.observe(self.cfg, self.environment, episodes[r], text, error_kind)
            if ids is not None:
                rows.append(r)
                blocks.append(ids)
        if rows:
            self.policy.append(session, rows, blocks)

    def _score(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            score = self.environment.score(ep)
            ep.reward, ep.reward_format, ep.reward_outcome = score.total, score.format, score.outcome
            ep.answer_source = score.answer_source


@dataclasses.dataclass(frozen=True)
class _Text:
    """A bare question text where a `data.Question` is expected (`encode_prompt("...")`)."""

    question: str
