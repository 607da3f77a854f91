"""Chat with a Qwen2 checkpoint through the JAX sampler; prints the answer and tokens/s.

    python -m workflow_r1.generate --checkpoint=DIR --prompt="What is the capital of France?"
    python -m workflow_r1.generate --prompt="Hi" --prompt="2+2=" --max_new_tokens=64 --temperature=0.7
    python -m workflow_r1.generate --prompt="..." --stop="</answer>" --dtype=float32 --repeat=2

Without --checkpoint the bundled Qwen2.5-Coder-0.5B-Instruct is used (built on first use by workflow_r1.assets).
Each --prompt is one user message with the checkpoint's chat template applied; several prompts are
generated as one batch. The first call includes compilation; use --repeat=2 for a warm timing.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (default: the bundled model)")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "user message (repeat for a batch)", required=True)
_SYSTEM = flags.DEFINE_string("system", None, "optional system message")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256, "tokens to generate per prompt", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy", lower_bound=0.0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus mass in (0, 1]")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off", lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_STOP = flags.DEFINE_multi_string("stop", [], "stop string (repeatable), kept in the output")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "compute dtype")
_CACHE_SIZE = flags.DEFINE_integer("cache_size", 4096, "most tokens per row, prompt included", lower_bound=2)
_REPEAT = flags.DEFINE_integer("repeat", 1, "generate this many times (later calls are warm)", lower_bound=1)


class _Args:
    """The flag values under short names."""

    def __init__(self):
        self.checkpoint, self.prompt, self.system = _CHECKPOINT.value, _PROMPT.value, _SYSTEM.value
        self.max_new_tokens, self.temperature, self.top_p = _MAX_NEW_TOKENS.value, _TEMPERATURE.value, _TOP_P.value
        self.top_k, self.seed, self.stop, self.dtype = _TOP_K.value, _SEED.value, _STOP.value, _DTYPE.value
        self.cache_size, self.repeat = _CACHE_SIZE.value, _REPEAT.value


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    args = _Args()
    import jax.numpy as jnp

    from workflow_r1 import sampler as sampler_lib
    from workflow_r1.executor.local_backend import load_sampler
    from workflow_r1.sampler import text as sampler_text

    ckpt = args.checkpoint
    if ckpt is None:
        from workflow_r1 import assets
        ckpt = str(assets.ensure())
    t0 = time.perf_counter()
    try:
        sampler = load_sampler(ckpt, dtype=getattr(jnp, args.dtype), cache_size=args.cache_size)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"loaded {ckpt} ({args.dtype}, impl={sampler.impl}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    items = [([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": p}]
             for p in args.prompt]
    try:
        prompts = [sampler_text.encode_chat(sampler, m) for m in items]
        for rep in range(max(1, args.repeat)):
            t = time.perf_counter()
            out = sampler.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                   top_k=args.top_k, seed=args.seed, stop_strings=args.stop)
            dt = time.perf_counter() - t
            n = sum(len(x) for x in out.tokens)
            if rep == 0:
                for i, (toks, reason) in enumerate(zip(out.tokens, out.finish_reason)):
                    if len(prompts) > 1:
                        print(f"--- [{i}] {args.prompt[i]!r}")
                    print(sampler_text.decode(sampler, toks, reason, args.stop))
            print(f"[{'first call, incl. compile' if rep == 0 else f'call {rep + 1}'}] {n} tokens in {dt:.2f}s: "
                  f"{n / dt:.1f} tokens/s; finish: {', '.join(out.finish_reason)}", file=sys.stderr)
    except sampler_lib.SamplerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main)
