"""The CPU update's compiler options keep attention's causal blocks from all being live at once.

XLA's default CPU scheduler runs the unrolled causal blocks of `ops.attend` side by side, each with
its own scores and probabilities; `train_state.compiler_options()` asks for the memory-optimized
scheduler. Measured here on the compiled program (XLA's buffer assignment, no run): attention's
gradient at 2 rows x 5,120 positions, the length a tiny run's 4-turn episodes pad to.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from workflow_r1.model import ops, qwen2
from workflow_r1.rl import train_state

B, T, K, G, DH = 2, 5120, 2, 2, 16  # the tiny model's grouped heads (4 query heads over 2 KV heads)


def _attention_grad_temp_bytes(options: dict | None) -> int:
    """Temporary bytes of jax.grad of causal attention over [B, T] queries, compiled with `options`."""
    def loss(q, k, v):
        valid = jnp.ones((B, T), bool)
        slots = jnp.broadcast_to(jnp.arange(T), (B, T))
        return ops.attend(q, k, v, valid, slots, jnp.float32, qwen2.QUERY_BLOCK, qwen2.CAUSAL_BLOCK).sum()

    q = jax.ShapeDtypeStruct((B, T, K, G, DH), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, DH), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=options).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are the CPU backend's")
def test_update_options_hold_less_attention_memory_than_xla_default_scheduler():
    options = train_state.compiler_options()
    default = {k: v for k, v in options.items() if k != "xla_cpu_scheduler_type"}
    ours, theirs = _attention_grad_temp_bytes(options), _attention_grad_temp_bytes(default)
    # 8 rows: 3.6 GiB against 5.1 GiB; the full tiny update at 8 x 5,120: 5.9 GiB against 10.7.
    assert ours <= 0.8 * theirs, f"{ours / 2**30:.2f} GiB with the update's options, {theirs / 2**30:.2f} without"
