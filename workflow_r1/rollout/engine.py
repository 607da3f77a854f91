"""The rollout engine: questions x n samples through the policy's sampler and an environment.

For a batch of questions, each repeated `n` times (the rows of a group adjacent), every row opens
with the environment's prompt (`Environment.open`); then rollout/paged.py drives each episode on
its own: an assistant turn generated in calls over the episodes that have one (`Policy.
generate_paged`, continuous batching over a paged KV cache with prefix caching), each turn through
`Environment.step`, its tool call sent to the executor at once, the observation appended when it
returns, with one set of episode rules (budget, finish, observation fit, sampling keys:
rollout/rules.py). At the end every episode is scored (`Environment.score`).

Shapes: a batch of Q questions gives B = Q x n episodes. The environment protocol is per episode
(rollout/environment.py), so the order in which episodes are computed is the engine's choice
alone; the environments themselves (the Workflow-R1 one, the synthetic operator task) are in
`workflow_r1/envs/`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from workflow_r1 import bounds
from workflow_r1.task import protocol
from workflow_r1.rollout import paged
from workflow_r1.rollout.environment import Environment
from workflow_r1.rollout.episode import Episode
from workflow_r1.rollout.versions import TurnVersions



# rollout.paged_attention's values (sampler/paged.attention_mode resolves "auto").
PAGED_ATTENTION = ("auto", "view", "gather", "kernel")


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
    weights_dtype: the dtype of the sampler's copy of the weights ("" = the parameters' own),
      "bfloat16" or "float32". bf16 weights of a bf16-compute policy are the numbers its forward
      multiplies anyway, at half the bytes read per decode step (sampler/weights.py); the fused
      CPU path holds its weights in its compute dtype, so it takes "" or that dtype only.
    tensor_parallel: chips per tensor-parallel sampler on each host (0 = the sampler runs on the
      training mesh's layout on one host, and on a host mesh of mesh.tensor on several; -1 = all
      of a host's chips; N = groups of N). The sampler's weights are then split by heads, KV heads,
      MLP width and vocabulary over those chips, whatever the training mesh (sampler/weights.py).
    template_newline: keep the chat template's newline after an assistant turn that an observation
      follows (False: the release's token stream; docs/paper.md, Our choices).
    pad_multiple: the training batch's length is rounded up to a multiple of this (fewer distinct
      shapes, so fewer compilations of the update, against padding that still costs compute).
    max_rows_in_flight: the most episodes admitted at once per host (0 = no limit but the pages);
      also the rows of one call at most.
    page_size: tokens per KV page.
    kv_cache_pages: pages of the host's KV cache (0 = enough for every row in flight at cache_size,
      so nothing is ever preempted); each holds page_size tokens' K and V of every layer.
    decode_burst: most tokens a call decodes per row before the engine admits, preempts and
      writes pages again (pages are reserved for this many tokens ahead).
    paged_attention: how a call reads its rows' pages: "view" (copied into a dense working cache
      and back), "gather" (attended in place through a jnp gather, the model path), "kernel" (jax's
      TPU ragged paged attention, in place), "auto" (the kernel on TPU, the view elsewhere; with
      max_tokens_per_step, the fused CPU path's own pages on one CPU and "gather" off TPU).
    stop_at_action: end an assistant turn as soon as it holds a complete action (the
      environment's `turn_complete`: for the workflow, a `</tool>` or `</answer>` that decides the
      turn), as Search-R1 stops at its search tag; the environment then closes the turn with the
      end-of-turn token, unsampled, before the observation. False: a turn ends at the end-of-turn
      token or its budget, as in the paper's release (docs/paper.md, Our choices). Needs ragged
      steps (max_tokens_per_step > 0).
    max_tokens_per_step: 0 = calls (each writes its rows' pending tokens, then decodes up to
      `decode_burst` tokens a row); N > 0 = ragged steps: each engine step computes at most N tokens
      of the rows in flight in one forward (a token for each decoding row, then chunks of prompts
      and observations) and samples one token for each row whose pending tokens it ends
      (sampler/ragged.py). Runs on the pages in place: the fused CPU path's, "gather" or "kernel".
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
    weights_dtype: str = ""
    tensor_parallel: int = 0
    template_newline: bool = True
    pad_multiple: int = 512
    max_rows_in_flight: int = 0
    page_size: int = 64
    kv_cache_pages: int = 0
    decode_burst: int = 128
    paged_attention: str = "auto"
    max_tokens_per_step: int = 0
    stop_at_action: bool = False

    def __post_init__(self):
        c, tokens, count = bounds.check, bounds.MAX_TOKENS, bounds.MAX_COUNT
        c("rollout.prompts_per_step", self.prompts_per_step, 1, count)
        c("rollout.n", self.n, 1, 1 << 16)
        c("rollout.temperature", self.temperature, 0, 100, note=" (0: greedy)")
        c("rollout.top_p", self.top_p, 0, 1, above=True)
        c("rollout.top_k", self.top_k, 0, count, note=" (0: off)")
        c("rollout.max_prompt_tokens", self.max_prompt_tokens, 1, tokens)
        c("rollout.max_response_tokens", self.max_response_tokens, 1, tokens)
        # The KV cache of one row holds both: past MAX_TOKENS no model here has the context for it.
        c("rollout.max_prompt_tokens + rollout.max_response_tokens", self.cache_size, 2, tokens)
        c("rollout.max_turn_tokens", self.max_turn_tokens, 0, tokens, note=" (0: only the response budget)")
        c("rollout.max_assistant_turns", self.max_assistant_turns, 1, 1 << 16)
        c("rollout.max_observation_chars", self.max_observation_chars, 0, 1 << 30)
        c("rollout.pad_multiple", self.pad_multiple, 1, tokens)
        c("rollout.max_rows_in_flight", self.max_rows_in_flight, 0, count, note=" (0: every row of the host)")
        c("rollout.page_size", self.page_size, 1, 1 << 16)
        c("rollout.kv_cache_pages", self.kv_cache_pages, 0, count, note=" (0: enough for every row in flight)")
        c("rollout.decode_burst", self.decode_burst, 1, tokens)
        if self.paged_attention not in PAGED_ATTENTION:
            raise ValueError(f"rollout.paged_attention must be one of {list(PAGED_ATTENTION)}, "
                             f"got {self.paged_attention!r}")
        c("rollout.max_tokens_per_step", self.max_tokens_per_step, 0, tokens, note=" (0: calls, not ragged steps)")
        if self.max_tokens_per_step and self.paged_attention == "view":
            raise ValueError(f"rollout.max_tokens_per_step={self.max_tokens_per_step} runs ragged steps on the pages "
                             "in place, not through a view: set rollout.paged_attention=auto (or gather, kernel), "
                             "or rollout.max_tokens_per_step=0")
        if self.stop_at_action and not self.max_tokens_per_step:
            raise ValueError("rollout.stop_at_action=True ends turns between ragged steps: set "
                             "rollout.max_tokens_per_step > 0 (e.g. 256), or rollout.stop_at_action=False")
        bounds.choice("rollout.weights_dtype", self.weights_dtype, ("", "bfloat16", "float32"),
                      note=" ('': the parameters' own)")
        c("rollout.tensor_parallel", self.tensor_parallel, -1, 1 << 16,
          note=" (0: the training mesh's layout, -1: all of a host's chips)")
        if 0 < self.kv_cache_pages < self.pages_per_row:
            raise ValueError(f"kv_cache_pages={self.kv_cache_pages} cannot hold one longest episode "
                             f"({self.pages_per_row} pages of {self.page_size} tokens for cache_size "
                             f"{self.cache_size}); raise it to at least {self.pages_per_row}")

    @property
    def cache_size(self) -> int:
        """Tokens one sampler row must hold: the longest prompt plus the whole response budget."""
        return self.max_prompt_tokens + self.max_response_tokens

    @property
    def pages_per_row(self) -> int:
        """Pages one longest episode holds: its prompt and whole response budget."""
        return -(-self.cache_size // self.page_size)

    def page_budget(self, rows_in_flight: int) -> int:
        """Pages of the host's KV cache: `kv_cache_pages`, or (0) every row in flight at its longest."""
        return self.kv_cache_pages or rows_in_flight * self.pages_per_row


