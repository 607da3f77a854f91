"""Shared-prompt vs unshared update and scoring (`train.share_prompts`) on the bundled 0.5B.

    .venv/bin/python benchmarks/shared_prompts.py [--shape local paper_small] [--random] [--skip-scoring]
        [--out r.json]

Shapes (one group per batch, a prompt then each sample's 3 policy turns with observations between):

- local: the `local` preset's episodes: n = 4, a 643-token prompt, ~190-token responses (~830 per
  episode), rows padded to a multiple of 256 (T = 1024); LoRA rank 16 over a frozen bf16 base,
  bf16 compute, rematerialised layers, one mini-batch, no KL, GSsPO.
- paper_small: the `paper` preset's faithful prompt (1,120 tokens) with n = 8 and shorter
  responses (~250 tokens; the paper's are up to 1,024) so that it runs on a CPU, padded to 512
  (T = 1536); the same model settings.

For each shape, in this one process and from the same initial parameters: the update (forward,
remat forward, backward, AdamW) unshared then shared, then the no-gradient scoring (the old or
reference log-probs) unshared then shared. Each program is compiled ahead of time (its compile
time reported apart) and run `--steps` times (the fastest reported); its temporaries come from
XLA's memory analysis of the compiled program (the peak working memory besides its arguments).
Positions: the token positions the matmuls run on (padding included). The first update's loss
must agree between the two paths to bf16 rounding: they compute the same objective.
"""
from __future__ import annotations

import argparse
import functools
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

from workflow_r1 import host_memory, policy, trajectory  # noqa: E402
from workflow_r1.model import qwen2  # noqa: E402
from workflow_r1.model.config import Qwen2Config  # noqa: E402
from workflow_r1.rl import scoring, shared_prompt, train_state  # noqa: E402
from workflow_r1.rl import train_step as ts  # noqa: E402

# name: (samples n, prompt tokens, response tokens per sample, pad multiple)
SHAPES = {"local": (4, 643, [170, 190, 210, 187], 256),
          "paper_small": (8, 1120, [200, 230, 250, 270, 240, 260, 220, 280], 512)}


def group_batch(n: int, prompt: int, responses: list[int], pad_multiple: int, vocab: int,
                seed: int = 0) -> trajectory.TrainBatch:
    """One group: the same prompt in n right-padded rows, then per row 3 policy turns of 1/4 of its
    response with observations of 1/12 between them (random tokens: the cost does not depend on them)."""
    rng = np.random.RandomState(seed)
    t = -(-(prompt + max(responses)) // pad_multiple) * pad_multiple
    head = rng.randint(0, min(vocab, 151643), prompt)
    tokens = np.zeros((n, t), np.int32)
    input_mask = np.zeros((n, t), np.int32)
    loss_mask = np.zeros((n, t), np.int32)
    for i, r in enumerate(responses):
        end = prompt + r
        tokens[i, :prompt], tokens[i, prompt:end] = head, rng.randint(0, min(vocab, 151643), r)
        input_mask[i, :end] = 1
        turn, obs = r // 4, r // 12
        for k in range(3):
            start = prompt + k * (turn + obs)
            loss_mask[i, start:min(start + turn, end)] = 1
    return trajectory.make_batch(tokens, loss_mask, rng.randn(n).astype(np.float32), input_mask=input_mask)


def _aot(fn, *args, **kw):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args, **kw).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = None if mem is None else mem.temp_size_in_bytes / 2**30
    return compiled, compile_s, temp


def _run(compiled, steps: int, *args, **kw):
    times, out = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args, **kw))
        times.append(time.perf_counter() - t0)
    return out, min(times)


