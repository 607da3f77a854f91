"""The training loop's cadence: data -> rollout -> learner -> sampler weights -> eval / checkpoint / metrics.

One step (docs/design.md, Data flow):

    questions = data.next()                                this host's share of prompts_per_step
    episodes  = engine.run(questions)                      the sampler on the current params, the environment
    selection = learner.select(rewards)                    ... refills while selection.wants_refill()
    batch     = learner.prepare(pack(episodes), selection) advantages, the group filter, sharded rows
    learner.update(batch)                                  KL reference log-probs, M updates (rl/learner.py)
    sampler.update_params(state.model())                   on device, no host copy (LoRA: merged)

`run_config.Run.from_config` turns the config (configs/*.py) into typed sections and checks them
together before any work; `envs.make(run)` gives the questions, the initial policy and the
environment of `env.kind`; `Trainer` owns the learner, the sampler, the engine and the writers;
`Trainer.train` loops and resumes from the newest checkpoint in its work directory; a preemption
notice (SIGTERM, preemption.py) stops it at the next safe point with the run saved (`preempted`).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from workflow_r1 import checkpointing, envs, host_memory, memory_fit, preemption, sharding, storage
from workflow_r1 import metrics as metrics_lib
from workflow_r1.data.iterator import QuestionIterator
from workflow_r1.eval import evaluate
from workflow_r1.metrics import MetricWriter, drop_step_files, format_summary
from workflow_r1.pipeline import RolloutPipeline, Versions, behaviour_version, staleness_metrics, versions_ahead
from workflow_r1.rl import train_state
from workflow_r1.rl.learner import Learner
from workflow_r1.rollout import RolloutEngine, RolloutStats, TurnVersions, pack, padded_length, step_metrics
from workflow_r1.run_config import Run
from workflow_r1.sampler import Sampler
from workflow_r1.trajectory import TrainBatch

log = logging.getLogger(__name__)
# A step's refill batches sample with seeds this far apart from its own (and every other step's).
REFILL_SEED = 7_777_777


class Trainer:
    """Builds everything a run needs from a `Run` and trains (`train`)."""

    def __init__(self, run: Run, workdir: storage.PathLike):
        # A local directory or a URI (gs://...): every output goes through `storage` paths.
        self.run, self.workdir = run, storage.path(workdir)
        self.primary = jax.process_index() == 0
        seed = run.run.seed
        self.mesh, rollout_mesh = sharding.make_meshes(run.mesh, sampler_tensor=run.rollout.tensor_parallel)
        self.setup = envs.make(run)  # env.kind: questions, the initial policy, the environment
        # Data first: a bad file fails before a model is loaded.
        self.train_questions, self.eval_questions = self.setup.questions()
        model, self.tokenizer = self.setup.policy(self.mesh)
        self.source_dir = self.setup.source_dir()
        self.pad_id = model.cfg.pad_token_id if self.tokenizer is None else self.tokenizer.pad_token_id
        self.learner = Learner(model, run.train, self.mesh)
        self.num_params = sum(x.size for x in jax.tree.leaves(self.state.weights()))  # for MFU
        # Before the executor starts or any rollout (host 0 writes the export).
        checkpointing.check_room_for_run(self.state, self.workdir / "checkpoints",
                                         export=run.checkpoint.export_hf and self.primary,
                                         export_dtype=run.checkpoint.export_dtype_for(run.model.dtype))
        # The sampler works from a copy of the globally sharded weights on the rollout mesh.
        self.sampler = Sampler(self.state.model(), self.tokenizer, cache_size=run.rollout.cache_size,
                               mesh=rollout_mesh, dtype=run.rollout.sampler_dtype or None,
                               weights_dtype=run.rollout.weights_dtype or None,
                               paged_attention=run.rollout.paged_attention,
                               ragged=run.rollout.max_tokens_per_step > 0)
        host_memory.release_freed()  # the loader's tensors, before the embedded executor loads its model
        # Before the executor starts or any rollout: a KV page pool no device can hold is one line now.
        memory_fit.check_rollouts(run.rollout, self.sampler, eval_rows=run.eval.batch_size, train_rows=-(
            -run.rollout.prompts_per_step // jax.process_count()) * run.rollout.n)
        self.engine = RolloutEngine(self.sampler, run.rollout, self.setup.environment(self.tokenizer))
        self.train_questions, self.eval_questions = (
            envs.fitting(qs, self.engine.encode_prompt, self.tokenizer, run.rollout.max_prompt_tokens, what)
            for qs, what in ((self.train_questions, "training"), (self.eval_questions, "evaluation")))
        self.data = QuestionIterator(self.train_questions, run.rollout.prompts_per_step, seed=seed,
                                     shuffle=run.data.shuffle, process_index=jax.process_index(),
                                     process_count=jax.process_count())
        self.total_steps = run.run.steps or run.run.epochs * self.data.steps_per_epoch
        self.checkpointer = checkpointing.Checkpointer(self.workdir / "checkpoints", run.checkpoint)
        self.watch = preemption.Watch()  # SIGTERM is caught while `train` runs
        self.preempted: str | None = None  # the line saying where a preempted run stopped, once it has
        self.step = 0
        # Asynchronous training (train.max_staleness = k >= 1): the policy versions batches not yet
        # trained on are rolled out by, and the thread rolling them out while `train` runs.
        self.max_staleness = run.train.max_staleness
        self.versions = Versions()
        self.pipeline: RolloutPipeline | None = None
        latest = self.checkpointer.latest_step()
        if latest is not None:
            self.state, extra, behaviour = self.checkpointer.restore_with_versions(
                self.state, latest, versions_ahead(latest, self.max_staleness))
            self.data.set_state(extra["data"])
            self.step = int(extra["step"])
            self.sampler.update_params(self.state.model())
            for v, params in behaviour.items():
                self._publish(v, params, copy=False)
            log.info("resumed from %s at step %d", self.checkpointer.directory / str(latest), self.step)
        # Whatever a killed run wrote past its newest checkpoint (a step whose save never finished, or
        # everything when none did) is rewritten from here on: one record per step (steps start at 0).
        first = self.step + 1 if self.step else 0
        self.writer = MetricWriter(self.workdir, tensorboard=run.run.tensorboard, resume_from=first,
                                   wandb_project=run.run.wandb_project, wandb_mode=run.run.wandb_mode,
                                   config=run.raw.to_dict())
        if self.primary:
            for name in ("trajectories", "eval"):
                drop_step_files(self.workdir / name, first)
            storage.write_text(self.workdir / "config.json", json.dumps(run.raw.to_dict(), indent=2, default=str))

    # ------------------------------------------------------------------------------------ one step

    def rollout_batch(self, questions: list, step: int) -> tuple[list, dict[str, float], TrainBatch | None]:
        """Rolls out this host's questions; returns (episodes, metrics, the sharded batch).

        The learner selects the groups (rl/dynamic_sampling.py): with `train.filter_groups` the batch
        holds only the groups whose rewards differ (None when no host kept one: the step skips its
        update); with `train.refill_rounds` > 0 the next questions are rolled out while it asks for
        more, and the episodes and metrics are then those of every batch rolled out this step."""
        episodes, stats = self._roll_out(questions, step, 0)
        selection = self.learner.select([e.reward for e in episodes], group_size=self.run.rollout.n,
                                        wanted=len(questions))
        while selection.wants_refill():
            more, more_stats = self._roll_out(self.data.next(), step, selection.refills + 1)
            selection.add([e.reward for e in more])
            episodes, stats = episodes + more, stats + more_stats
        return episodes, *self._prepare(episodes, stats, selection)

    def _prepare(self, episodes: list, stats: RolloutStats, selection: Any) -> tuple[dict[str, float], TrainBatch | None]:
        """(the step's rollout metrics, the learner's sharded batch) of every episode rolled out."""
        r = self.run.rollout
        # One global batch: every host pads to the longest row anywhere.
        length = max(sharding.allgather_objects(padded_length(episodes, r.pad_multiple)))
        batch, prepared = self.learner.prepare(pack(episodes, pad_id=self.pad_id, length=length), selection)
        # Every host's episodes and cache work count (timings, throughput and rounds are this host's own).
        metrics = {**step_metrics(episodes, stats, sharding.allgather_objects), "rollout/batch_length": length,
                   **prepared}
        return metrics, batch

    def _roll_out(self, questions: list, step: int, refill: int) -> tuple[list, RolloutStats]:
        """`_engine_run`, then the safe point every host reaches after each rollout (a collective;
        a host that abandoned its rollout is asked too). Raises preemption.Preempted when the run
        stops there."""
        abandoned = False
        try:
            episodes, stats = self._engine_run(questions, step, refill)
        except preemption.Preempted:
            abandoned = True  # the restart rolls this step out again
        if self.watch.reached() or abandoned:
            raise preemption.Preempted
        return episodes, stats

    def _engine_run(self, questions: list, step: int, refill: int = 0, versions: TurnVersions | None = None,
                    stop: Callable[[], bool] = lambda: False) -> tuple[list, RolloutStats]:
        """The engine's episodes of this host's `questions` and its stats, on this host alone (no
        collective: the asynchronous pipeline's thread calls it too); `refill` > 0: the step's
        refill batch of that number, sampled with its own seed; `versions`: the policy versions of
        its turns (default step - 1, a synchronous run's, the one the sampler holds). Raises
        preemption.Preempted when this host has a notice (or `stop()`), after the current round."""
        r = self.run.rollout
        bar = self.writer.progress(len(questions) * r.n, f"step {step} rollout" + (f" refill {refill}" * bool(refill)))
        seed = self.run.run.seed * 1_000_003 + step + REFILL_SEED * refill
        # Rows are numbered globally (host h holds rows [h*B/P, (h+1)*B/P)), so each samples what one
        # process rolling out the whole batch would.
        offset = jax.process_index() * len(questions) * r.n

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)
            if self.watch.requested() or stop():
                raise preemption.Preempted

        with bar:
            episodes, stats = self.engine.run(questions, seed=seed, row_offset=offset, progress=progress,
                                              versions=versions or TurnVersions(step - 1))
        return list(episodes), stats

    def update(self, batch: TrainBatch | None, step: int | None = None, sync_sampler: bool = True) -> dict[str, float]:
        """The learner's update (KL reference log-probs, M mini-batch updates), then (sync_sampler)
        the sampler on the new weights. None (train.filter_groups kept no group): no update, the
        step still counts. An asynchronous run's sampler is the pipeline's (sync_sampler False)."""
        if batch is None:
            return {"train/updates": int(self.state.step)}
        if sync_sampler:
            self.sampler.release_params()  # its copy of the weights is stale after the update anyway
        metrics = self.learner.update(batch, step)
        metrics["memory/peak_rss_gb"] = host_memory.peak_rss_gb()
        metrics.update(metrics_lib.update_throughput(int(np.prod(batch.tokens.shape)), metrics["time/update_s"],
                                                     self.num_params, jax.devices()))
        metrics.update(metrics_lib.device_memory(jax.local_devices()))
        if sync_sampler:
            self.sampler.update_params(self.state.model())  # LoRA: the merged weights
            metrics["time/weight_sync_s"] = self.sampler.sync_seconds
        return metrics

    @property
    def state(self) -> train_state.TrainState:
        """The policy's train state (parameters, optimizer state, update count), held by the learner."""
        return self.learner.state

    @state.setter
    def state(self, value: train_state.TrainState) -> None:
        self.learner.state = value

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy evaluation on the evaluation questions; writes their episodes to eval/step_N.jsonl."""
        questions = self.eval_questions
        if self.run.eval.max_questions:
            questions = questions[:self.run.eval.max_questions]
        if not questions:
            return {}
        bar = self.writer.progress(len(questions), f"step {step} eval")
        with bar:
            result = evaluate(self.engine, questions, batch_size=self.run.eval.batch_size,
                              progress=lambda done, em: (bar.update(done - bar.n), bar.set_postfix(em=f"{em:.3f}")))
        if self.primary:
            metrics_lib.write_step_rows(self.workdir / "eval", step, [e.summary() for e in result.episodes])
        out = result.flat("eval/")
        out["time/eval_s"] = result.seconds
        return out

    def save(self, step: int, force: bool = False) -> None:
        """Checkpoint `step` (when due, or `force`): the train state, where the data resumes and, in
        an asynchronous run, the policy versions the next batches are rolled out by."""
        if not (force or self.checkpointer.should_save(step)):
            return
        pipe, behaviour = self.pipeline, None
        data = self.data.get_state() if pipe is None else pipe.position(step + 1)
        if pipe is not None:
            behaviour = self.versions.get(versions_ahead(step, pipe.k))
        extra = {"step": step, "data": data, "seed": self.run.run.seed,
                 "config": json.loads(json.dumps(self.run.raw.to_dict(), default=str))}
        self.checkpointer.save(step, self.state, extra, force=force, behaviour=behaviour)

    def _log_trajectories(self, step: int, episodes: list) -> None:
        """The global batch's first `run.log_trajectories` episodes (-1: all) to trajectories/step_N.jsonl."""
        k = self.run.run.log_trajectories
        if k:  # every host sends its first k (host order is row order); host 0 writes
            first = slice(None if k < 0 else k)
            rows = [r for host in sharding.allgather_objects([e.summary() for e in episodes[first]]) for r in host]
            if self.primary:
                metrics_lib.write_step_rows(self.workdir / "trajectories", step, rows[first])

    # ------------------------------------------------------------------------------------ the loop

    # The untrained policy's evaluation (`eval.at_start`), once `train` has run it; else empty.
    eval_at_start: dict[str, float] = {}

    def train(self) -> dict[str, float]:
        """Runs the remaining steps; returns the last step's metrics (plus the final evaluation).

        A preemption notice stops it at the next safe point, sets `preempted` and returns: during a
        rollout the step is abandoned and the one before it saved (the restart rolls the step out
        again: its sampling seeds depend only on the run's seed and the step); during the update or
        what follows it the step is finished (its evaluation too, when due) and saved."""
        with self.watch:
            return self._train()

    def _train(self) -> dict[str, float]:
        ev, last = self.run.eval, {}
        if self.step == 0 and ev.at_start:
            self.eval_at_start = self.evaluate(0)
            host_memory.release_freed()
            self.writer.write(0, self.eval_at_start)
        if self.max_staleness:
            return self._train_async()
        while self.step < self.total_steps:
            step = self.step + 1
            t0 = time.perf_counter()
            position = self.data.get_state()
            questions = self.data.next()
            with metrics_lib.profile_trace(self.workdir / "profile", step in self.run.run.profiled):
                try:
                    episodes, metrics, batch = self.rollout_batch(questions, step)
                except preemption.Preempted:
                    self.data.set_state(position)  # the restart draws this step's questions (and refills) again
                    if self.step:  # (a no-op when it is on disk already)
                        self.save(self.step, force=True)
                    self.preempted = preemption.stop_line(self.watch.name(), step, self.step, self.checkpointer.directory)
                    return last
                host_memory.release_freed()  # each phase frees what the next cannot reuse (host_memory.py)
                with self.writer.progress(None, f"step {step} update"):
                    metrics.update(self.update(batch, step))
                host_memory.release_freed()
            self.step = step
            self._log_trajectories(step, episodes)
            final = step == self.total_steps
            if (ev.every_steps and step % ev.every_steps == 0) or final:
                metrics.update(self.evaluate(step))
                host_memory.release_freed()
            if final:  # the rollout side is done: free its memory before the last save and the export
                self.release_rollout()
            self.save(step, force=final)
            last = self._log_step(step, metrics, t0, len(episodes), self.data.epoch)
            if not final and self.watch.reached():  # after the update, its evaluation and save
                self.save(step, force=True)
                self.preempted = preemption.stop_line(self.watch.name(), step, step, self.checkpointer.directory)
                return last
        return last

    def _train_async(self) -> dict[str, float]:
        """`_train` with the rollouts in the pipeline's thread (pipeline.py): step t's batch, rolled out
        by version max(0, t - 1 - k) (its later turns by newer ones, with train.partial_rollouts),
        is taken when ready, trained on, and version t published for the batches after it.
        Evaluation borrows the sampler between two rollouts. A notice
        stops it at the same safe points as `_train`: waiting for a batch (the step is abandoned and
        the one before it saved) or after an update (the step finished and saved); the batches
        ahead are rolled out again on restart from the saved versions.

        The trainer's device work (the safe points' all-gathers, the batch, the update, the
        checkpoint) runs under `pipeline.device`, between two of the engine's calls: programs with
        collectives launched from two threads could reach the chips in different orders and wait
        on each other forever. The overlap is the engine's waits for tool calls, not its calls."""
        ev, last, k = self.run.eval, {}, self.max_staleness
        self._publish(self.step, self.state.params)
        self.pipeline = pipe = RolloutPipeline(
            first_step=self.step + 1, last_step=self.total_steps, max_staleness=k, versions=self.versions,
            data=self.data, use_version=self._use_version, partial=self.run.train.partial_rollouts,
            roll_out=lambda questions, step, first, last, load: self._engine_run(
                questions, step, versions=TurnVersions(first, last, load), stop=lambda: pipe.stopping))
        self.engine.policy = pipe.serialized(self.sampler)
        pipe.start()
        try:
            while self.step < self.total_steps:
                step = self.step + 1
                t0 = time.perf_counter()
                with metrics_lib.profile_trace(self.workdir / "profile", step in self.run.run.profiled):
                    item, waited = pipe.take(step)
                    with pipe.device:
                        # Every host reaches this safe point once per step (a collective), with its batch or not.
                        stop = self.watch.reached() or item.abandoned
                        if not stop:
                            metrics = self._update_async(item, step)
                    if stop:
                        pipe.stop()
                        if self.step:
                            with pipe.device:
                                self.save(self.step, force=True)
                        self.preempted = preemption.stop_line(self.watch.name(), step, self.step,
                                                              self.checkpointer.directory)
                        return last
                    metrics["time/learner_wait_s"] = waited
                    host_memory.release_freed()
                self.step = step
                final = step == self.total_steps
                if (ev.every_steps and step % ev.every_steps == 0) or final:
                    with pipe.sampler():
                        self.sampler.update_params(self.state.model())
                        metrics.update(self.evaluate(step))
                        self.sampler.release_params()  # it read the learner's arrays, which the next update donates
                    host_memory.release_freed()
                if final:
                    pipe.stop()
                    self.release_rollout()
                with pipe.device:
                    stop = not final and self.watch.reached()  # after the update and its evaluation
                    self.save(step, force=final or stop)
                if final:
                    self.versions.clear()
                last = self._log_step(step, metrics, t0, len(item.episodes), item.epoch)
                if stop:  # the pipeline's thread ends in `finally`
                    self.preempted = preemption.stop_line(self.watch.name(), step, step, self.checkpointer.directory)
                    return last
            return last
        finally:
            pipe.stop()
            self.engine.policy = self.sampler

    def _update_async(self, item: Any, step: int) -> dict[str, float]:
        """Step `step`'s update on its rollout (`Rollout`), then version `step` published for the
        batch k + 1 steps later; returns the step's metrics so far."""
        selection = self.learner.select([e.reward for e in item.episodes], group_size=self.run.rollout.n,
                                        wanted=len(item.questions))
        metrics, batch = self._prepare(item.episodes, item.stats, selection)
        metrics.update(staleness_metrics(item, step, self.max_staleness, sharding.allgather_objects))
        with self.writer.progress(None, f"step {step} update"):
            metrics.update(self.update(batch, step, sync_sampler=False))
        # Older versions than the next batch's no batch reads any more.
        self._publish(step, self.state.params)
        self.versions.keep_from(behaviour_version(step + 1, self.max_staleness))
        self._log_trajectories(step, item.episodes)
        return metrics

    def _log_step(self, step: int, metrics: dict[str, float], t0: float, episodes: int,
                  epoch: int) -> dict[str, float]:
        """Adds the step's wall time (from `t0`), trajectories/s over it (`episodes` rolled out) and
        data epoch to `metrics`, writes them and prints the step's line; returns them."""
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["perf/trajectories_per_s"] = episodes / metrics["time/step_s"]
        metrics["data/epoch"] = epoch
        self.writer.write(step, metrics)
        self.writer.flush()
        if self.primary:
            print(format_summary(step, self.total_steps, metrics), flush=True)
        return metrics

    def _publish(self, version: int, params: Any, copy: bool = True) -> None:
        """Stores a policy version for the batches that read it. On several hosts the sampler's
        weights of it are made here too: they gather every host's shards, a collective, which the
        trainer's thread runs in the same order on every host, whereas the rollout thread loads a
        version at its host's own pace (with partial rollouts, at points that differ by host)."""
        if copy:  # the learner's own arrays are donated to its next update
            params = jax.tree.map(jnp.copy, params)
        weights = None
        if jax.process_count() > 1:
            weights = self.sampler.synced(self.state.replace(params=params).model())
        self.versions.publish(version, params, copy=False, sampler_weights=weights)

    def _use_version(self, params: Any, weights: Any = None) -> None:
        """The sampler on a policy version (the pipeline's thread): its weights as `_publish` made
        them (several hosts), else made here from its parameters."""
        if weights is not None:
            self.sampler.use_weights(weights)
        else:
            self.sampler.update_params(self.state.replace(params=params).model())

    def finish(self) -> storage.Path | None:
        """Waits for checkpoints, exports the policy as an HF checkpoint (if configured), closes."""
        self.checkpointer.wait()
        self.release_rollout()
        out = None
        if self.run.checkpoint.export_hf:  # every host takes part (the weights are gathered); host 0 writes
            out = checkpointing.export_hf(self.state, self.workdir / "hf", tokenizer_dir=self.source_dir,
                                          tokenizer=self.tokenizer if self.source_dir is None else None,
                                          dtype=self.run.checkpoint.export_dtype_for(self.run.model.dtype))
        self.close()
        return out

    def release_rollout(self) -> None:
        """Frees what only rollouts need (sampler weights, KL reference, the embedded executor's LLM):
        done after the last step's evaluation, so the final checkpoint and HF export do not add to
        the training peak. Idempotent."""
        if self.pipeline is not None:
            self.pipeline.stop()
        self.sampler.release_params()
        self.learner.release_reference()
        self.setup.close()

    def close(self) -> None:
        self.checkpointer.close()
        self.writer.close()
        self.setup.close()  # idempotent

