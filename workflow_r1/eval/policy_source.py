"""Which weights an evaluation runs: `--checkpoint` as an HF directory, a run directory or an orbax
checkpoint directory, resolved to a policy model and its tokenizer. Each may be a local path or a
URI (gs://bucket/run: what a run with that work directory wrote; `workflow_r1.storage`).

- an HF directory (config.json + *.safetensors, e.g. a run's `hf/` export or a released model): read
  with `policy.load`, architecture from its config.json;
- a run directory (it holds `checkpoints/`) or its `checkpoints/` directory: the policy parameters
  of the newest orbax step (not the optimizer state), restored onto the model the run was trained
  with (its `config.json` names it; a LoRA run's adapters go onto the base that model loads);
- "" : the `model` section of the evaluation config (e.g. the bundled model before any training).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import checkpointing, configlib, policy, storage
from workflow_r1.model import lora


class CheckpointNotFound(ValueError):
    """`--checkpoint` names nothing loadable; the message says what was expected."""


def is_hf_dir(path: storage.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def orbax_dir(path: storage.Path) -> storage.Path | None:
    """The orbax checkpoint directory of a run directory, or `path` itself if it holds numbered steps."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if any(p.is_dir() and p.name.isdigit() for p in path.iterdir()):
        return path
    return None


def _run_model(ckpt_dir: storage.Path, model: policy.ModelConfig) -> policy.ModelConfig:
    """The model section of the run that wrote `ckpt_dir` (its config.json), else the given one."""
    config = ckpt_dir.parent / "config.json"
    if not config.is_file():
        return model
    return configlib.to_dataclass(policy.ModelConfig, json.loads(config.read_text()).get("model", {}), "model")


def load(checkpoint: str, model_cfg: policy.ModelConfig, *, mesh: Mesh | None = None) -> tuple[Any, Any, str]:
    """(model, tokenizer, description) of the policy named by `checkpoint` (see the module docstring).

    model_cfg: the evaluation config's model section, used when `checkpoint` is "" and for the
    compute dtype of an HF directory. Raises CheckpointNotFound (one line) when nothing matches.
    """
    if not checkpoint:
        model, tokenizer = policy.load(model_cfg, mesh=mesh)
        return model, tokenizer, f"model section ({model_cfg.checkpoint or model_cfg.preset or 'bundled'})"
    path = storage.source(checkpoint)
    with storage.reading(checkpoint, "--checkpoint", CheckpointNotFound):
        if not path.is_dir():
            raise CheckpointNotFound(f"--checkpoint={checkpoint}: no such directory; pass a run directory, its "
                                     "checkpoints/ directory or an HF checkpoint directory (local or gs://...)")
        hf, ckpt_dir = is_hf_dir(path), orbax_dir(path)
    if hf:
        cfg = dataclasses.replace(model_cfg, checkpoint=str(path), preset="")
        model, tokenizer = policy.load(cfg, mesh=mesh)
        return model, tokenizer, f"HF checkpoint {path}"
    if ckpt_dir is None:
        raise CheckpointNotFound(f"--checkpoint={checkpoint} holds neither config.json + *.safetensors (an HF "
                                 "checkpoint) nor checkpoints/ or numbered steps (a run's orbax checkpoints)")
    with storage.reading(checkpoint, "--checkpoint", CheckpointNotFound):
        run_model = _run_model(ckpt_dir, model_cfg)
    model, tokenizer = policy.load(run_model, mesh=mesh)
    # What the run trained: every parameter, or its LoRA adapters over the base the model loaded.
    graphdef, target, base = nnx.split(model, lora.trainable(model), ...)
    params, step = checkpointing.restore_params(ckpt_dir, target)
    return nnx.merge(graphdef, params, base), tokenizer, f"{ckpt_dir} step {step}"
