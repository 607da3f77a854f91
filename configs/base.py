"""Base configuration shared by every run; `get_config(preset)` with presets paper | local | tiny.

The `train` section holds exactly the fields of `workflow_r1.rl.train_step.TrainConfig`
(`workflow_r1.configlib.train_config` converts it, rejecting unknown keys with a suggestion).
The loss-specific files (gsspo.py, grpo.py, gspo.py) start from this and change only the loss.
Sections for rollouts, data and evaluation join when the end-to-end trainer lands.
"""

import ml_collections

PRESETS = ("paper", "local", "tiny")


def get_config(preset: str = "local") -> ml_collections.ConfigDict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {PRESETS}")
    c = ml_collections.ConfigDict()
    c.preset = preset

    # The policy model. checkpoint "" means the bundled real Qwen2.5-0.5B (python -m workflow_r1.assets).
    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = ""
    c.model.preset = {"paper": "qwen2.5-7b", "local": "qwen2.5-0.5b", "tiny": "tiny"}[preset]
    c.model.dtype = "bfloat16" if preset == "paper" else "float32"
    c.model.param_dtype = "float32"
    c.model.remat = preset == "paper"

    # The policy update (NOTES §9: lr 1e-6 constant, wd 0.01, clip 1.0, 4 mini-batches, k3 KL 0.001).
    u = ml_collections.ConfigDict()
    u.learning_rate = 1e-6
    u.warmup_steps = 0
    u.weight_decay = 0.01
    u.adam_b1 = 0.9
    u.adam_b2 = 0.999
    u.adam_eps = 1e-8
    u.max_grad_norm = 1.0
    u.granularity = "subsequence"
    u.clip_eps_low = 0.2
    u.clip_eps_high = 0.2
    u.dual_clip_c = 3.0
    u.kl_coef = 0.001
    u.tis_cap = ml_collections.FieldReference(None, field_type=float)
    u.entropy_coef = 0.0
    u.num_mini_batches = 4
    u.micro_batch_size = ml_collections.FieldReference({"paper": 8, "local": 2, "tiny": 4}[preset], field_type=int)
    u.logprob_chunk_size = 256
    # Mesh axis sizes; -1 = all remaining devices. Scale to GPUs/TPU pods by changing these alone.
    u.mesh_data = -1
    u.mesh_fsdp = 1
    u.mesh_tensor = 1
    u.remat = ml_collections.FieldReference(None, field_type=bool)
    if preset == "tiny":
        u.learning_rate = 1e-3
        u.num_mini_batches = 1
    c.train = u
    return c
