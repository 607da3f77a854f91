"""Our JAX sampler vs Hugging Face `generate` (torch, CPU) on the same Qwen2.5-Coder-0.5B-Instruct weights.

Measures, in one process and interleaved (ours, HF, ours, HF, best of each, so a busy machine
penalises both alike):
  * greedy decoding of the same chat prompts, batch 1 / 8 / 32, exactly `--new-tokens` tokens per
    row (EOS ignored on both sides), tokens/s = batch * new_tokens / wall time of the whole call
    (prefill included, compile excluded: one warm-up call per shape first);
  * this machine's memory read bandwidth and matmul rate, and from them the decode roofline:
    tok/s <= batch / max(bytes read per step / bandwidth, flops per step / matmul rate);
  * multi-turn: continuing rows in the KV cache after appending an observation vs re-prefilling
    the whole conversation each turn.

Usage (see benchmarks/README.md):
    .venv/bin/python benchmarks/sampler_vs_hf.py                      # full table (~15 min on 2 cores)
    .venv/bin/python benchmarks/sampler_vs_hf.py --batches 8 --new-tokens 32 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

# Before jax is imported: one CPU device (the tests use 8 simulated ones; a benchmark wants all
# cores behind a single device).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from workflow_r1 import sampler as sampler_lib  # noqa: E402
from workflow_r1.model import checkpoint, ops  # noqa: E402
from workflow_r1.sampler import fused_cpu  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in one sentence why the sky is blue.",
    "Who wrote the novel Pride and Prejudice, and in which year was it first published?",
    "List three prime numbers greater than 100.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into German.",
    "How many kilometres are there in a marathon?",
    "Give me a short haiku about autumn leaves.",
    "Which planet in the solar system has the most moons?",
    "Describe how a hash table works.",
]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def best_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


# ------------------------------------------------------------------------------------ the machine

def machine_rates(repeats: int = 7) -> dict[str, float]:
    """Read bandwidth (GB/s) and matmul rates (GFLOP/s) of this machine as XLA:CPU sees them.

    Random data on purpose: a buffer of identical pages (jnp.ones) can be deduplicated by the
    hypervisor and then read faster than real data would be.
    """
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (1 << 28,), jnp.float32)  # 1 GiB: far larger than any cache
    s = jax.jit(jnp.sum)
    s(x).block_until_ready()
    bw_sum = x.nbytes / best_time(lambda: s(x).block_until_ready(), repeats) / 1e9
    # A gemv over 1 GiB of weights: the decode pattern itself (fp32 gemv is bandwidth-bound).
    w = x.reshape(-1, 1024)
    v = jax.random.normal(key, (1, 1024), jnp.float32)
    g = jax.jit(lambda v, w: jax.lax.dot_general(v, w, (((1,), (1,)), ((), ()))))
    g(v, w).block_until_ready()
    bw_gemv = w.nbytes / best_time(lambda: g(v, w).block_until_ready(), repeats) / 1e9
    del x, w
    out = {"read_bw_sum_gbs": bw_sum, "read_bw_gemv_gbs": bw_gemv, "read_bw_gbs": max(bw_sum, bw_gemv)}
    for name, dt in DTYPES.items():
        a = jax.random.normal(key, (1024, 896), dt)
        b = jax.random.normal(key, (4864, 896), dt)
        mm = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                      preferred_element_type=jnp.float32))
        mm(a, b).block_until_ready()
        out[f"matmul_{name}_gflops"] = 2 * 1024 * 896 * 4864 / best_time(lambda: mm(a, b).block_until_ready(),
                                                                        repeats) / 1e9
    return out


def gemm_floor(cfg, batch: int, dtype, repeats: int = 5) -> dict[str, float]:
    """Seconds per decode step spent in the weight GEMMs (and their elementwise glue) alone.

    The decode step's projection GEMMs (every layer's q/k/v, o, gate/up, down, then the LM head) at
    this batch, random weights of the checkpoint's shapes, chained as in the sampler:
      * "jax_wx": `fused_cpu.dense`, the sampler's own GEMMs (weight as the GEMM's lhs, (w @ x.T).T,
        where `fused_cpu.weight_as_lhs` picks that order for this many rows and this weight; else x @ w.T);
      * "jax_xw": always x @ w.T, the textbook order;
      * "torch": torch.nn.functional.linear on the same shapes (HF's kernels, oneDNN), GEMMs only.
    No attention, sampling or per-step bookkeeping, so a decode step can be at most this fast with
    these kernels: the measured floor the step time is compared with, next to the bandwidth roofline.
    """
    import torch

    d, h, k, dh, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = [((h + 2 * k) * dh, d), (d, h * dh), (2 * m, d), (d, m)]
    key = jax.random.PRNGKey(0)
    ws = [[(0.02 * jax.random.normal(jax.random.fold_in(key, 4 * i + j), s)).astype(dtype) for j, s in enumerate(shapes)]
          for i in range(cfg.num_layers)]
    head = (0.02 * jax.random.normal(key, (cfg.vocab_size, d))).astype(dtype)

    def step(x, ws, head, form):
        def dense(a, w, out=None):  # rounded to the compute dtype, as the sampler does
            if form == "wx":
                return fused_cpu.dense(a, w, out)
            y = jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return y.astype(out or a.dtype)
        one = jnp.ones((d,), dtype)
        for qkv, o, gu, down in ws:  # with the sampler's elementwise glue (norms, SiLU) between
            a = dense(ops.rms_norm(x, one, 1e-6), qkv)[:, :d]
            x = x + dense(a, o)
            y = dense(ops.rms_norm(x, one, 1e-6), gu).astype(jnp.float32)
            x = x + dense((jax.nn.silu(y[:, :m]) * y[:, m:]).astype(dtype), down)
        return dense(ops.rms_norm(x, one, 1e-6), head, jnp.float32)

    x = jnp.ones((batch, d), dtype)
    out = {}
    for form in ("wx", "xw"):
        f = jax.jit(step, static_argnums=(3,))
        f(x, ws, head, form).block_until_ready()
        out[f"jax_{form}"] = best_time(lambda: f(x, ws, head, form).block_until_ready(), repeats)
    tdt = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}[jnp.dtype(dtype)]
    tws = [[torch.from_numpy(np.asarray(w.astype(jnp.float32))).to(tdt) for w in layer] for layer in ws]
    thead = torch.from_numpy(np.asarray(head.astype(jnp.float32))).to(tdt)
    del ws, head

    def tstep():
        xx = torch.ones(batch, d, dtype=tdt)
        for qkv, o, gu, down in tws:
            a = torch.nn.functional.linear(xx, qkv)[:, :d]
            a = torch.nn.functional.linear(a, o)
            g = torch.nn.functional.linear(a, gu)[:, :m]
            xx = a + torch.nn.functional.linear(g, down)
        return torch.nn.functional.linear(xx, thead)

    with torch.inference_mode():
        tstep()
        out["torch"] = best_time(tstep, repeats)
    return out


def decode_roofline(cfg, batch: int, context: int, dtype_bytes: int, rates: dict[str, float], dtype: str) -> float:
    """Upper bound on decode tok/s: every step reads all projection weights + the KV cache once."""
    proj = cfg.num_params - cfg.vocab_size * cfg.hidden_size  # embedding lookup reads only B rows
    if cfg.tie_word_embeddings:
        proj += cfg.vocab_size * cfg.hidden_size  # ...but the tied matrix is read whole as the LM head
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    step_bytes = proj * dtype_bytes + kv
    step_flops = 2 * batch * proj
    t = max(step_bytes / (rates["read_bw_gbs"] * 1e9), step_flops / (rates[f"matmul_{dtype}_gflops"] * 1e9))
    return batch / t


# ------------------------------------------------------------------------------------------- runs

def chat_prompts(tokenizer, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append([int(t) for t in ids])
    return out


def run_ours(sampler, prompts, new_tokens: int) -> None:
    out = sampler.generate(prompts, new_tokens, eos_ids=())
    assert all(len(t) == new_tokens for t in out.tokens)


def load_hf(ckpt: str, dtype: str):
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]).eval()


def run_hf(model, prompts, new_tokens: int, pad_id: int) -> None:
    import torch
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    assert out.shape[1] == t + new_tokens


def multiturn(sampler, tokenizer, batch: int, turns: int, gen: int, obs: int, repeats: int) -> dict[str, float]:
    """Continue-in-cache vs re-prefill for an agent loop: generate `gen`, append `obs` tokens, repeat."""
    prompts = chat_prompts(tokenizer, batch)
    rng = np.random.RandomState(0)
    observations = [[list(rng.randint(1000, 30000, obs)) for _ in range(batch)] for _ in range(turns)]

    def continued():
        s = sampler.start(prompts)
        for k in range(turns):
            sampler.generate_from(s, gen, eos_ids=())
            sampler.append(s, list(range(batch)), observations[k])
        sampler.generate_from(s, gen, eos_ids=())

    def reprefilled():
        seqs = [list(p) for p in prompts]
        for k in range(turns + 1):
            out = sampler.generate(seqs, gen, eos_ids=())
            if k < turns:
                seqs = [s + t + o for s, t, o in zip(seqs, out.tokens, observations[k])]

    continued()
    reprefilled()  # compile every shape first
    return {"continue_s": best_time(continued, repeats), "reprefill_s": best_time(reprefilled, repeats),
            "final_length": len(prompts[0]) + (turns + 1) * gen + turns * obs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint dir (default: workflow_r1.assets.ensure())")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="our compute dtypes")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="HF torch dtypes")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per configuration (best kept)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-multiturn", action="store_true")
    ap.add_argument("--skip-floor", action="store_true", help="skip the GEMM-only floor measurement")
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    args = ap.parse_args(argv)

    import torch
    import transformers

    ckpt = args.checkpoint
    if ckpt is None:
        from workflow_r1 import assets
        ckpt = str(assets.ensure())
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]
    hf_dtypes = [] if args.skip_hf else [d for d in args.hf_dtypes.split(",") if d]
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 151643
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "load_avg_start": os.getloadavg()}
    log(f"machine: {info}")
    rates = machine_rates()
    log("rates: " + ", ".join(f"{k}={v:.1f}" for k, v in rates.items()))

    results: dict[str, dict[int, float]] = {}
    mt: dict[str, float] = {}
    floors: dict[str, dict[int, dict[str, float]]] = {}
    mt_dtype = "bfloat16" if "bfloat16" in dtypes else (dtypes[0] if dtypes else None)
    cfg = None
    # One dtype at a time (ours + HF of that dtype in memory, ~5 GB for fp32), so the run fits
    # beside other work on a 24 GB machine; within a dtype, ours and HF are interleaved.
    for dt in dict.fromkeys(dtypes + hf_dtypes):
        ours = None
        if dt in dtypes:
            model = checkpoint.load(ckpt, dtype=DTYPES[dt], param_dtype=DTYPES[dt])
            ours = sampler_lib.Sampler(model, tokenizer, cache_size=2048)
            cfg = model.cfg
            del model
        hf = load_hf(ckpt, dt) if dt in hf_dtypes else None
        if ours is not None and not args.skip_floor:
            for b in batches:
                fl = gemm_floor(cfg, b, DTYPES[dt])
                floors.setdefault(dt, {})[b] = fl
                log(f"GEMM floor {dt} batch {b}: " + ", ".join(f"{k} {1e3 * v:.1f} ms/step" for k, v in fl.items()))
        for b in batches:
            prompts = chat_prompts(tokenizer, b)
            if ours is not None:
                t = time.perf_counter()
                run_ours(ours, prompts, args.new_tokens)
                log(f"ours {dt} batch {b}: warm-up (compile) {time.perf_counter() - t:.1f}s")
            for r in range(args.repeats):  # interleaved: load from other processes hits both sides
                for name, fn in (("ours", None if ours is None else lambda: run_ours(ours, prompts, args.new_tokens)),
                                 ("hf", None if hf is None else lambda: run_hf(hf, prompts, args.new_tokens, pad_id))):
                    if fn is None:
                        continue
                    c = time.process_time()
                    t = best_time(fn, 1)
                    key = f"{name}_{dt}"
                    results.setdefault(key, {})[b] = max(results.get(key, {}).get(b, 0.0), b * args.new_tokens / t)
                    log(f"{name:4s} {dt} batch {b}: {b * args.new_tokens / t:.1f} tok/s "
                        f"(cpu/wall {(time.process_time() - c) / t:.2f}, load {os.getloadavg()[0]:.1f})")
            if args.out:  # partial results survive a crash
                pathlib.Path(args.out).write_text(json.dumps({"results": results}, indent=2))
        if ours is not None and dt == mt_dtype and not args.skip_multiturn:
            mt = multiturn(ours, tokenizer, batch=8, turns=3, gen=64, obs=128, repeats=args.repeats)
            mt["dtype"] = dt
            log(f"multi-turn: {mt}")
        del ours, hf
    later = machine_rates()  # the machine is shared: keep the best rate seen (a conservative roofline)
    rates = {k: max(v, later[k]) for k, v in rates.items()}
    log("rates (best of start and end): " + ", ".join(f"{k}={v:.1f}" for k, v in rates.items()))

    # ----------------------------------------------------------------------------- the table
    ctx = max(len(p) for p in chat_prompts(tokenizer, max(batches))) + args.new_tokens
    lines = ["", f"Greedy, {args.new_tokens} new tokens per row, tokens/s (higher is better); "
             f"load average at start {info['load_avg_start'][0]:.1f}", ""]
    head = ["batch"]
    for d in dtypes:
        head += [f"ours {d}"] + ([f"HF {d}", f"ours/HF {d}"] if d in hf_dtypes else [])
    for d in hf_dtypes:
        if d not in dtypes:
            head.append(f"HF {d}")
    if hf_dtypes and dtypes:
        head += ["best ours / best HF"]
    if cfg is not None:
        head += [f"roofline {d}" for d in dtypes] + [f"% roofline {d}" for d in dtypes]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for b in batches:
        row = [str(b)]
        for d in dtypes:
            row.append(f"{results[f'ours_{d}'][b]:.1f}")
            if d in hf_dtypes:
                row += [f"{results[f'hf_{d}'][b]:.1f}", f"{results[f'ours_{d}'][b] / results[f'hf_{d}'][b]:.2f}x"]
        for d in hf_dtypes:
            if d not in dtypes:
                row.append(f"{results[f'hf_{d}'][b]:.1f}")
        if hf_dtypes and dtypes:
            best_ours = max(results[f"ours_{d}"][b] for d in dtypes)
            best_hf = max(results[f"hf_{d}"][b] for d in hf_dtypes)
            row.append(f"{best_ours / best_hf:.2f}x")
        if cfg is not None:
            roof = {d: decode_roofline(cfg, b, ctx, jnp.dtype(DTYPES[d]).itemsize, rates, d) for d in dtypes}
            row += [f"{roof[d]:.1f}" for d in dtypes] + [f"{100 * results[f'ours_{d}'][b] / roof[d]:.0f}%" for d in dtypes]
            for d in dtypes:
                results.setdefault(f"roofline_{d}", {})[b] = roof[d]
        lines.append("| " + " | ".join(row) + " |")
    if floors:
        lines += ["", "Decode step vs its GEMMs alone (ms per step; ours = wall time per generated token "
                  "position, prefill included; floor = fastest of the three GEMM-only timings):", "",
                  "| dtype | batch | GEMMs jax (sampler order) | GEMMs jax (x @ w.T) | GEMMs torch | ours step | "
                  "ours / floor | HF step |", "|---|---|---|---|---|---|---|---|"]
        for d, per_b in floors.items():
            for b, fl in per_b.items():
                step = 1e3 * b / results[f"ours_{d}"][b]
                hf_step = f"{1e3 * b / results[f'hf_{d}'][b]:.1f}" if f"hf_{d}" in results else "-"
                floor = 1e3 * min(fl.values())
                lines.append(f"| {d} | {b} | {1e3 * fl['jax_wx']:.1f} | {1e3 * fl['jax_xw']:.1f} | "
                             f"{1e3 * fl['torch']:.1f} | {step:.1f} | {floor / step:.0%} | {hf_step} |")
    print("\n".join(lines), flush=True)

    if mt:
        print(f"\nMulti-turn ({mt['dtype']}, batch 8, 4 generations of 64 tokens with 3 appended 128-token "
              f"observations, final length {mt['final_length']}): continue-in-cache {mt['continue_s']:.1f}s, "
              f"re-prefill {mt['reprefill_s']:.1f}s ({mt['reprefill_s'] / mt['continue_s']:.2f}x)", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"info": info, "rates": rates, "results": results, "multiturn": mt, "gemm_floor": floors,
             "args": vars(args), "load_avg_end": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
