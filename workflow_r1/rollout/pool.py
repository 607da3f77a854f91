"""The slot-pool rollout engine (`rollout.engine = "pool"`): continuous batching over a fixed KV cache.

The lock-step engine (engine.py) holds every row of the host in one sampler session and advances
all of them one round at a time. The pool instead opens a session of `max_rows_in_flight` slots
(`Sampler.start_pool`: the whole cache allocated once, M slots x the cache length), so rollout
memory is set by M and not by the batch (prompts_per_step x n / hosts), and drives each episode on
its own:

  - admit: waiting episodes take free slots in row order; the samples of one group admitted
    together share one prefill of their prompt (`Sampler.prefill` into the first slot, then
    `Sampler.fork` copies its KV into the others);
  - decode: every slot that has a turn to generate decodes in one `generate_from(stop_after=1)`,
    which returns as soon as one row ends its turn; the rows still generating come back "paused"
    and simply continue in the next call (with `step_offset`, so their draws do not change);
  - a finished turn goes to `Environment.step` at once: a tool call leaves the decode batch and is
    sent to the executor on a thread pool right away, while the other rows keep decoding; its
    observation is appended to the slot's cache when it arrives and the row rejoins; a finished
    episode frees its slot for the next waiting one.

Results do not depend on the schedule: turn t of the episode in row g (its index in the host's
batch, plus `row_offset`) samples with seed (seed x 1,000,003 + t) mod 2^31 and row id g, which is
exactly what the lock-step engine draws for it in round t. So an episode's tokens depend on the
seed, its question's and sample's place in the batch, and nothing else: not its slot, not M, not
its batch-mates, not the executor's latencies (the tests check M = B, B/4, 1 and shuffled
latencies, and greedy episodes against the lock-step engine). Only floating-point rounding of
different batch shapes differs, far below what changes a sampled token in practice.

An executor fault is an observation (error kind "client_error"), never an exception, as for the
lock-step engine.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from workflow_r1.rollout import rules
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode
from workflow_r1.sampler.session import PAUSED  # generate_from's reason for a row whose turn goes on


class SlotPool:
    """One rollout of `episodes` (row order) through a pool of `slots` sampler rows.

    engine: the `engine.RolloutEngine` whose policy (a `Sampler`), environment and config are used
      (not imported here: engine.py imports this module); stats: its `engine.RolloutStats`.
    """

    def __init__(self, engine: Any, episodes: list[Episode], slots: int, *, seed: int,
                 temperature: float, row_offset: int, stats: Any,
                 progress: Callable[[int, int], None] | None = None):
        self.engine, self.cfg, self.env = engine, engine.cfg, engine.environment
        self.policy, self.episodes, self.stats = engine.policy, episodes, stats
        self.seed, self.temperature, self.row_offset, self.progress = seed, temperature, row_offset, progress
        self.slots = min(slots, len(episodes))
        self.session = self.policy.start_pool(self.slots, row_offset=row_offset)
        stats.kv_cache_bytes = self.session.cache_bytes
        self.waiting: deque[int] = deque(range(len(episodes)))
        self.episode_of: list[int | None] = [None] * self.slots
        self.turn: dict[int, rules.OpenTurn] = {}       # slot -> its turn being generated (the decode batch)
        self.calls: dict[cf.Future, tuple[int, float]] = {}  # call in flight -> (slot, start time)
        self.finished = 0

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> None:
        with cf.ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix="rollout-call") as threads:
            self.threads = threads
            while True:
                self._admit()
                self._collect(block=not self.turn)
                if self.turn:
                    self._decode()
                elif not self.calls and not self.waiting:
                    break

    def _admit(self) -> None:
        """Waiting episodes into free slots; a group's samples admitted together share one prefill."""
        free = [s for s in range(self.slots) if self.episode_of[s] is None]
        runs: list[list[int]] = []  # slots per group, in admission order
        last_group = None
        for s in free:
            if not self.waiting:
                break
            e = self.waiting.popleft()
            self.episode_of[s] = e
            group = self.episodes[e].group
            if runs and group == last_group:
                runs[-1].append(s)
            else:
                runs.append([s])
                self.policy.reset(self.session, s, self.episodes[e].prompt_ids)
            last_group = group
        if not runs:
            return
        t = time.perf_counter()
        heads = [r[0] for r in runs]
        written = self.policy.prefill(self.session, heads)
        for r in runs:
            self.policy.fork(self.session, r[0], r[1:])
        self.stats.seconds_generate += time.perf_counter() - t
        # Each slot still feeds its prompt's last token itself (to get its first logits).
        self.stats.prefill_tokens += written + sum(len(r) for r in runs)
        for r in runs:
            for s in r:
                self._begin_turn(s)

    def _collect(self, block: bool) -> None:
        """Appends the observations of the calls that returned (waits for one if `block`)."""
        if not self.calls:
            return
        t = time.perf_counter()
        done, _ = cf.wait(list(self.calls), timeout=None if block else 0, return_when=cf.FIRST_COMPLETED)
        if block:
            self.stats.seconds_executor += time.perf_counter() - t  # the sampler idled this long
        # Slot order, so what is appended when does not depend on which thread finished first.
        for f in sorted(done, key=lambda f: self.calls[f][0]):
            s, start = self.calls.pop(f)
            self.episodes[self.episode_of[s]].seconds_executor += time.perf_counter() - start
            self._observe(s, *f.result())

    def _decode(self) -> None:
        """One `generate_from` over the slots generating a turn, until the first of them ends it."""
        rows = sorted(self.turn)
        eps = [self.episodes[self.episode_of[s]] for s in rows]
        t = time.perf_counter()
        out = self.policy.generate_from(
            self.session, [self.turn[s].limit - len(self.turn[s].tokens) for s in rows], rows=rows,
            temperature=self.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
            seed=[rules.turn_seed(self.seed, ep.num_turns) for ep in eps],
            row_ids=[self.row_offset + self.episode_of[s] for s in rows],
            step_offset=[len(self.turn[s].tokens) for s in rows], stop_after=1)
        self.stats.seconds_generate += time.perf_counter() - t
        self.stats.rounds += 1
        for s, toks, lps, reason in zip(rows, out.tokens, out.logprobs, out.finish_reason):
            turn = self.turn[s]
            turn.tokens.extend(toks)
            turn.logprobs.extend(float(x) for x in lps)
            self.stats.generated_tokens += len(toks)
            if reason != PAUSED:
                del self.turn[s]
                self._end_turn(s, turn)

    # ----------------------------------------------------------------------- one episode's steps

    def _begin_turn(self, s: int) -> None:
        ep = self.episodes[self.episode_of[s]]
        limit = rules.turn_limit(self.cfg, ep)
        if limit <= 0:
            ep.finish_reason = FINISH_BUDGET
            self._finish(s)
        else:
            self.turn[s] = rules.OpenTurn(limit)

    def _end_turn(self, s: int, turn: rules.OpenTurn) -> None:
        """The turn through `Environment.step`: the end, a call sent now, or a reply appended now."""
        ep = self.episodes[self.episode_of[s]]
        kind, what = rules.end_turn(self.cfg, self.env, ep, turn.tokens, turn.logprobs)
        if kind == "finish":
            self._finish(s)
        elif kind == "call":
            self.calls[self.threads.submit(execute_one, self.env, what)] = (s, time.perf_counter())
        else:
            self._observe(s, what, None)

    def _observe(self, s: int, text: str, error_kind: str | None) -> None:
        ids = rules.observe(self.cfg, self.env, self.episodes[self.episode_of[s]], text, error_kind)
        if ids is None:
            self._finish(s)
            return
        self.policy.append(self.session, [s], [ids])
        self._begin_turn(s)

    def _finish(self, s: int) -> None:
        """The episode in slot s has its finish_reason: it leaves."""
        self.episode_of[s] = None
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, len(self.episodes))


def execute_one(env: Any, call: tuple[str, str]) -> tuple[str, str | None]:
    """One tool call on a worker thread: (observation, error kind); a fault is an observation."""
    try:
        (result,) = env.execute([call])
        return result
    except Exception as e:  # noqa: BLE001 - an environment that broke its never-raise contract
        return f"The operator call failed: {type(e).__name__}: {e}", "client_error"
