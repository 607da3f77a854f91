"""The policy model and its tokenizer from the `model` config section.

Three cases, decided by `ModelConfig`:
  - a real checkpoint: `checkpoint` is an HF directory, local or a URI such as gs://bucket/model
    (or "" for the bundled real model, built by `workflow_r1.assets` on first use); the architecture
    is read from its config.json and, when `preset` names one too, checked against it;
  - a tiny random model: `preset` is a tiny preset ("tiny-chat"), `checkpoint` is ""; its tokenizer
    is the byte-level ChatML tokenizer (`tokenizer.byte_level`), so the whole pipeline runs without
    any download (tests, smoke runs);
  - anything else (a large preset without a checkpoint) is an error naming the flag to set.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from workflow_r1 import bounds, storage
from workflow_r1.model import checkpoint as checkpoint_lib
from workflow_r1.model import lora as lora_lib
from workflow_r1.model import qwen2, splash
from workflow_r1.model import tokenizer as tokenizer_lib
from workflow_r1.model.config import PRESETS, Qwen2Config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION = splash.IMPLS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which policy to train (the `model` config section).

    checkpoint: HF checkpoint directory, a local path or a URI (gs://...: every host reads it from the
      bucket in place, each host only the rows of each tensor that its devices place:
      `workflow_r1.model.checkpoint`); "" = the bundled Qwen2.5-Coder-0.5B-Instruct, unless `preset` is a tiny
      preset.
    preset: "" = the architecture of the checkpoint's config.json; a name of `model.config.PRESETS`
      = that architecture (a tiny one is initialised randomly with `seed`; a real one must match
      the checkpoint's config.json).
    dtype, param_dtype: compute and parameter dtypes ("float32" | "bfloat16" | "float16").
    seed: initialisation seed of a tiny random model.
    scan_layers: stack the layers' parameters [L, ...] and run them under `jax.lax.scan`
      (`qwen2.Qwen2`): the same numbers, one compiled layer body instead of L, so compile time and
      compiler memory stay flat in depth (the 7B's update). Orbax checkpoints hold the stacked
      layout: resume with the same setting. HF checkpoints load and export either way.
    remat: rematerialise each layer's activations in the backward pass (gradient checkpointing):
      one more forward per update, a layer's activations instead of all of them in memory.
    lora_rank: 0 trains every parameter; r > 0 adds rank-r LoRA adapters (`model.lora`) to the
      `lora_targets` projections of every layer and trains only those (fp32, with their AdamW
      moments), the base frozen in `param_dtype` (bfloat16 halves its memory). Checkpoints then hold
      the adapters; the HF export and the sampler use the merged weights (docs/design.md, LoRA).
    lora_alpha: the adapters' update is scaled by lora_alpha / lora_rank.
    lora_targets: which projections get adapters, of q, k, v, o (attention), gate, up, down (MLP).
    attention: the attention of training and scoring (no KV cache): "auto" = jax's Pallas splash
      kernel where the program compiles for TPU (a flash attention: no [T, T] scores in memory,
      causal blocks skipped), the blocked jnp attention elsewhere; "jnp" everywhere; "splash" fails
      where it cannot run (off TPU). Sampling always uses the jnp (or paged) path. See
      `workflow_r1.model.splash`.
    """

    checkpoint: str = ""
    preset: str = ""
    dtype: str = "float32"
    param_dtype: str = "float32"
    seed: int = 0
    scan_layers: bool = False
    remat: bool = False
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"model.attention={self.attention!r} unknown; use one of {ATTENTION} "
                             "(auto: splash on TPU, jnp elsewhere)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"model.{name}={getattr(self, name)!r} unknown; use one of {sorted(DTYPES)}")
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"model.preset={self.preset!r} unknown; use '' (read config.json) or one of "
                             f"{sorted(PRESETS)}")
        bounds.check("model.seed", self.seed, 0, 2**32 - 1)
        bounds.check("model.lora_rank", self.lora_rank, 0, 1 << 16, note=" (0: full fine-tuning)")
        bounds.check("model.lora_alpha", self.lora_alpha, 0, 1e6, above=True)
        unknown = sorted(set(self.lora_targets) - set(lora_lib.TARGETS))
        if self.lora_rank and (unknown or not self.lora_targets):
            raise ValueError(f"model.lora_targets={tuple(self.lora_targets)!r}: use a non-empty subset of "
                             f"{tuple(lora_lib.TARGETS)}")
        if self.random_init and self.checkpoint:
            raise ValueError(f"model.preset={self.preset!r} is a random tiny model; leave model.checkpoint empty")

    @property
    def random_init(self) -> bool:
        return self.preset.startswith("tiny")