def measure(model: nnx.Module, cfg: train_state.TrainConfig, batch: trajectory.TrainBatch, steps: int,
            scoring_too: bool) -> dict:
    graphdef, params = nnx.split(model)
    state = train_state.create_train_state(nnx.merge(graphdef, jax.tree.map(jnp.copy, params)), cfg)
    share = ts.make_share_plan(batch, cfg) if cfg.share_prompts else None
    b, t = batch.shape
    out: dict = {}
    if share is None:
        out["positions"] = b * t
    else:
        out["positions"] = int(share.prompt_mask.shape[-2] * share.prompt_mask.shape[-1]
                               + share.resp_segment.size)  # b x R unpacked
        out.update(shared_prompt.plan_stats(share, (b, t)))
    update = functools.partial(ts.update, cfg=cfg)
    compiled, out["update_compile_s"], out["update_temp_gb"] = _aot(update, state.replace(frozen=None), batch,
                                                                    frozen=state.frozen, share=share)
    (_, metrics), out["update_s"] = _run(compiled, steps, state.replace(frozen=None), batch, frozen=state.frozen,
                                         share=share)
    out["loss"], out["grad_norm"] = float(metrics["loss"][0]), float(metrics["grad_norm"][0])
    print(f"  update  {out}", flush=True)
    if scoring_too:
        weights, graphdef, chunk = state.weights(), state.graphdef, cfg.logprob_chunk_size
        if share is None:
            def fn(p, batch):
                return scoring.forward_logprobs(p, graphdef, batch.tokens, batch.positions, batch.input_mask,
                                                batch.loss_mask, None, chunk, with_entropy=False)[0]
        else:
            def fn(p, batch, share):
                return scoring.forward_logprobs_shared(p, graphdef, scoring.split_rows(batch, 1, "mini-batches"),
                                                       share, cfg)
        args, kw = (weights, batch), ({} if share is None else {"share": share})
        compiled, out["score_compile_s"], out["score_temp_gb"] = _aot(fn, *args, **kw)
        logp, out["score_s"] = _run(compiled, steps, *args, **kw)
        out["score_logp_sum"] = float(jnp.sum(logp))
        print(f"  scoring {out}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=3, help="timed runs per program, the fastest reported (the first run after a compile can be much slower)")
    ap.add_argument("--random", action="store_true", help="random weights of the bundled model's shape")
    ap.add_argument("--skip-scoring", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    mcfg = policy.ModelConfig(dtype="bfloat16", param_dtype="bfloat16", lora_rank=16, remat=True)
    if args.random:
        model = policy.with_lora(qwen2.create(Qwen2Config.from_hf(policy.checkpoint_dir(mcfg)),
                                              dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat=True), mcfg)
    else:
        model, _ = policy.load(mcfg)
    base = train_state.TrainConfig(learning_rate=5e-5, granularity="subsequence", num_mini_batches=1, kl_coef=0.0)
    results: dict = {"backend": jax.default_backend(), "random_weights": args.random}
    for name in args.shape:
        n, prompt, responses, pad = SHAPES[name]
        batch = trajectory.shard_batch(group_batch(n, prompt, responses, pad, model.cfg.vocab_size), None)
        print(f"{name}: n={n} prompt={prompt} responses={responses} T={batch.shape[1]}", flush=True)
        r = {"unshared": measure(model, base, batch, args.steps, not args.skip_scoring),
             "shared": measure(model, base.replace(share_prompts=True), batch, args.steps, not args.skip_scoring)}
        u, s = r["unshared"], r["shared"]
        r["update_speedup"] = u["update_s"] / s["update_s"]
        line = (f"{name}: update {u['update_s']:.1f} s -> {s['update_s']:.1f} s ({r['update_speedup']:.2f}x), "
                f"positions {u['positions']} -> {s['positions']}, update temporaries {u['update_temp_gb']:.2f} -> "
                f"{s['update_temp_gb']:.2f} GB, loss {u['loss']:.6f} vs {s['loss']:.6f}")
        if "score_s" in s:
            r["score_speedup"] = u["score_s"] / s["score_s"]
            line += f"; scoring {u['score_s']:.1f} s -> {s['score_s']:.1f} s ({r['score_speedup']:.2f}x)"
        print(line, flush=True)
        results[name] = r
    results["peak_rss_gb"] = host_memory.peak_rss_gb()
    print(f"peak RSS {results['peak_rss_gb']:.1f} GB", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
