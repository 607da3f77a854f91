"""Mixed precision vs fp32: the GSsPO loss and gradient of the real model on the same batch.

    .venv/bin/python benchmarks/mixed_precision.py [--rows 4] [--length 1024]

The bundled Qwen2.5-Coder-0.5B-Instruct with fp32 parameters is scored twice on one batch of real
text (bundled corpus passages, two policy segments per row, advantages +1/-1): with fp32 compute
(`model.dtype=float32`) and with bf16 compute (`model.dtype=bfloat16`: bf16 activations and matmuls;
parameters, norms, softmax, logits, log-probs and the loss stay fp32, see model/qwen2.py). Prints
the loss, the global gradient norm, the relative L2 difference and the cosine between the two
gradients, and the largest per-tensor relative difference. This is what the `local` preset's
choice of bf16 compute rests on (docs/design.md, Memory of the local run).
"""
from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from workflow_r1.host_memory import peak_rss_gb  # noqa: E402
from workflow_r1.model import tokenizer as tokenizer_lib  # noqa: E402
from workflow_r1.policy import ModelConfig, checkpoint_dir, load  # noqa: E402
from workflow_r1 import trajectory  # noqa: E402
from workflow_r1.rl import scoring, train_state, train_step  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 4, "Rows of the batch.")
_LENGTH = flags.DEFINE_integer("length", 1024, "Tokens per row.")

_CORPUS = REPO / "workflow_r1" / "bundled" / "corpus.jsonl"


def real_batch(tokenizer, rows: int, length: int) -> trajectory.TrainBatch:
    """Rows of bundled corpus text; policy segments at [L/4, L/4 + L/8) and [L/2, L/2 + L/4)."""
    text = " ".join(json.loads(line).get("contents", "") for line in _CORPUS.open())
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < rows * length:
        ids = ids * (rows * length // max(len(ids), 1) + 1)
    tokens = np.asarray(ids[:rows * length], np.int32).reshape(rows, length)
    loss_mask = np.zeros((rows, length), np.int32)
    segments = np.full((rows, length), -1, np.int32)
    for k, (a, b) in enumerate([(length // 4, length // 4 + length // 8), (length // 2, 3 * length // 4)]):
        loss_mask[:, a:b] = 1
        segments[:, a:b] = k
    advantages = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0)
    return trajectory.make_batch(tokens, loss_mask, advantages, segment_ids=segments)


def loss_and_grads(dtype: str, batch: trajectory.TrainBatch) -> tuple[float, list[np.ndarray], np.ndarray]:
    """(loss, gradient leaves, log-probs [B, T]) of one GSsPO step with compute dtype `dtype`, fp32
    parameters. On-policy (old = current log-probs), so the loss value itself is -mean(advantage)
    whatever the dtype; the gradient and the log-probs carry the difference."""
    model, _ = load(ModelConfig(dtype=dtype, param_dtype="float32", remat=True))
    cfg = train_state.TrainConfig(granularity="subsequence", kl_coef=0.0, num_mini_batches=1)
    graphdef, params = nnx.split(model)
    del model
    # No optimizer state: only the loss and its gradient are compared.
    state = train_state.TrainState(graphdef=graphdef, params=params, opt_state=None, step=jnp.zeros((), jnp.int32))
    loss, grads, _ = train_step.make_loss_and_grads(cfg)(state, jax.tree.map(jnp.asarray, batch))
    leaves = [np.asarray(x) for x in jax.tree.leaves(grads)]
    logp = np.asarray(scoring.compute_logprobs(state, batch))
    print(f"{dtype}: loss {float(loss):.6g}, peak RSS so far {peak_rss_gb():.1f} GB", flush=True)
    return float(loss), leaves, logp


def main(argv: list[str]) -> None:
    del argv
    tokenizer = tokenizer_lib.load(checkpoint_dir(ModelConfig()))
    batch = real_batch(tokenizer, _ROWS.value, _LENGTH.value)
    loss32, g32, lp32 = loss_and_grads("float32", batch)
    loss16, g16, lp16 = loss_and_grads("bfloat16", batch)
    policy = batch.loss_mask.astype(bool)
    per_tensor = [float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)) for x, y in zip(g32, g16)]
    n32 = float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in g32)))
    n16 = float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in g16)))
    diff = float(np.sqrt(sum(np.sum(np.square(x.astype(np.float64) - y)) for x, y in zip(g32, g16))))
    dot = float(sum(np.sum(x.astype(np.float64) * y) for x, y in zip(g32, g16)))
    print(f"batch {_ROWS.value} x {_LENGTH.value}, {int(batch.loss_mask.sum())} policy tokens")
    print(f"| compute | loss | grad norm |\n|---|---|---|\n| fp32 | {loss32:.6g} | {n32:.6g} |\n"
          f"| bf16 | {loss16:.6g} | {n16:.6g} |")
    print(f"log-probs of policy tokens: mean {lp32[policy].mean():.4f} (fp32) vs {lp16[policy].mean():.4f} (bf16), "
          f"mean |difference| {np.abs(lp32 - lp16)[policy].mean():.3e}, max {np.abs(lp32 - lp16)[policy].max():.3e}")
    print(f"grad norm: relative difference {abs(n16 - n32) / n32:.3e}")
    print(f"gradient: relative L2 difference {diff / n32:.3e}, cosine {dot / (n32 * n16):.6f}, "
          f"worst tensor {max(per_tensor):.3e}")


if __name__ == "__main__":
    app.run(main)
