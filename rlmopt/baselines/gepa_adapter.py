"""GEPA (the `gepa` package, 0.1.4) as a baseline over the rlmopt harness.

`HarnessAdapter` implements gepa's adapter protocol (`evaluate`, `make_reflective_dataset`) on
`Harness.evaluate`, so GEPA sees the same task, splits (its trainset is our train split, its
valset our validation split), task LM, reply cache and scoring as rlmopt; the test split never
reaches it. The reflection LM is a plain callable (prompt -> text) over any rlmopt LM, metered as
the "optimizer" role. `search` runs `gepa.optimize` in a worker thread and leaves GEPA's best
candidate as the harness's claimed best, so `selection.finalize` (polish off) and
`record.build_record` treat both methods alike: the pool is {seed, GEPA's best}, picked on
validation, scored once on test. A task with `gepa_components` (BFCL multi-turn: the system
prompt) shows GEPA only those components as its candidate; the others stay the seed's in every
evaluation (the wrapper the RLMOpt paper describes for its agentic task).

Budget. GEPA counts metric calls (one per candidate-example evaluation, cached or not); rlmopt
counts rollouts (uncached task-LM calls on validation during the search). We report both:
`rollouts_used` is the uncached task-LM calls GEPA's search made (train minibatches included; the
seed's validation pass, done first, is free for both methods), and `extra.gepa` has the metric
calls it used and its limit, either its native `auto="light"` budget (`auto_budget`, the formula
DSPy uses to size GEPA runs) or matched to ours (B + |val|, since GEPA's first full validation of
the seed is part of its metric calls but not of our budget).
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Callable, Mapping, Sequence

from rlmopt.harness import Harness
from rlmopt.lm import MeteredLM
from rlmopt.task import Example

GEPA_FILE = "gepa.json"  # the search's accounting, in the run directory
LIGHT_CANDIDATES = 6  # DSPy's auto="light" preset (medium 12, heavy 18)
_OUTPUT_CHARS = 1500  # of a reply shown to the reflection LM per example


def auto_budget(num_components: int, valset_size: int, num_candidates: int = LIGHT_CANDIDATES,
                minibatch_size: int = 35, full_eval_steps: int = 5) -> int:
    """GEPA's native auto budget in metric calls: N = max(4 c log2 k, 1.5 k) trials
    (c components, k candidates), each a minibatch of `minibatch_size`, plus a full validation of
    the seed, 5 bootstrap calls per candidate, and a full validation every `full_eval_steps`
    trials (+1 at the end, +1 more when N < full_eval_steps)."""
    trials = int(max(2 * (num_components * 2) * math.log2(num_candidates), 1.5 * num_candidates))
    total = valset_size + num_candidates * 5 + trials * minibatch_size
    if trials == 0:
        return total
    fulls = (trials + 1) // full_eval_steps + 1 + (1 if trials < full_eval_steps else 0)
    return total + fulls * valset_size


def gepa_seed(h: Harness) -> dict[str, str]:
    """The candidate GEPA sees: the seed's components the task exposes (`gepa_components`), or all."""
    names = getattr(h.task, "gepa_components", None) or list(h.seed)
    return {k: h.seed[k] for k in names}


def metric_call_limit(h: Harness, mode: str) -> int:
    """GEPA's max_metric_calls: `light` (native) or `matched` (our budget + one validation pass)."""
    if mode == "light":
        return auto_budget(len(gepa_seed(h)), len(h.splits.val))
    if mode == "matched":
        return h.config.budget + len(h.splits.val)
    raise ValueError(f"gepa_budget {mode!r}; use matched or light")