class Policy(Protocol):
    """What the engine needs of a sampler (`workflow_r1.sampler.Sampler` is one; so are the
    scripted policies of simulations and tests, rollout/scripted.py).

    `new_pages(num_pages, page_size)`: the KV pages (an object with `nbytes` and `bytes_per_page`).
    `step_paged(pages, tables, sequences, cached, counts, **sampling)`: one ragged step (only with
    `max_tokens_per_step`): each sequence writes its next counts[r] tokens, one whose pending
    tokens end there samples one token; returns what `generate_paged` returns.
    `generate_paged(pages, tables, sequences, cached, max_new_tokens, **sampling)`: one call over
    sequences (token ids; the first cached[r] in the pages tables[r]): writes the rest, generates
    up to max_new_tokens[r] for each with the sampling keywords of `Sampler.generate_from` (one
    seed, row id and step offset per sequence; `stop_after`, `min_buffer`), and returns (a
    `SampleOutput` of one entry per sequence, the pages, the tokens now cached per sequence).
    """

    def new_pages(self, num_pages: int, page_size: int) -> Any: ...

    def generate_paged(self, pages: Any, tables: list[list[int]], sequences: list[list[int]], cached: list[int],
                       max_new_tokens: list[int], **sampling: Any) -> tuple[Any, Any, list[int]]: ...


