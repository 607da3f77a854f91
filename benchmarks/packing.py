"""Packed vs unpacked update at the episode lengths of real local runs.

    .venv/bin/python benchmarks/packing.py [--lengths 900 1000 1100 1280] [--pad-multiple 512]
        [--pack-tokens 2560 4352] [--dtype bfloat16] [--lora-rank 16] [--steps 2] [--random]
        [--out r.json]

One update (forward + backward of the GSsPO loss, grad-norm clip, AdamW; one mini-batch, no KL,
rematerialised layers) on the bundled Qwen2.5-Coder-0.5B-Instruct (`--random`: random weights of
the same shape, the same cost) with bf16 compute, as the `local` preset trains it: rank-16 LoRA
adapters (fp32, with their AdamW moments) over a frozen bf16 base; `--lora-rank 0` trains every
parameter in fp32. For episodes of the given lengths:

- unpacked: one row per episode, padded to a multiple of `--pad-multiple` (as `rollout.pad_multiple`
  pads the training batch today);
- packed: `train.pack_tokens` = each value of `--pack-tokens` (first-fit-decreasing rows).

Each episode: a prompt of a quarter of its length, then 3 policy turns with observations between
(`benchmarks/train_step.synthetic_batch`'s shape, per episode). Every configuration runs in this
process one after the other from the same initial parameters (a fresh optimizer each); the first
step (compile) is reported separately, then the fastest of `--steps` steps. The first update's
loss must agree across configurations (to bf16 rounding): they compute the same objective.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from workflow_r1 import host_memory, policy  # noqa: E402
from workflow_r1.model import qwen2  # noqa: E402
from workflow_r1.model.config import Qwen2Config  # noqa: E402
from workflow_r1 import trajectory  # noqa: E402
from workflow_r1.rl import packed  # noqa: E402
from workflow_r1.rl import train_state, train_step as ts  # noqa: E402


def episode_batch(lengths: list[int], pad_multiple: int, vocab: int, seed: int = 0) -> trajectory.TrainBatch:
    """Right-padded rows of the given real lengths; per episode a prompt (L/4), then 3 policy turns
    of 3L/16 tokens with L/16-token observations between them."""
    rng = np.random.RandomState(seed)
    t = -(-max(lengths) // pad_multiple) * pad_multiple
    b = len(lengths)
    tokens = rng.randint(0, min(vocab, 151643), (b, t)).astype(np.int32)
    input_mask = np.zeros((b, t), np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    for i, n in enumerate(lengths):
        input_mask[i, :n] = 1
        prompt, turn = n // 4, 3 * n // 16
        for k in range(3):
            start = prompt + k * (turn + n // 16)
            loss_mask[i, start:min(start + turn, n)] = 1
    tokens = np.where(input_mask > 0, tokens, 0)
    return trajectory.make_batch(tokens, loss_mask, rng.randn(b).astype(np.float32), input_mask=input_mask)


def time_update(model: nnx.Module, cfg: train_state.TrainConfig, batch: trajectory.TrainBatch, steps: int) -> dict:
    graphdef, params = nnx.split(model)
    state = train_state.create_train_state(nnx.merge(graphdef, jax.tree.map(jnp.copy, params)), cfg)
    step = ts.make_train_step(cfg)
    plan = ts.make_plan(batch, cfg) if cfg.pack_tokens else None
    t0 = time.perf_counter()
    state, metrics = step(state, batch, plan)
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, _ = step(state, batch, plan)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    shape = batch.shape if plan is None else (plan.rows, cfg.pack_tokens)
    out = dict(rows=int(shape[0]), row_tokens=int(shape[1]), positions=int(shape[0] * shape[1]),
               compile_and_first_s=first, step_s=min(times) if times else first,
               loss=float(metrics["loss"][0]), grad_norm=float(metrics["grad_norm"][0]))
    if plan is not None:
        out.update(packed.plan_stats(plan))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[900, 1000, 1100, 1280])
    ap.add_argument("--pad-multiple", type=int, default=512)
    ap.add_argument("--pack-tokens", type=int, nargs="+", default=[2560, 4352])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="compute dtype")
    ap.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning with fp32 parameters")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--random", action="store_true", help="random weights of the bundled model's shape")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    # The local preset's model section: LoRA over a frozen bf16 base (or every parameter in fp32).
    mcfg = policy.ModelConfig(dtype=args.dtype, param_dtype="bfloat16" if args.lora_rank else "float32",
                              lora_rank=args.lora_rank)
    if args.random:
        model = policy.with_lora(qwen2.create(Qwen2Config.from_hf(policy.checkpoint_dir(mcfg)),
                                              dtype=policy.DTYPES[mcfg.dtype],
                                              param_dtype=policy.DTYPES[mcfg.param_dtype]), mcfg)
    else:
        model, _ = policy.load(mcfg)
    batch = trajectory.shard_batch(episode_batch(args.lengths, args.pad_multiple, model.cfg.vocab_size), None)
    base = train_state.TrainConfig(learning_rate=1e-6, granularity="subsequence", num_mini_batches=1, kl_coef=0.0, remat=True)
    real = int(sum(args.lengths))
    results = {"lengths": args.lengths, "real_tokens": real, "dtype": args.dtype, "lora_rank": args.lora_rank,
               "backend": jax.default_backend()}
    results["unpacked"] = time_update(model, base, batch, args.steps)
    print(f"unpacked      {results['unpacked']}", flush=True)
    for p in args.pack_tokens:
        r = time_update(model, base.replace(pack_tokens=p), batch, args.steps)
        r["speedup"] = results["unpacked"]["step_s"] / r["step_s"]
        results[f"packed_{p}"] = r
        print(f"packed {p:<6} {r}", flush=True)
        print(f"  unpacked / packed step time: {r['speedup']:.2f}x  (positions {results['unpacked']['positions']} "
              f"-> {r['positions']}, {real} real)", flush=True)
    results["peak_rss_gb"] = host_memory.peak_rss_gb()
    print(f"peak RSS {results['peak_rss_gb']:.1f} GB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
