"""Chat with a Qwen2 checkpoint through the JAX sampler; prints the answer and tokens/s.

    python -m workflow_r1.generate --checkpoint=DIR --prompt="What is the capital of France?"
    python -m workflow_r1.generate --prompt="Hi" --prompt="2+2=" --max_new_tokens=64 --temperature=0.7
    python -m workflow_r1.generate --prompt="..." --stop="</answer>" --dtype=float32 --repeat=2

Without --checkpoint the bundled Qwen2.5-Coder-0.5B-Instruct is used (built on first use by workflow_r1.assets).
Each --prompt is one user message with the checkpoint's chat template applied; several prompts are
generated as one batch. The first call includes compilation; use --repeat=2 for a warm timing.
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workflow_r1.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint directory (default: the bundled assets.DEFAULT_MODEL)")
    ap.add_argument("--prompt", action="append", required=True, help="user message (repeat for a batch)")
    ap.add_argument("--system", default=None, help="optional system message")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top_p", type=float, default=1.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable), kept in the output")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--cache_size", type=int, default=4096, help="most tokens per row, prompt included")
    ap.add_argument("--repeat", type=int, default=1, help="generate this many times (later calls are warm)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import jax.numpy as jnp

    from workflow_r1 import sampler as sampler_lib
    from workflow_r1.executor.backends import load_sampler

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
        prompts = [sampler.encode_chat(m) for m in items]
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
                    print(sampler.decode(toks, reason, args.stop))
            print(f"[{'first call, incl. compile' if rep == 0 else f'call {rep + 1}'}] {n} tokens in {dt:.2f}s: "
                  f"{n / dt:.1f} tokens/s; finish: {', '.join(out.finish_reason)}", file=sys.stderr)
    except sampler_lib.SamplerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