class HarnessAdapter:
    """gepa's GEPAAdapter over a Harness. `loop` is the event loop the harness runs on (GEPA calls
    the adapter from a worker thread)."""

    propose_new_texts = None  # gepa's default reflective proposer

    def __init__(self, h: Harness, loop: asyncio.AbstractEventLoop):
        self.h, self.loop = h, loop
        self.calls = 0

    def _await(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def evaluate(self, batch: list[Example], candidate: dict[str, str],
                 capture_traces: bool = False) -> Any:
        from gepa import EvaluationBatch

        cid = self.h.register({**self.h.seed, **{k: str(v) for k, v in candidate.items()}})
        ids = [e.id for e in batch]
        ev, calls = self._await(self.h.evaluate(cid, ids))
        self.calls += calls
        self.h.state.rollouts_used += calls
        self.h.state.history.append({"event": "gepa_eval", "candidate": cid, "n": len(ids),
                                     "charged": calls, "composite": ev.composite,
                                     "fields": ev.fields})
        self.h.save()
        traces = [self.h.trace(cid, i) for i in ids]
        return EvaluationBatch(outputs=[t["prediction"] for t in traces], scores=ev.composites,
                               trajectories=traces if capture_traces else None)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any,
                                components_to_update: list[str],
                                ) -> Mapping[str, Sequence[Mapping[str, Any]]]:
        """Per component, one record per example: its inputs, the task LM's reply (cut) and
        feedback naming each field's score and the gold values."""
        weights = self.h.task.weights
        records = []
        for t, score in zip(eval_batch.trajectories or [], eval_batch.scores):
            fields = ", ".join(f"{f}={t['scores'][f]:.2f}" for f in weights)
            feedback = (f"Score {score:.2f} ({fields}). Expected: "
                        f"{json.dumps(t['expected'], ensure_ascii=False)[:500]}")
            records.append({"Inputs": dict(t["inputs"]),
                            "Generated Outputs": t["reply"][:_OUTPUT_CHARS],
                            "Feedback": feedback})
        return {c: records for c in components_to_update}


class _Logger:
    """Keeps gepa's per-iteration log lines (it prints them otherwise)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(str(message))


async def search(h: Harness, reflection_lm: Any, *, mode: str = "matched",
                 minibatch_size: int = 3, log: Callable[[str], None] = print) -> dict:
    """Runs GEPA on `h` (its seed, train and validation splits) with `reflection_lm` (an rlmopt LM:
    `await lm.complete(prompt, max_tokens)`), sets GEPA's best candidate as the harness's claimed
    best, and returns GEPA's accounting for `record.json` (extra.gepa)."""
    import gepa

    await h.evaluate_seed()
    loop = asyncio.get_running_loop()
    adapter = HarnessAdapter(h, loop)
    metered = MeteredLM(reflection_lm, h.meter, "optimizer")

    def reflect(prompt: Any) -> str:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        return adapter._await(metered.complete(text, h.config.optimizer_max_tokens)).text

    limit = metric_call_limit(h, mode)
    logger = _Logger()
    log(f"gepa: max_metric_calls {limit} ({mode}; native light budget "
        f"{auto_budget(len(gepa_seed(h)), len(h.splits.val))})")
    result = await asyncio.to_thread(
        gepa.optimize, seed_candidate=gepa_seed(h), trainset=list(h.splits.train),
        valset=list(h.splits.val), adapter=adapter, reflection_lm=reflect,
        max_metric_calls=limit, reflection_minibatch_size=minibatch_size, seed=h.config.seed,
        logger=logger, display_progress_bar=False, raise_on_exception=True)
    h.state.claimed_id = h.register({**h.seed, **dict(result.best_candidate)})
    h.save()
    info = {"budget_mode": mode, "max_metric_calls": limit,
            "native_light_metric_calls": auto_budget(len(gepa_seed(h)), len(h.splits.val)),
            "components": list(gepa_seed(h)),
            "metric_calls": result.total_metric_calls, "candidates": result.num_candidates,
            "task_lm_calls": adapter.calls, "log_tail": logger.lines[-5:]}
    if h.run_dir is not None:  # a resumed run past its search reads it back (run.optimise)
        (h.run_dir / GEPA_FILE).write_text(json.dumps(info, indent=1))
    log(f"gepa: {result.num_candidates} candidates, {result.total_metric_calls} metric calls, "
        f"{adapter.calls} task-LM calls")
    return info
