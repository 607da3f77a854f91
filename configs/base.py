"""Base configuration shared by every run: `get_config(preset)` with presets paper | local | tiny.

Each section is built from the dataclass it configures (`configlib.section`), so every default is
written once, in the dataclass, and every field can be set on the command line:

    python -m workflow_r1.train --config=configs/gsspo.py:local --config.train.learning_rate=3e-6

Presets:
  paper  the paper's run (docs/paper.md, Hyper-parameters): Qwen2.5-7B-Instruct (pass its HF
         directory as --config.model.checkpoint), bf16 compute, remat.
  local  the bundled real Qwen2.5-Coder-0.5B-Instruct on a laptop CPU; the architecture is read
         from the checkpoint's config.json.
  tiny   a tiny random model (tests and smoke runs).
The loss-specific files (gsspo.py, grpo.py, gspo.py) start from this and change only the loss.
"""

import ml_collections

from workflow_r1 import configlib
from workflow_r1.rl.train_step import TrainConfig

PRESETS = ("paper", "local", "tiny")


def get_config(preset: str = "local") -> ml_collections.ConfigDict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {PRESETS}")
    c = ml_collections.ConfigDict()
    c.preset = preset

    # The policy model. checkpoint "" means the bundled real model (python -m workflow_r1.assets);
    # preset "" means: read the architecture from the checkpoint's config.json.
    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = ""
    c.model.preset = {"paper": "qwen2.5-7b", "local": "", "tiny": "tiny"}[preset]
    c.model.dtype = "bfloat16" if preset == "paper" else "float32"
    c.model.param_dtype = "float32"
    c.model.remat = preset == "paper"

    # The policy update: TrainConfig's defaults are the paper's run.
    c.train = configlib.section(
        TrainConfig,
        micro_batch_size={"paper": 8, "local": 2, "tiny": 4}[preset],
        **({"learning_rate": 1e-3, "num_mini_batches": 1} if preset == "tiny" else {}))
    return c
