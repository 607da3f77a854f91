"""Blocked causal attention's backward holds one block's scores at a time on XLA:CPU.

`ops.attend` unrolls its causal blocks; left independent, XLA:CPU's scheduler runs them (and their
rematerialised recomputations) side by side, every block's scores and probabilities live at once:
10.7 GiB of temporaries in the tiny preset's update at 8 x 5,120 positions. Measured on the
compiled program (XLA's buffer assignment; nothing runs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from workflow_r1.model import ops

B, T, K, G, DH = 1, 1024, 2, 2, 16
BLOCK = 128  # 8 causal blocks, each rematerialised (T > query_block)


def _grad_temp_bytes() -> int:
    def loss(q, k, v):
        valid = jnp.ones((B, T), bool)
        slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return ops.attend(q, k, v, valid, slots, jnp.float32, 512, BLOCK).sum()

    q = jax.ShapeDtypeStruct((B, T, K, G, DH), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, DH), jnp.float32)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's scheduler")
def test_attention_backward_holds_a_few_blocks_of_scores():
    last_block_scores = B * K * G * BLOCK * T * 4  # fp32 scores of the last block, against every key
    all_blocks_scores = last_block_scores * (T // BLOCK + 1) // 2
    temp = _grad_temp_bytes()
    # A block's backward holds about five arrays of its scores' size (scores, probabilities, their
    # cotangents, the mask): 10.2 MiB here; every block at once, 31.7 MiB.
    assert temp <= 6 * last_block_scores, (f"{temp / 2**20:.1f} MiB of temporaries: one block's scores are "
                                           f"{last_block_scores / 2**20:.0f} MiB, all blocks' "
                                           f"{all_blocks_scores / 2**20:.0f} MiB")
