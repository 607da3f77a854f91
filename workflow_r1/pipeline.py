"""Asynchronous training's rollout side: batches rolled out ahead of the learner, each by a policy
at most `train.max_staleness` (k) versions older than the one it trains.

Version v is the policy after v updates (version 0: the initial weights); step t trains on its
batch and makes version t. A synchronous run (k = 0) rolls out step t's batch with version t - 1.
With k >= 1 the batch of step t is rolled out, every turn of it, by version

    b(t) = max(0, t - 1 - k)                                          `behaviour_version`

so its rollout can run while the updates t - k .. t - 1 do. `RolloutPipeline` is that rollout: a
thread that rolls the steps out in order, each as soon as its version exists, while the trainer's
thread updates. A token of step t's batch is (t - 1) - b(t) <= k versions older than the weights
it trains (its staleness); the learner corrects for the gap: it recomputes the proximal log-probs
(version t - 1) and weights each unit of the loss by the capped ratio of those to the recorded
behaviour log-probs (rl/losses.py, `behaviour_cap`; docs/paper.md).

Partial rollouts (`train.partial_rollouts`): the batch of step t is rolled out by b(t) in its
episodes' first turns and by newer versions in their later ones, turn j by

    min(t - 1, b(t) + j)                                              `turn_versions`

so an episode in flight when an update ends continues with that update's weights at its next turn
(the engine waits for them if they do not exist yet), and its turns from turn k on are on-policy.
Which turn reads which weights is fixed by the step and the turn's index, never by which update
ended before which tool call returned (wall-clock timing): the run is reproducible and its resume
exact, either way. `Versions` holds the parameters every batch not yet trained on reads, the
checkpoint saves them, and a restarted run rolls the batches ahead of its checkpoint out again
from the same questions, seeds and versions (docs/design.md, Asynchronous training).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from workflow_r1 import preemption


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version that rolls out step `step`'s batch (steps count from 1): step - 1 when
    `max_staleness` is 0, else max(0, step - 1 - max_staleness)."""
    return max(0, step - 1 - max_staleness)


def turn_versions(step: int, max_staleness: int, partial: bool) -> tuple[int, int]:
    """(first, last): the versions of step `step`'s turns are b(step) for every turn (last = first),
    or (partial) turn j's min(last, first + j) with last = step - 1 (rollout/versions.py)."""
    first = behaviour_version(step, max_staleness)
    return first, step - 1 if partial else first


def versions_ahead(step: int, max_staleness: int) -> list[int]:
    """The versions the batches after step `step` read that the train state of step `step` is not:
    what a checkpoint of that step saves beside it, ascending (empty when max_staleness is 0)."""
    return sorted({behaviour_version(t, max_staleness) for t in range(step + 1, step + max_staleness + 1)}
                  - {step})


class Versions:
    """The parameters of the policy versions that batches not yet trained on read.

    `publish(v, params)` stores a copy (the learner's own arrays are donated to its next update),
    and the sampler's weights of it when given (`sampler_weights`: made on several hosts by the
    trainer's thread, where the gather they need runs in every host's order); `wait(v)` blocks
    until version v is stored; `keep_from(v)` drops the older ones. Thread-safe: the learner
    publishes, the rollout thread reads."""

    def __init__(self) -> None:
        self._params: dict[int, Any] = {}
        self._weights: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._closed = False

    def publish(self, version: int, params: Any, copy: bool = True, sampler_weights: Any = None) -> None:
        if copy:
            params = jax.tree.map(jnp.copy, params)
        with self._cond:
            self._params[version] = params
            if sampler_weights is not None:
                self._weights[version] = sampler_weights
            self._cond.notify_all()

    def sampler_weights(self, version: int) -> Any:
        """The sampler's weights of a stored version, None when none were published with it."""
        with self._cond:
            return self._weights.get(version)

    def wait(self, version: int) -> bool:
        """Blocks until version `version` is stored (True) or the store is closed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: version in self._params or self._closed)
            return not self._closed

    def get(self, versions: list[int]) -> dict[int, Any]:
        """{version: parameters} of `versions`, every one stored (KeyError otherwise)."""
        with self._cond:
            return {v: self._params[v] for v in versions}

    def keep_from(self, version: int) -> None:
        with self._cond:
            for v in [v for v in self._params if v < version]:
                del self._params[v]
                self._weights.pop(v, None)

    def close(self) -> None:
        """Ends every wait (they return False); the stored versions stay for a last checkpoint."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._params.clear()
            self._weights.clear()


