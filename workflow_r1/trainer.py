"""The training loop: rollouts -> rewards -> group advantages -> update -> metrics / eval / checkpoint.

One step (docs/design.md, Data flow):

    questions = data.next()                                    this host's share of prompts_per_step
    episodes  = rollout.run(questions, n)                      sampler on the current params + executor
    advantages = grpo_advantages(rewards, group_size=n)        rows of a group are adjacent
    batch = pack(episodes, advantages) -> shard_batch          the trajectory contract (rl/batch.py)
    ref_logprobs = reference policy (only when kl_coef > 0)
    state = train_step(state, batch)                           old log-probs recomputed, M updates
    sampler.update_params(state.params)                        on device, no host copy

`Run.from_config` turns the config (configs/*.py) into typed sections and checks them together
before any work; `Trainer` owns the model, sampler, executor and writers; `Trainer.train` loops and
resumes from the newest checkpoint in its work directory.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import resource
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from workflow_r1 import checkpointing, configlib, sharding
from workflow_r1.data.config import DataConfig, load_data
from workflow_r1.data.iterator import QuestionIterator
from workflow_r1.env.config import EnvConfig
from workflow_r1.eval import EvalConfig, evaluate
from workflow_r1.executor.connect import ExecutorConfig, connect
from workflow_r1 import metrics as metrics_lib
from workflow_r1.metrics import MetricWriter, drop_step_files, format_summary
from workflow_r1.model import policy
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.rl import advantages as advantages_lib
from workflow_r1.rl import batch as batch_lib
from workflow_r1.rl import train_step as ts
from workflow_r1.rollout import RolloutConfig, RolloutEngine, combine, episode_metrics, pack, padded_length
from workflow_r1.sampler import Sampler

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The run itself (the top-level keys of a config).

    seed: seeds the data order, the rollouts and a tiny model's initialisation.
    steps: training steps (one rollout batch and `train.num_mini_batches` updates each); 0 = `epochs`
      passes over the training questions.
    epochs: passes over the training questions when `steps` is 0 (paper: 2, i.e. 38 steps).
    workdir: where metrics, checkpoints and logs go ("" = runs/<config name>; --workdir overrides).
    tensorboard: also write TensorBoard event files.
    log_trajectories: episodes of each step written to trajectories/step_N.jsonl (-1 = all).
    profile_steps: comma-separated steps recorded as jax.profiler traces under profile/ (TensorBoard's
      profile plugin, Perfetto), e.g. --config.profile_steps=2,3.
    """

    seed: int = 0
    steps: int = 0
    epochs: int = 2
    workdir: str = ""
    tensorboard: bool = True
    log_trajectories: int = 8
    profile_steps: str = ""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (0: `epochs` passes over the training questions), got {self.steps}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.log_trajectories < -1:
            raise ValueError(f"log_trajectories must be >= -1 (-1: every episode), got {self.log_trajectories}")
        if any(not s.strip().isdigit() or int(s) < 1 for s in self.profile_steps.split(",") if s.strip()):
            raise ValueError(f"profile_steps must be comma-separated step numbers >= 1 (e.g. 2,3), got "
                             f"{self.profile_steps!r}")

    @property
    def profiled(self) -> frozenset[int]:
        """The steps of `profile_steps`."""
        return frozenset(int(s) for s in self.profile_steps.split(",") if s.strip())


SECTIONS: dict[str, type] = {
    "model": policy.ModelConfig, "train": ts.TrainConfig, "rollout": RolloutConfig, "env": EnvConfig,
    "executor": ExecutorConfig, "data": DataConfig, "eval": EvalConfig, "checkpoint": checkpointing.CheckpointConfig,
}