def checkpoint_dir(cfg: ModelConfig) -> storage.Path | None:
    """The HF directory the policy is read from, local or a URI (None for a tiny random model).

    The bundled model is fetched and converted on first use; a large preset needs its directory.
    """
    if cfg.random_init:
        return None
    if cfg.checkpoint:
        return storage.source(cfg.checkpoint)
    if cfg.preset:
        raise ValueError(f"model.preset={cfg.preset!r} needs its weights: set --config.model.checkpoint to the "
                         "Hugging Face directory of that model (e.g. Qwen2.5-7B-Instruct for the paper preset)")
    from workflow_r1 import assets

    return storage.source(assets.ensure())


def load(cfg: ModelConfig, *, mesh: Mesh | None = None) -> tuple[qwen2.Qwen2, Any]:
    """(model, tokenizer) of the policy. A checkpoint's tensors are placed straight onto `mesh` by the
    logical-axis table; a tiny random model is created on the default device (the train state
    places it, `train_step.create_train_state`)."""
    dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    directory = checkpoint_dir(cfg)
    if directory is None:
        model = qwen2.create(PRESETS[cfg.preset], seed=cfg.seed, dtype=dtype, param_dtype=param_dtype,
                             remat=cfg.remat, scan_layers=cfg.scan_layers)
        return with_lora(qwen2.use_attention(model, cfg.attention), cfg), tokenizer_lib.byte_level()
    with storage.reading(directory, "model.checkpoint"):
        exists = directory.is_dir()
    if not exists:
        raise ValueError(f"model.checkpoint={directory}: no such directory; point it at a Hugging Face checkpoint "
                         "directory (config.json, *.safetensors, tokenizer files), local or gs://...")
    arch = Qwen2Config.from_hf(directory)
    if cfg.preset and _shape(arch) != _shape(PRESETS[cfg.preset]):
        raise ValueError(f"model.preset={cfg.preset!r} does not match {directory}/config.json; "
                         "set model.preset='' to use the checkpoint's own architecture")
    model = checkpoint_lib.load(directory, cfg=arch, mesh=mesh, dtype=dtype, param_dtype=param_dtype,
                                remat=cfg.remat, scan_layers=cfg.scan_layers)
    return with_lora(qwen2.use_attention(model, cfg.attention), cfg, mesh), tokenizer_lib.load(directory)


def with_lora(model: qwen2.Qwen2, cfg: ModelConfig, mesh: Mesh | None = None) -> qwen2.Qwen2:
    """`model` with the LoRA adapters of `cfg` attached (in place; unchanged when lora_rank is 0),
    initialised from `cfg.seed` and placed on `mesh` by their logical axes."""
    if not cfg.lora_rank:
        return model
    lora_lib.attach(model, cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets), seed=cfg.seed)
    if mesh is not None:
        from workflow_r1 import sharding

        graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
        model = nnx.merge(graphdef, jax.device_put(adapters, sharding.state_shardings(adapters, mesh)), rest)
    return model


def _shape(c: Qwen2Config) -> tuple[int, ...]:
    return (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
            c.tie_word_embeddings)