@dataclasses.dataclass
class RolloutStats:
    """Where a rollout's time went (seconds) and how much it generated (tokens).

    seconds_executor: time the engine waited for operator calls with nothing to compute.
    seconds_calls: time at least one operator call was in flight (the executor's busy time; the
      rest of a run's wall time it is idle).
    rounds: calls of the policy (`Policy.generate_paged`).
    prefill_tokens: prompt tokens written into the KV cache (what the prefix cache did not hold).
    kv_cache_bytes: device bytes of the rollout's KV pages (0 for a policy that holds none).
    prefix_hit_tokens, prefix_lookup_tokens: tokens found in the prefix cache when an episode was
      admitted, of those it looked up (all its tokens but the last, each admission).
    preemptions: episodes that gave their pages back for an older one.
    kv_bytes_peak: most bytes of pages held by episodes in flight at once.
    seconds_versions, version_loads: time the engine waited for a newer policy version and loaded
      it, and how many it loaded (partial rollouts, rollout/versions.py).
    kv_slots_at_peak, kv_tokens_at_peak: the token slots of those pages, and the tokens they held
      then (a page shared by several episodes counted once); `kv_overhead` is their ratio (partly
      filled pages, pages reserved for a burst ahead).
    """

    seconds_generate: float = 0.0
    seconds_executor: float = 0.0
    seconds_total: float = 0.0
    seconds_calls: float = 0.0
    generated_tokens: int = 0
    rounds: int = 0
    skipped_questions: int = 0
    prefill_tokens: int = 0
    kv_cache_bytes: int = 0
    prefix_hit_tokens: int = 0
    prefix_lookup_tokens: int = 0
    preemptions: int = 0
    kv_bytes_peak: int = 0
    kv_slots_at_peak: int = 0
    kv_tokens_at_peak: int = 0
    seconds_versions: float = 0.0
    version_loads: int = 0

    @property
    def kv_overhead(self) -> float:
        """Token slots of the pages held at the peak per token they held (1.0: no waste)."""
        return self.kv_slots_at_peak / max(self.kv_tokens_at_peak, 1)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / max(self.prefix_lookup_tokens, 1)

    def __add__(self, other: "RolloutStats") -> "RolloutStats":
        """Two rollouts of one step (its first batch and a refill): every count and time summed, the
        cache the larger (each rollout holds its own, one after the other) with its peak's figures."""
        peak = max((self, other), key=lambda x: x.kv_bytes_peak)  # the peak's own slots and tokens
        return RolloutStats(**{f.name: getattr(peak, f.name) if f.name.endswith("_at_peak") else
                               (max if f.name.startswith("kv_") else sum)((getattr(self, f.name), getattr(other, f.name)))
                               for f in dataclasses.fields(self)})


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
            versions: TurnVersions | None = None) -> tuple[list[Episode], RolloutStats]:
        """Rolls out every question `n` times (default cfg.n). Returns the episodes in row order
        (question-major, so the n rows of a group are adjacent) and the timing stats.

        Questions whose prompt exceeds `max_prompt_tokens` are skipped (counted in the stats).
        `progress(finished_rows, total_rows)` is called as episodes finish. row_offset: the global
        index of this call's first row (a host's share of a multi-host batch samples what one
        process rolling out the whole batch would for those rows, and numbers its groups globally).
        versions: which policy version generates each turn (default: version 0, the weights the
        policy holds, for every turn); recorded on each turn and, its first turn's, on the episode.
        """
        t0 = time.perf_counter()
        stats = RolloutStats()
        episodes = self._open(questions, self.cfg.n if n is None else n, row_offset, stats)
        temperature = 0.0 if greedy else self.cfg.temperature
        if episodes:
            rows = self.cfg.max_rows_in_flight or len(episodes)
            pages = self.cfg.page_budget(min(rows, len(episodes)))
            versions = versions or TurnVersions()
            for ep in episodes:
                ep.policy_version = versions.first
            paged.PagedRollout(self, episodes, pages, seed=seed, temperature=temperature, row_offset=row_offset,
                               stats=stats, progress=progress, versions=versions).run()
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

    def _score(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            score = self.environment.score(ep)
            ep.reward, ep.reward_format, ep.reward_outcome = score.total, score.format, score.outcome
            ep.answer_source = score.answer_source


@dataclasses.dataclass(frozen=True)
class _Text:
    """A bare question text where a `data.Question` is expected (`encode_prompt("...")`)."""

    question: str
