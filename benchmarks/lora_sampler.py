"""Decoding a LoRA policy: merged weights (what the rollout sampler runs) against the adapters kept apart.

    .venv/bin/python benchmarks/lora_sampler.py [--batches 4,32] [--context 1024] [--steps 32]

The bundled Qwen2.5-Coder-0.5B-Instruct with the `local` preset's model section (rank-16 adapters on
all seven projections over a bf16 base, bf16 compute); the adapters' B factors are set to small
random values, so merging changes every targeted kernel. For each decode batch B, the time of one
decode step (one new token per row, each row holding `--context` tokens in its KV cache), best of 3
runs of `--steps` steps, compile excluded:

  unmerged  the NNX model's forward with its adapters (two extra rank-r products per projection);
  merged    the same forward on `lora.merge(model)` (the base model's cost);
  fused     the sampler's fused CPU path on the merged weights (`Sampler.generate`; what rollouts
            run on a CPU): time(context-token prompts + 1 + steps tokens) - time(the same + 1 token).

The merged weights cost one merge per training step (`Sampler.update_params` on the LoRA model:
`lora.merge` + the fused path's re-layout), which is printed too; the table's last column is the
merge cost in decode steps of the unmerged path saved, i.e. how many tokens a step must decode
for merging to pay.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from absl import app, flags  # noqa: E402

_BATCHES = flags.DEFINE_list("batches", ["4", "32"], "decode batch sizes (rows)")
_CONTEXT = flags.DEFINE_integer("context", 1024, "tokens already in each row's KV cache")
_STEPS = flags.DEFINE_integer("steps", 32, "decode steps per timed run")
_PRESET = flags.DEFINE_string("model_preset", "", "'' = the bundled 0.5B; 'tiny-chat' for a smoke run")


def _best(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from workflow_r1 import policy
    from workflow_r1.model import lora
    from workflow_r1.sampler import Sampler, fused_cpu

    print(f"jax {jax.__version__}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", flush=True)
    model, tokenizer = policy.load(policy.ModelConfig(preset=_PRESET.value, dtype="bfloat16", param_dtype="bfloat16",
                                                      lora_rank=16))
    key = jax.random.key(0)
    for i, (_, _, ad) in enumerate(lora.adapters(model)):
        ad.b.set_value(0.01 * jax.random.normal(jax.random.fold_in(key, i), ad.b.get_value().shape, jnp.float32))
    merged = lora.merge(model)
    ctx, steps = _CONTEXT.value, _STEPS.value

    def decode(params, graphdef, tokens, cache):
        m = nnx.merge(graphdef, params)

        def body(carry, _):
            tok, cache = carry
            positions = cache.end[:, None]
            logits, cache = m(tok, positions, cache=cache)
            return (jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache), None

        (tok, cache), _ = jax.lax.scan(body, (tokens, cache), None, length=steps)
        return tok, cache

    decode = jax.jit(decode, static_argnums=1)

    def merge() -> None:  # what `Sampler.update_params` does with the LoRA model each training step
        merged_params = nnx.split(lora.merge(model))[1]
        jax.block_until_ready(fused_cpu.weights(merged_params, model.cfg, jnp.bfloat16))
    rows = []
    rng = np.random.default_rng(0)
    for b in (int(x) for x in _BATCHES.value):
        times = {}
        for name, m in (("unmerged", model), ("merged", merged)):
            graphdef, params = nnx.split(m)
            cache = m.init_cache(b, ctx + steps + 1, jnp.bfloat16)
            cache = cache.replace(valid=cache.valid.at[:, :ctx].set(True), end=jnp.full((b,), ctx, jnp.int32))
            tokens = jnp.asarray(rng.integers(0, min(1000, model.cfg.vocab_size), (b, 1)), jnp.int32)
            jax.block_until_ready(decode(params, graphdef, tokens, cache))  # compile
            times[name] = _best(lambda: jax.block_until_ready(decode(params, graphdef, tokens, cache))) / steps
        sampler = Sampler(model, tokenizer, cache_size=ctx + steps + 64, dtype=jnp.bfloat16)
        prompts = rng.integers(0, min(1000, model.cfg.vocab_size), (b, ctx)).tolist()
        for n in (1, steps + 1):  # compile both
            sampler.generate(prompts, n, eos_ids=())
        short = _best(lambda: sampler.generate(prompts, 1, eos_ids=()))
        long = _best(lambda: sampler.generate(prompts, steps + 1, eos_ids=()))
        times["fused"] = (long - short) / steps
        merge()  # compile
        merge_s = _best(merge)
        rows.append((b, times, merge_s))
        print(b, {k: f"{v * 1e3:.1f} ms" for k, v in times.items()}, f"merge {merge_s:.2f} s", flush=True)
    print(f"\ncontext {ctx} tokens, {steps} decode steps per run, best of 3; load {os.getloadavg()[0]:.2f}\n")
    print("| batch | unmerged ms/step | merged ms/step | fused (sampler) ms/step | unmerged / merged | "
          "unmerged / fused | merge per training step (s) | merge = unmerged-over-fused steps |")
    print("|---|---|---|---|---|---|---|---|")
    for b, t, merge_s in rows:
        saved = t["unmerged"] - t["fused"]
        pays = f"{merge_s / saved:.0f}" if saved > 0 else "never"
        print(f"| {b} | {t['unmerged'] * 1e3:.1f} | {t['merged'] * 1e3:.1f} | {t['fused'] * 1e3:.1f} | "
              f"{t['unmerged'] / t['merged']:.2f}x | {t['unmerged'] / t['fused']:.2f}x | {merge_s:.2f} | {pays} |")


if __name__ == "__main__":
    app.run(main)
