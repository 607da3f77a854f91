"""The rollout engine's loop: only live rows are computed, and a page of KV is computed once.

Memory is a pool of `kv_cache_pages` pages of `page_size` tokens (rollout/pages.py keeps the
books, the policy the device arrays: sampler/paged.py), so a host holds the tokens its episodes
actually have, not `rows x cache_size`. The loop drives every episode on its own (continuous
batching):

  - admit: waiting episodes (row order) start while pages and `max_rows_in_flight` allow. The
    full pages of an episode's tokens that the prefix cache holds are shared, not computed: the
    template all prompts share, a group's prompt for its later samples, a preempted episode's own
    history. An episode whose next page another one is computing in this call waits for that call
    and then shares it (the call is then a short one, `decode_burst` 1, so the wait is one token).
  - a call: every episode with a turn to generate (and no other: one waiting for its tool call
    costs nothing) goes into one `Policy.generate_paged`, which writes each one's pending tokens
    (a prompt's uncached pages, an observation, a paused turn's last token) into its pages and
    decodes at most `decode_burst` tokens, returning as soon as one row ends its turn (the sampler
    runs it on a dense working cache of those rows' pages, sampler/paged.py). Every page now full
    is registered in the prefix cache.
  - a finished turn goes to `Environment.step` (rollout/rules.py): a tool call is sent to the
    executor on a thread pool at once; its observation joins the episode's pending tokens when it
    returns; a finished episode releases its pages.

Ragged steps (`rollout.max_tokens_per_step` > 0) replace the calls: each step takes the decoding
episodes' one pending token each, then chunks of the others' pending tokens up to the budget,
through one flat forward (`Policy.step_paged`, sampler/ragged.py), and each episode whose pending
tokens it ends samples one token. Admission, pages, the prefix cache and preemption are the same;
a step allocates the pages of the tokens it writes.

Out of pages: a call first gives every row the pages its burst can fill; when there are not
enough, the most recently admitted episode that is not waiting for the executor is preempted: its
pages are released (its full pages stay in the prefix cache, so on re-admission most of it is found
again) and it waits at the front of the queue. The oldest episode in flight is never preempted and
a pool holds at least one longest episode (`RolloutConfig` checks it), so it always progresses:
no deadlock. Until it has room, the others wait.

Results do not depend on the schedule: turn t of the episode in row g samples with
`rules.turn_seed(seed, t)`, row id row_offset + g and, within the turn, step = tokens already
generated; so an episode's tokens depend on (seed, question, sample), not on pages, batch-mates,
budgets or latencies (floating-point rounding of different batch shapes aside).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import heapq
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from workflow_r1.rollout import rules
from workflow_r1.rollout.episode import FINISH_BUDGET, Episode
from workflow_r1.rollout.pages import PagePool, page_hashes
from workflow_r1.sampler import ragged
from workflow_r1.sampler.session import PAUSED


@dataclasses.dataclass
class _Seq:
    """An episode's tokens (prompt, response so far, the turn being generated) and their pages.

    cached: leading tokens whose K/V are in `pages`; registered: leading pages in the prefix cache;
    hashes: chain hashes of its full pages computed so far (`pages.page_hashes`)."""

    tokens: list[int]
    pages: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    cached: int = 0
    registered: int = 0


def execute_one(env: Any, call: tuple[str, str]) -> tuple[str, str | None]:
    """One tool call on a worker thread: (observation, error kind); a fault is an observation."""
    try:
        (result,) = env.execute([call])
        return result
    except Exception as e:  # noqa: BLE001 - an environment that broke its never-raise contract
        return f"The operator call failed: {type(e).__name__}: {e}", "client_error"


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (seconds): the time at least one was open."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class PagedRollout:
    """One rollout of `episodes` (row order). engine: the `engine.RolloutEngine` whose policy (an
    `engine.Policy`, e.g. a `Sampler`), environment and config are used; stats: its `engine.RolloutStats`."""

    def __init__(self, engine: Any, episodes: list[Episode], num_pages: int, *, seed: int, temperature: float,
                 row_offset: int, stats: Any, progress: Callable[[int, int], None] | None = None):
        self.cfg, self.env, self.policy = engine.cfg, engine.environment, engine.policy
        self.episodes, self.stats, self.progress = episodes, stats, progress
        self.seed, self.temperature, self.row_offset = seed, temperature, row_offset
        self.ps = self.cfg.page_size
        self.pool = PagePool(num_pages, self.ps)
        self.kv = self.policy.new_pages(num_pages, self.ps)
        stats.kv_cache_bytes = self.kv.nbytes
        self.max_rows = self.cfg.max_rows_in_flight or len(episodes)
        self.ragged = self.cfg.max_tokens_per_step > 0
        self.waiting = list(range(len(episodes)))   # a heap: the oldest (lowest row) first
        self.seq: dict[int, _Seq] = {}
        self.running: set[int] = set()              # admitted, holding pages (or following)
        self.following: set[int] = set()            # admitted, waiting for a page being computed
        self.turn: dict[int, rules.OpenTurn] = {}
        self.calls: dict[cf.Future, tuple[int, float]] = {}
        self.call_spans: list[tuple[float, float]] = []  # each tool call's (start, end), perf_counter seconds
        self.finished = 0

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> None:
        threads = self.threads = cf.ThreadPoolExecutor(max_workers=max(1, min(self.max_rows, 256)),
                                                       thread_name_prefix="rollout-call")
        try:
            while True:
                self._admit()
                self._collect(block=not self._ready())
                rows = self._ready()
                if rows:
                    self._call(rows)
                elif not self.calls and not self.waiting and not self.running:
                    break
        except BaseException:
            # Stopped from outside (a preemption, an error): calls still out are left to end on their
            # threads, not awaited (one may take up to the executor's timeout, past a preemption's notice).
            threads.shutdown(wait=False, cancel_futures=True)
            raise
        threads.shutdown(wait=True)   # every call was collected: nothing is out
        self.stats.seconds_calls += covered_seconds(self.call_spans)

    def _ready(self) -> list[int]:
        """Episodes with pages and a turn to generate, oldest first."""
        return sorted(e for e in self.running if e in self.turn and e not in self.following)

    def _admit(self) -> None:
        for e in sorted(self.following):
            self._place(e)
        while self.waiting and len(self.running) < self.max_rows:
            if not self._place(self.waiting[0]):
                break
            heapq.heappop(self.waiting)

    def _place(self, e: int) -> bool:
        """Admits episode e (new, preempted or following): shares its cached prefix pages, follows
        a page in the making, or returns False when the pool cannot hold its next call."""
        s = self.seq.get(e)
        if s is None:
            s = self.seq[e] = _Seq(list(self.episodes[e].prompt_ids))
            limit = rules.turn_limit(self.cfg, self.episodes[e])
            self.turn[e] = rules.OpenTurn(limit)
        # The last token is always fed by the call (its logits are sampled from): never cached.
        s.hashes = page_hashes(s.tokens[:len(s.tokens) - 1], self.ps, s.hashes)
        matched = self.pool.match(s.hashes)
        k = len(matched)
        if k < len(s.hashes) and self.pool.promised(s.hashes[k]):
            self.running.add(e)
            self.following.add(e)
            return True
        need = self._pages_needed(s, len(s.tokens), e) - k
        if need > self.pool.available - self.pool.evictable_among(matched) - self._reserved():
            return False
        self.pool.acquire(matched)
        s.pages, s.cached, s.registered = matched, k * self.ps, k
        self.pool.promise(s.hashes[k:], e)
        self.running.add(e)
        self.following.discard(e)
        self.stats.prefix_hit_tokens += k * self.ps
        self.stats.prefix_lookup_tokens += len(s.tokens) - 1
        return True

    def _burst(self, e: int) -> int:
        """Tokens episode e decodes in the next call: its turn's rest, at most `decode_burst` (one
        in a ragged step)."""
        if self.ragged:
            return 1
        t = self.turn[e]
        return max(1, min(t.limit - len(t.tokens), self.cfg.decode_burst))

    def _pages_needed(self, s: _Seq, length: int, e: int) -> int:
        """Pages a call needs for e: its tokens and the burst's (the last sampled one is not written)."""
        return self.pool.pages_for(length + self._burst(e) - 1)

    def _reserved(self) -> int:
        """Pages the ready rows take in their next call beyond what they hold."""
        return sum(max(0, self._pages_needed(self.seq[e], len(self.seq[e].tokens), e) - len(self.seq[e].pages))
                   for e in self._ready())

    def _collect(self, block: bool) -> None:
        """Joins the observations of the calls that returned (waits for one if `block`)."""
        if not self.calls:
            return
        t = time.perf_counter()
        done, _ = cf.wait(list(self.calls), timeout=None if block else 0, return_when=cf.FIRST_COMPLETED)
        if block:
            self.stats.seconds_executor += time.perf_counter() - t
        for f in sorted(done, key=lambda f: self.calls[f][0]):
            e, start = self.calls.pop(f)
            self.episodes[e].seconds_executor += time.perf_counter() - start
            self._observe(e, *f.result())

    # ------------------------------------------------------------------------------ a call

    def _make_room(self, rows: list[int], upto: dict[int, int]) -> list[int]:
        """Gives each row e the pages of its first upto[e] tokens (what its call or step writes),
        preempting the newest episodes that are not waiting for the executor when the pool is
        short. Returns the rows that run."""
        def need(e):
            return max(0, self.pool.pages_for(upto[e]) - len(self.seq[e].pages))

        oldest = min(self.running)
        while sum(need(e) for e in rows) > self.pool.available:
            victims = sorted((e for e in self.running if e != oldest and e in self.turn and self.seq[e].pages),
                             reverse=True)
            if not victims:
                return []   # the executor's rows hold the pages: wait for one to come back
            self._preempt(victims[0])
            rows = [e for e in rows if e != victims[0]]
        for e in rows:
            self.seq[e].pages += self.pool.allocate(need(e))
        return rows

    def _call(self, rows: list[int]) -> None:
        """One `Policy.generate_paged` over `rows`: their pending tokens written into their pages, a
        burst decoded; every page now full registered in the prefix cache."""
        if self.ragged:
            self._step(rows)
            return
        short = bool(self.following)
        burst = {e: 1 if short else self._burst(e) for e in rows}
        # The call writes every pending token and all but the last of its burst.
        rows = self._make_room(rows, {e: len(self.seq[e].tokens) + burst[e] - 1 for e in rows})
        if not rows:
            return
        seqs = [self.seq[e] for e in rows]
        t = time.perf_counter()
        out, self.kv, cached = self.policy.generate_paged(
            self.kv, [s.pages for s in seqs], [s.tokens for s in seqs], [s.cached for s in seqs],
            [burst[e] for e in rows], **self._keys(rows), stop_after=1,
            min_buffer=self.cfg.decode_burst)  # one decode buffer shape: bursts of any length share it
        self._returned(rows, out, cached, time.perf_counter() - t)

    def _step(self, rows: list[int]) -> None:
        """One ragged step (`rollout.max_tokens_per_step`, `Policy.step_paged`): the decoding rows'
        tokens first (one each), then chunks of the other rows' pending tokens (prompts,
        observations), oldest first, up to the budget (`ragged.plan`). A row whose pending tokens
        the step ends samples one token; a row with more left continues its chunks next step."""
        planned = ragged.plan([len(self.seq[e].tokens) - self.seq[e].cached for e in rows],
                              self.cfg.max_tokens_per_step)
        counts = {e: c for e, c in zip(rows, planned) if c}
        rows = self._make_room([e for e in rows if e in counts], {e: self.seq[e].cached + c for e, c in counts.items()})
        if not rows:
            return
        seqs = [self.seq[e] for e in rows]
        t = time.perf_counter()
        out, self.kv, cached = self.policy.step_paged(
            self.kv, [s.pages for s in seqs], [s.tokens for s in seqs], [s.cached for s in seqs],
            [counts[e] for e in rows], **self._keys(rows), max_rows=self.max_rows)
        self._returned(rows, out, cached, time.perf_counter() - t)

    def _keys(self, rows: list[int]) -> dict[str, Any]:
        """The sampling keywords of a call over `rows`: each row's turn seed, row id and step."""
        return dict(temperature=self.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
                    seed=[rules.turn_seed(self.seed, self.episodes[e].num_turns) for e in rows],
                    row_ids=[self.row_offset + e for e in rows], step_offset=[len(self.turn[e].tokens) for e in rows])

    def _returned(self, rows: list[int], out: Any, cached: list[int], seconds: float) -> None:
        """A call's or step's results: tokens appended, pages registered, turns ended or paused."""
        self.stats.seconds_generate += seconds
        self.stats.rounds += 1
        for i, e in enumerate(rows):
            s = self.seq[e]
            prompt = len(self.episodes[e].prompt_ids)
            self.stats.prefill_tokens += max(0, min(prompt, cached[i]) - s.cached)
            s.tokens.extend(int(x) for x in out.tokens[i])
            s.cached = cached[i]
            s.hashes = page_hashes(s.tokens[:s.cached], self.ps, s.hashes)
            for j in range(s.registered, s.cached // self.ps):
                self.pool.register(s.pages[j], s.hashes[j])
            s.registered = max(s.registered, s.cached // self.ps)
            if s.cached >= len(s.tokens) - 1:  # a row in the middle of its chunks still computes the rest
                self.pool.forget_promises(e)
        if self.pool.in_use * self.kv.bytes_per_page > self.stats.kv_bytes_peak:  # with what was just written
            self.stats.kv_bytes_peak = self.pool.in_use * self.kv.bytes_per_page
            self.stats.kv_slots_at_peak = self.pool.in_use * self.ps
            self.stats.kv_tokens_at_peak = self._tokens_held()
        for i, (e, toks, lps, reason) in enumerate(zip(rows, out.tokens, out.logprobs, out.finish_reason)):
            turn = self.turn[e]
            turn.tokens.extend(toks)
            turn.logprobs.extend(float(x) for x in lps)
            self.stats.generated_tokens += len(toks)
            if reason == "length" and len(turn.tokens) < turn.limit:
                reason = PAUSED   # the burst ended, not the turn
            if reason != PAUSED:
                del self.turn[e]
                self._end_turn(e, turn)

    def _tokens_held(self) -> int:
        """Tokens whose K/V the pages in use hold (a page shared by several episodes counted once,
        a page reserved for tokens not written yet not at all)."""
        filled: dict[int, int] = {}
        for s in self.seq.values():
            for j, page in enumerate(s.pages):
                filled[page] = max(filled.get(page, 0), min(self.ps, max(0, s.cached - j * self.ps)))
        return sum(filled.values())

    def _preempt(self, e: int) -> None:
        """Episode e gives its pages back and waits to be admitted again (its turn kept)."""
        s = self.seq[e]
        self.pool.release(s.pages)
        self.pool.forget_promises(e)
        s.pages, s.cached, s.registered = [], 0, 0
        self.running.discard(e)
        self.following.discard(e)
        heapq.heappush(self.waiting, e)
        self.stats.preemptions += 1

    # ----------------------------------------------------------------------- one episode's steps

    def _begin_turn(self, e: int) -> None:
        ep = self.episodes[e]
        limit = rules.turn_limit(self.cfg, ep)
        if limit <= 0:
            ep.finish_reason = FINISH_BUDGET
            self._finish(e)
        else:
            self.turn[e] = rules.OpenTurn(limit)

    def _end_turn(self, e: int, turn: rules.OpenTurn) -> None:
        kind, what = rules.end_turn(self.cfg, self.env, self.episodes[e], turn.tokens, turn.logprobs)
        if kind == "finish":
            self._finish(e)
        elif kind == "call":
            self.calls[self.threads.submit(self._timed_call, what)] = (e, time.perf_counter())
        else:
            self._observe(e, what, None)

    def _timed_call(self, call: tuple[str, str]) -> tuple[str, str | None]:
        """`execute_one` on a worker thread, its span kept for `RolloutStats.seconds_calls`."""
        start = time.perf_counter()
        try:
            return execute_one(self.env, call)
        finally:
            self.call_spans.append((start, time.perf_counter()))  # list.append is atomic

    def _observe(self, e: int, text: str, error_kind: str | None) -> None:
        ids = rules.observe(self.cfg, self.env, self.episodes[e], text, error_kind)
        if ids is None:
            self._finish(e)
            return
        self.seq[e].tokens.extend(int(t) for t in ids)
        self._begin_turn(e)

    def _finish(self, e: int) -> None:
        """The episode in row e has its finish_reason: it leaves."""
        s = self.seq.pop(e)
        self.pool.release(s.pages)
        self.pool.forget_promises(e)
        self.running.discard(e)
        self.following.discard(e)
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished, len(self.episodes))

