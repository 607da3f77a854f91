"""The run's configuration: every config section as its dataclass (`Run`), checked together.

A config file (configs/*.py) is an `ml_collections.ConfigDict` whose sections are built from the
dataclasses in `SECTIONS`; `Run.from_config` converts each section (one-line errors naming the key)
and checks the rules that involve several sections. The trainer, the evaluator, the ablation and
the config files read the run from here, so none of them imports another's code to know a key.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Any

import jax
import ml_collections

from workflow_r1 import bounds, checkpointing, configlib, policy
from workflow_r1.sharding import MeshConfig
from workflow_r1.data.config import DataConfig
from workflow_r1.task.config import EnvConfig
from workflow_r1.eval import EvalConfig
from workflow_r1.executor.connect import ExecutorConfig
from workflow_r1.rl import train_state
from workflow_r1.rollout import RolloutConfig

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
    wandb_project: also log every step's metrics to this Weights & Biases project ("" = off; needs
      `pip install wandb`). One wandb run per work directory: a resumed run continues it.
    wandb_mode: "online" (needs `wandb login`) or "offline" (written under workdir/wandb/; upload
      later with `wandb sync`).
    """

    seed: int = 0
    steps: int = 0
    epochs: int = 2
    workdir: str = ""
    tensorboard: bool = True
    log_trajectories: int = 8
    profile_steps: str = ""
    wandb_project: str = ""
    wandb_mode: str = "online"

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (0: `epochs` passes over the training questions), got {self.steps}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        bounds.check("seed", self.seed, 0, 2**32 - 1)
        bounds.check("steps", self.steps, 0, bounds.MAX_COUNT)
        bounds.check("epochs", self.epochs, 1, 1 << 16)
        if self.log_trajectories < -1:
            raise ValueError(f"log_trajectories must be >= -1 (-1: every episode), got {self.log_trajectories}")
        if any(not s.strip().isdigit() or int(s) < 1 for s in self.profile_steps.split(",") if s.strip()):
            raise ValueError(f"profile_steps must be comma-separated step numbers >= 1 (e.g. 2,3), got "
                             f"{self.profile_steps!r}")
        if self.wandb_mode not in ("online", "offline"):
            raise ValueError(f"wandb_mode must be 'online' or 'offline', got {self.wandb_mode!r}")
        if self.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ValueError(f"wandb_project={self.wandb_project!r} needs wandb, which is not installed: "
                             "pip install wandb, or leave wandb_project empty")

    @property
    def profiled(self) -> frozenset[int]:
        """The steps of `profile_steps`."""
        return frozenset(int(s) for s in self.profile_steps.split(",") if s.strip())


SECTIONS: dict[str, type] = {
    "model": policy.ModelConfig, "mesh": MeshConfig, "train": train_state.TrainConfig, "rollout": RolloutConfig, "env": EnvConfig,
    "executor": ExecutorConfig, "data": DataConfig, "eval": EvalConfig, "checkpoint": checkpointing.CheckpointConfig,
}


@dataclasses.dataclass(frozen=True)
class Run:
    """Every section of a config as its dataclass, checked together (`from_config`)."""

    run: RunConfig
    model: policy.ModelConfig
    mesh: MeshConfig
    train: train_state.TrainConfig
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
        # Packed (train.pack_tokens), micro-batches are of packed rows, whatever the episode count;
        # with train.share_prompts too they are of rows, whose responses are then packed.
        by_rows = not t.pack_tokens or t.share_prompts
        if self.rows % t.num_mini_batches or (by_rows and (self.rows // t.num_mini_batches) % micro):
            raise configlib.ConfigError(
                f"rollout.prompts_per_step x rollout.n = {self.rows} rows must split into train.num_mini_batches="
                f"{t.num_mini_batches} mini-batches of whole train.micro_batch_size={t.micro_batch_size} micro-batches")
        if t.pack_tokens and t.share_prompts and t.pack_tokens < r.max_response_tokens:
            # Known now, not at the first update after a whole rollout: shared, a packed row holds responses.
            raise configlib.ConfigError(
                f"train.pack_tokens={t.pack_tokens} is below rollout.max_response_tokens={r.max_response_tokens}: with "
                "train.share_prompts a packed row must hold the longest response; raise train.pack_tokens or lower "
                "rollout.max_response_tokens")
        m = self.mesh
        fixed = max(m.fsdp, 1) * max(m.tensor, 1)
        data = m.data if m.data > 0 else max(jax.device_count() // fixed, 1)
        if micro % (data * max(m.fsdp, 1)):
            raise configlib.ConfigError(
                f"a micro-batch of {micro} rows does not split over the {data * max(m.fsdp, 1)} devices of the "
                "mesh's batch axes (mesh.data x mesh.fsdp); change train.micro_batch_size or the rollout batch")
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

