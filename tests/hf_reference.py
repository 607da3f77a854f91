"""Helpers that build Hugging Face torch references for our model tests (torch is test-only)."""

from __future__ import annotations

import pathlib

import numpy as np
import torch
import transformers

from workflow_r1.model.config import Qwen2Config


def random_hf_model(cfg: Qwen2Config, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """An HF Qwen2ForCausalLM with every weight random (norm scales around 1, biases non-zero)."""
    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen2Config(**cfg.to_hf(), attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def save_random_hf(cfg: Qwen2Config, out_dir: pathlib.Path, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    model = random_hf_model(cfg, seed)
    model.save_pretrained(out_dir)
    return model


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token rows -> (tokens, mask, positions) [B, T] left-padded, positions 0.. on real tokens."""
    t = max(len(r) for r in rows)
    tokens = np.full((len(rows), t), pad_id, np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        tokens[i, t - len(r):] = r
        mask[i, t - len(r):] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def hf_logits(model: transformers.Qwen2ForCausalLM, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long),
                    attention_mask=torch.as_tensor(np.asarray(mask), dtype=torch.long),
                    position_ids=torch.as_tensor(np.asarray(positions), dtype=torch.long))
    return out.logits.float().numpy()