@dataclasses.dataclass
class Rollout:
    """One step's batch as the rollout thread made it.

    step, version: the step it trains and the policy version that rolled out its first turns.
    epoch: the data iterator's epoch after its questions were drawn; questions: this host's share.
    episodes, stats: the engine's result (None when abandoned or failed).
    abandoned: a preemption notice stopped it; error: what else did.
    wait_s: seconds the thread waited for its version before starting it.
    """

    step: int
    version: int
    epoch: int
    questions: list = dataclasses.field(default_factory=list)
    episodes: list | None = None
    stats: Any = None
    abandoned: bool = False
    error: BaseException | None = None
    wait_s: float = 0.0


class RolloutPipeline:
    """Rolls out steps first_step .. last_step in a thread, step t with version b(t).

    Args:
      first_step, last_step: the steps to roll out (a resumed run starts after its checkpoint).
      max_staleness: k >= 1.
      partial: partial rollouts (`turn_versions`): a batch's later turns by newer versions.
      versions: where the learner publishes each version (and a resume, the saved ones).
      data: the run's question iterator, positioned at first_step's batch; only this thread draws.
      roll_out: (questions, step, first, last, load) -> (episodes, stats): turn j by version
        min(last, first + j), the sampler holding `first`; load(v) puts version v into it (waiting
        for it). Raises preemption.Preempted to abandon.
      use_version: (parameters, sampler weights or None) -> None: puts a version into the sampler
        (the weights `Versions` holds for it, when it holds them, else its parameters).

    The trainer calls `take(t)` for each step in order, `position(t)` for what its checkpoints
    save, and borrows the sampler between two rollouts with `sampler()` (its evaluation).
    """

    def __init__(self, *, first_step: int, last_step: int, max_staleness: int, versions: Versions, data: Any,
                 roll_out: Callable[[list, int, int, int, Callable[[int], None]], tuple[list, Any]],
                 use_version: Callable[[Any, Any], None],
                 partial: bool = False):
        if max_staleness < 1:
            raise ValueError(f"RolloutPipeline needs max_staleness >= 1, got {max_staleness}")
        self.first, self.last, self.k, self.partial = first_step, last_step, max_staleness, partial
        self.versions, self.data = versions, data
        self._roll_out, self._use_version = roll_out, use_version
        self._cond = threading.Condition()
        self._done: dict[int, Rollout] = {}
        self._positions: dict[int, Any] = {}
        self._sampler_lock = threading.Lock()
        # Device work takes turns: the engine's calls (`serialized`) and the trainer's sections.
        self.device = threading.RLock()
        self._current: int | None = None  # the version the sampler holds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-pipeline", daemon=True)

    def start(self) -> "RolloutPipeline":
        self._thread.start()
        return self

    def _run(self) -> None:
        step = self.first
        try:
            for step in range(self.first, self.last + 1):
                first, last = turn_versions(step, self.k, self.partial)
                t0 = time.perf_counter()
                if not self.versions.wait(first) or self._stopped.is_set():
                    return
                item = self._draw(step, first)
                item.wait_s = time.perf_counter() - t0
                try:
                    with self._sampler_lock:
                        if self._current != first:
                            self._load(first)
                        item.episodes, item.stats = self._roll_out(item.questions, step, first, last, self._load)
                except preemption.Preempted:
                    item.abandoned = True
                except BaseException as e:  # the trainer's thread re-raises it
                    item.error = e
                with self._cond:
                    self._done[step] = item
                    self._cond.notify_all()
                if item.abandoned or item.error is not None:
                    return
            step = self.last + 1
        finally:
            with self._cond:  # where a checkpoint of the last step rolled out resumes the data
                self._positions.setdefault(step, self.data.get_state())
                self._stopped.set()
                self._cond.notify_all()

    def _load(self, version: int) -> None:
        """The sampler on version `version` (the rollout thread, holding the sampler), once it exists;
        raises preemption.Preempted when the pipeline stops first."""
        if not self.versions.wait(version) or self._stopped.is_set():
            raise preemption.Preempted
        params = self.versions.get([version])[version]
        with self.device:
            self._use_version(params, self.versions.sampler_weights(version))
        self._current = version

    def _draw(self, step: int, version: int) -> Rollout:
        with self._cond:
            self._positions[step] = self.data.get_state()
            questions = self.data.next()
            self._cond.notify_all()
        return Rollout(step=step, version=version, epoch=self.data.epoch, questions=questions)

    def take(self, step: int) -> tuple[Rollout, float]:
        """Step `step`'s rollout, waiting for it; returns it and the seconds waited. Raises the
        rollout's error; a rollout the thread never made (it stopped first) comes back abandoned."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: step in self._done or self._stopped.is_set())
            item = self._done.pop(step, None)
        waited = time.perf_counter() - t0
        if item is None:
            item = Rollout(step=step, version=behaviour_version(step, self.k), epoch=0, abandoned=True)
        if item.error is not None:
            raise item.error
        return item, waited

    def position(self, step: int) -> Any:
        """The data iterator's state before step `step`'s questions (what a checkpoint of step - 1
        resumes from), waiting until the thread has drawn them or stopped before."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._positions or self._stopped.is_set())
            # A stopped thread has recorded the step it would have drawn next: every step up to it.
            return self._positions[step]

    def serialized(self, policy: Any) -> "Serialized":
        """`policy` (the engine's `Policy`) with each call under `device`."""
        return Serialized(policy, self.device)

    @contextlib.contextmanager
    def sampler(self) -> Iterator[None]:
        """Borrows the sampler between two rollouts (its weights are then the borrower's to set)."""
        with self._sampler_lock:
            self._current = None
            yield

    def stop(self) -> None:
        """Ends the thread: a rollout in flight is abandoned at its next progress report (the
        trainer's `roll_out` raises Preempted once `stopping` is set), a wait for a version ends."""
        self._stopped.set()
        self.versions.close()
        if self._thread.ident is not None:  # started
            self._thread.join()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()