@dataclasses.dataclass(frozen=True)
class Run:
    """Every section of a config as its dataclass, checked together (`from_config`)."""

    run: RunConfig
    model: policy.ModelConfig
    train: ts.TrainConfig
    rollout: RolloutConfig
    env: EnvConfig
    executor: ExecutorConfig
    data: DataConfig
    eval: EvalConfig
    checkpoint: checkpointing.CheckpointConfig
    preset: str = ""
    raw: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict) -> "Run":
        d = cfg.to_dict()
        sections = {name: configlib.to_dataclass(kind, d.pop(name, {}), name) for name, kind in SECTIONS.items()}
        preset = str(d.pop("preset", ""))
        d.pop("variants", None)
        run = configlib.to_dataclass(RunConfig, d, "config")
        out = cls(run=run, preset=preset, raw=cfg, **sections)
        out.check()
        return out

    @property
    def rows(self) -> int:
        """Episodes per step, all hosts together (B of the trajectory batch)."""
        return self.rollout.prompts_per_step * self.rollout.n

    def check(self) -> None:
        """Cross-section rules; each failure is one line naming the keys to change."""
        t, r = self.train, self.rollout
        if t.temperature != r.temperature and r.temperature > 0:
            raise configlib.ConfigError(f"train.temperature={t.temperature} differs from rollout.temperature="
                                        f"{r.temperature}; log-probs must be scored at the sampling temperature")
        micro = t.micro_batch_size or self.rows // t.num_mini_batches
        if self.rows % t.num_mini_batches or (self.rows // t.num_mini_batches) % micro:
            raise configlib.ConfigError(
                f"rollout.prompts_per_step x rollout.n = {self.rows} rows must split into train.num_mini_batches="
                f"{t.num_mini_batches} mini-batches of whole train.micro_batch_size={t.micro_batch_size} micro-batches")
        fixed = max(t.mesh_fsdp, 1) * max(t.mesh_tensor, 1)
        data = t.mesh_data if t.mesh_data > 0 else max(jax.device_count() // fixed, 1)
        if micro % (data * max(t.mesh_fsdp, 1)):
            raise configlib.ConfigError(
                f"a micro-batch of {micro} rows does not split over the {data * max(t.mesh_fsdp, 1)} devices of the "
                "mesh's batch axes (data x fsdp); change train.micro_batch_size or the rollout batch")
        if r.prompts_per_step % jax.process_count():
            raise configlib.ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the "
                                        f"{jax.process_count()} hosts")
        if self.preset == "paper":
            for key, value, what in (("executor.url", self.executor.url, "an executor service in front of the "
                                      "operator LLM (Qwen2.5-32B-Instruct in the paper)"),
                                     ("data.train_files", self.data.train_files, "the NQ + HotpotQA training mix "
                                      "(python -m workflow_r1.data.mix)")):
                if not value:
                    raise configlib.ConfigError(f"the paper preset needs --config.{key}: {what}")
        if self.checkpoint.every_steps and self.run.steps and self.checkpoint.every_steps > self.run.steps:
            log.warning("checkpoint.every_steps=%d > steps=%d: only the final checkpoint is written",
                        self.checkpoint.every_steps, self.run.steps)


class Trainer:
    """Builds everything a run needs from a `Run` and trains (`train`)."""

    def __init__(self, run: Run, workdir: str | pathlib.Path):
        self.run, self.workdir = run, pathlib.Path(workdir)
        self.primary = jax.process_index() == 0
        seed = run.run.seed
        # Data first: a bad file fails before a model is loaded.
        self.train_questions, self.eval_questions = load_data(run.data, seed)
        self.mesh = ts.make_mesh(run.train) if jax.device_count() > 1 else None
        model, self.tokenizer = policy.load(run.model, mesh=self.mesh, remat=bool(run.train.remat))
        self.source_dir = policy.checkpoint_dir(run.model)
        graphdef, params = nnx.split(model)
        # The reference policy of the KL term is the initial one: keep a copy only when it is used.
        self.ref_state = (ts.TrainState(graphdef=graphdef, params=reference_copy(params), opt_state=None,
                                        step=jnp.zeros((), jnp.int32)) if run.train.kl_coef else None)
        self.state = ts.create_train_state(model, run.train, self.mesh)
        self.num_params = sum(x.size for x in jax.tree.leaves(self.state.params))  # for MFU
        # A disk without room for the next checkpoint (and the final export) fails here, before the
        # executor starts or any rollout: a run that fills its disk at its end loses its last steps.
        need = checkpointing.bytes_written(self.state)
        if run.checkpoint.export_hf and self.primary:
            need += checkpointing.export_bytes(self.state.params)
        checkpointing.check_free_space(self.workdir / "checkpoints", need, "the run's next checkpoint"
                                       + (" and its final export" if run.checkpoint.export_hf else ""))
        self.train_step = ts.make_train_step(run.train, self.mesh)
        # The sampler works from a copy of the globally sharded weights on `sharding.rollout_mesh`.
        self.sampler = Sampler(self.state.model(), self.tokenizer, cache_size=run.rollout.cache_size,
                               mesh=sharding.rollout_mesh(self.mesh, run.train.mesh_tensor),
                               dtype=run.rollout.sampler_dtype or None)
        self.executor = connect(run.executor)
        self.engine = RolloutEngine(self.sampler, self.tokenizer, self.executor.client.execute_many_sync, run.rollout,
                                    run.env)
        self.train_questions = self._fitting(self.train_questions, "training")
        self.eval_questions = self._fitting(self.eval_questions, "evaluation")
        self.data = QuestionIterator(self.train_questions, run.rollout.prompts_per_step, seed=seed,
                                     shuffle=run.data.shuffle, process_index=jax.process_index(),
                                     process_count=jax.process_count())
        self.total_steps = run.run.steps or run.run.epochs * self.data.steps_per_epoch
        self.checkpointer = checkpointing.Checkpointer(self.workdir / "checkpoints", run.checkpoint)
        self.step = 0
        latest = self.checkpointer.latest_step()
        if latest is not None:
            self.state, extra = self.checkpointer.restore(self.state, latest)
            self.data.set_state(extra["data"])
            self.step = int(extra["step"])
            self.sampler.update_params(self.state.params)
            log.info("resumed from %s at step %d", self.checkpointer.directory / str(latest), self.step)
        # Whatever a killed run wrote past its newest checkpoint (a step whose save never finished, or
        # everything when none did) is rewritten from here on: one record per step (steps start at 0).
        first = self.step + 1 if self.step else 0
        self.writer = MetricWriter(self.workdir, tensorboard=run.run.tensorboard, resume_from=first)
        if self.primary:
            for name in ("trajectories", "eval"):
                drop_step_files(self.workdir / name, first)
        if self.primary:
            self.workdir.mkdir(parents=True, exist_ok=True)
            (self.workdir / "config.json").write_text(json.dumps(run.raw.to_dict(), indent=2, default=str))

    def _fitting(self, questions: list, what: str) -> list:
        """Drops questions whose prompt exceeds rollout.max_prompt_tokens (verl's overlong filter)."""
        limit = self.run.rollout.max_prompt_tokens
        # Over-long by its size alone: never tokenized (a 10 MiB question would cost GBs of tokenizer memory).
        kept = [q for q in questions if not tokenizer_lib.surely_longer(self.tokenizer, q.question, limit)
                and len(self.engine.encode_prompt(q.question)[1]) <= limit]
        if len(kept) < len(questions):
            log.warning("%d of %d %s questions have prompts over rollout.max_prompt_tokens=%d and are skipped",
                        len(questions) - len(kept), len(questions), what, limit)
        return kept

    # ------------------------------------------------------------------------------------ one step

    def rollout_batch(self, questions: list, step: int) -> tuple[list, dict[str, float], batch_lib.TrainBatch]:
        """Rolls out this host's questions; returns (episodes, metrics, the sharded batch)."""
        r = self.run.rollout
        bar = self.writer.progress(len(questions) * r.n, f"step {step} rollout")
        with bar:
            # Rows are numbered globally (host h holds rows [h*B/P, (h+1)*B/P)), so each samples what
            # one process rolling out the whole batch would.
            episodes, stats = self.engine.run(questions, seed=self.run.run.seed * 1_000_003 + step,
                                              progress=lambda done, total: bar.update(done - bar.n),
                                              row_offset=jax.process_index() * len(questions) * r.n)
        rewards = np.array([e.reward for e in episodes], np.float32)
        adv = np.asarray(advantages_lib.grpo_advantages(jnp.asarray(rewards), group_size=r.n))
        length = padded_length(episodes, r.pad_multiple)
        if jax.process_count() > 1:  # one global batch: every host pads to the longest row anywhere
            from jax.experimental import multihost_utils
            length = int(np.max(multihost_utils.process_allgather(np.array(length))))
        host_batch = pack(episodes, adv, pad_id=self.tokenizer.pad_token_id, length=length)
        # Every host's episodes count (timings and throughput below are this host's own).
        metrics = {f"rollout/{k}": v for k, v in combine(sharding.allgather_objects(episode_metrics(episodes))).items()}
        metrics.update({"time/generate_s": stats.seconds_generate, "time/executor_s": stats.seconds_executor,
                        "time/rollout_s": stats.seconds_total, "rollout/rounds": stats.rounds,
                        "rollout/tokens_per_s": stats.generated_tokens / max(stats.seconds_generate, 1e-9),
                        "rollout/batch_length": length})
        return episodes, metrics, batch_lib.shard_batch(host_batch, self.mesh)

    def update(self, batch: batch_lib.TrainBatch) -> dict[str, float]:
        """Reference log-probs (if KL is on), then the train step; the loss metrics averaged over updates."""
        t, metrics = self.run.train, {}
        if self.ref_state is not None:
            t0 = time.perf_counter()
            ref = ts.compute_logprobs(self.ref_state, batch, chunk_size=t.logprob_chunk_size,
                                      micro_batch_size=t.micro_batch_size, mesh=self.mesh,
                                      logprob_policy_only=t.logprob_policy_only, temperature=t.temperature)
            batch = batch.replace(ref_logprobs=jax.block_until_ready(ref))
            metrics["time/ref_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.sampler.release_params()  # its copy of the weights is stale after the update anyway
        self.state, step_metrics = self.train_step(self.state, batch)
        step_metrics = jax.device_get(step_metrics)
        metrics["time/update_s"] = time.perf_counter() - t0
        metrics["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        metrics.update(metrics_lib.update_throughput(int(np.prod(batch.tokens.shape)), metrics["time/update_s"],
                                                     self.num_params, jax.devices()))
        metrics.update(metrics_lib.device_memory(jax.local_devices()))
        metrics.update({f"train/{k}": float(np.mean(v)) for k, v in step_metrics.items()})
        metrics["train/updates"] = int(self.state.step)
        self.sampler.update_params(self.state.params)
        return metrics

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
            result.write(self.workdir / "eval" / f"step_{step:06d}.jsonl")
        out = result.flat("eval/")
        out["time/eval_s"] = result.seconds
        return out

    def save(self, step: int, force: bool = False) -> None:
        extra = {"step": step, "data": self.data.get_state(), "seed": self.run.run.seed,
                 "config": json.loads(json.dumps(self.run.raw.to_dict(), default=str))}
        self.checkpointer.save(step, self.state, extra, force=force)

    def _log_trajectories(self, step: int, episodes: list) -> None:
        k = self.run.run.log_trajectories
        if k == 0:
            return
        # The first k of the global batch (host order is row order); every host sends, host 0 writes.
        rows = [r for host in sharding.allgather_objects([e.summary() for e in (episodes if k < 0 else episodes[:k])])
                for r in host]
        if not self.primary:
            return
        path = self.workdir / "trajectories" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for row in rows if k < 0 else rows[:k]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------ the loop

    def train(self) -> dict[str, float]:
        """Runs the remaining steps; returns the last step's metrics (plus the final evaluation)."""
        ev, last = self.run.eval, {}
        if self.step == 0 and ev.at_start:
            self.writer.write(0, self.evaluate(0))
        while self.step < self.total_steps:
            step = self.step + 1
            t0 = time.perf_counter()
            questions = self.data.next()
            with metrics_lib.profile_trace(self.workdir / "profile", step in self.run.run.profiled):
                episodes, metrics, batch = self.rollout_batch(questions, step)
                metrics.update(self.update(batch))
            self.step = step
            self._log_trajectories(step, episodes)
            final = step == self.total_steps
            if (ev.every_steps and step % ev.every_steps == 0) or final:
                metrics.update(self.evaluate(step))
            if final:  # the rollout side is done: free its memory before the last save and the export
                self.release_rollout()
            self.save(step, force=final)
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics["data/epoch"] = self.data.epoch
            self.writer.write(step, metrics)
            self.writer.flush()
            if self.primary:
                print(format_summary(step, self.total_steps, metrics), flush=True)
            last = metrics
        return last

    def finish(self) -> pathlib.Path | None:
        """Waits for checkpoints, exports the policy as an HF checkpoint (if configured), closes."""
        self.checkpointer.wait()
        self.release_rollout()
        out = None
        if self.run.checkpoint.export_hf:  # every host takes part (the weights are gathered); host 0 writes
            out = checkpointing.export_hf(self.state, self.workdir / "hf", tokenizer_dir=self.source_dir)
            if self.source_dir is None and self.primary:
                self.tokenizer.save_pretrained(str(out))
        self.close()
        return out

    def release_rollout(self) -> None:
        """Frees what only rollouts need (sampler weights, KL reference, the embedded executor's LLM):
        done after the last step's evaluation, so the final checkpoint and HF export do not add to
        the training peak. Idempotent."""
        self.sampler.release_params()
        self.ref_state = None
        self.executor.close()

    def close(self) -> None:
        self.checkpointer.close()
        self.writer.close()
        self.executor.close()  # idempotent


def reference_copy(params: Any) -> Any:
    """A frozen copy of the initial parameters for the KL reference, stored in bfloat16 where that is
    exact (released checkpoints, the bundled model included, hold bf16 values): half the memory, the
    same log-probs, since the model casts every weight to its compute dtype before use."""
    def one(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.float32 and bool(jnp.all(x.astype(jnp.bfloat16).astype(jnp.float32) == x)):
            return x.astype(jnp.bfloat16)
        return jnp.copy(x)

    return jax.tree.map(one, params)


def distributed_setup() -> None:
    """Multi-host start-up (a no-op on one machine); must run before JAX touches a backend."""
    sharding.maybe_initialize_distributed()