class Serialized:
    """The engine's policy with every call under a lock the trainer's device work also takes.

    Why: a program with collectives (a tensor-parallel decode, the update's all-reduces) runs on
    every chip of its mesh in the order the chips received it. Two threads launching such programs
    at once can hand them to two chips in opposite orders, and each chip then waits in a collective
    for the other: a hang on GPU and TPU, an abort on the CPU client. Taking turns per call keeps
    one order; the engine's host work and its waits for tool calls still overlap the update.
    """

    def __init__(self, policy: Any, lock: threading.RLock):
        self.policy, self.lock = policy, lock

    def new_pages(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.policy.new_pages(*args, **kwargs)

    def generate_paged(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.policy.generate_paged(*args, **kwargs)

    def step_paged(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.policy.step_paged(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the rest of the sampler's interface, as it is
        return getattr(self.policy, name)


def staleness_metrics(item: Rollout, step: int, max_staleness: int,
                      gather: Callable[[Any], list] = lambda x: [x]) -> dict[str, float]:
    """The `async/` metrics of step `step`'s batch: the version of its first turns; the staleness
    of its generated tokens ((step - 1) - the version of their turn) as their mean and as a
    histogram (`staleness_tokens/<d>`, tokens at staleness d for d = 0..max_staleness); the
    distinct versions per episode (mean); and the seconds this host's rollout thread waited for
    the first version before starting. gather: a value from every host
    (`sharding.allgather_objects`), so the counts are of every host's episodes."""
    tokens: dict[int, int] = dict.fromkeys(range(max_staleness + 1), 0)
    versions = 0
    for e in item.episodes:
        for v, n in e.tokens_by_version().items():
            tokens[step - 1 - v] = tokens.get(step - 1 - v, 0) + n
        versions += len({t.policy_version for t in e.turns})
    hosts = gather((tokens, versions, len(item.episodes)))
    total = {d: sum(h[0].get(d, 0) for h in hosts) for d in tokens}
    generated = sum(total.values())
    return {"async/behaviour_version": item.version,
            "async/staleness": sum(d * n for d, n in total.items()) / max(generated, 1),
            **{f"async/staleness_tokens/{d}": n for d, n in total.items()},
            "async/versions_per_episode": sum(h[1] for h in hosts) / max(sum(h[2] for h in hosts), 1),
            "time/rollout_wait_s": item.wait_s}


__all__ = ["Rollout", "RolloutPipeline", "Serialized", "Versions", "behaviour_version", "staleness_metrics",
           "turn_versions", "versions_ahead"]
