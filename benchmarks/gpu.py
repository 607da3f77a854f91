"""One-GPU benchmark: train-step MFU and sampler decode bandwidth against the device's peaks.

    bash benchmarks/gpu.sh                       # installs what it needs, then runs this
    .venv/bin/python benchmarks/gpu.py [--presets qwen2.5-0.5b qwen2.5-1.5b] [--batches 8 64 256]

Random weights of the Qwen2.5 shapes (nothing is downloaded), on the first accelerator:
- Train step: `train_step.make_train_step` (GSsPO, clip, AdamW), fp32 master weights and bf16
  compute (`model.dtype=bfloat16`), one mini-batch of B x T tokens, half of them policy tokens.
  MFU = 6 x params x B x T / step time / the device's dense bf16 peak.
- Decode: `Sampler.generate` (greedy, bf16 weights and cache) for each batch size: a 128-token
  prompt, then N new tokens; decode time = time(1 + N tokens) - time(1 token) (prefill taken
  out). Bandwidth = (weight bytes + KV-cache bytes read per step) x N / decode time, against the
  device's HBM peak: what bounds decoding at small batch.

Peaks come from a table of common devices (`--peak_tflops`, `--peak_tbps` override it). Budget: about
4-6 minutes on an H100-class GPU, compilation included. `--smoke` runs a tiny model on any backend
(the test suite uses it to keep the script working on CPU-only CI).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from workflow_r1.model import qwen2  # noqa: E402
from workflow_r1.model.config import get_preset  # noqa: E402
from workflow_r1.rl import batch as batch_lib  # noqa: E402
from workflow_r1.rl import train_step as ts  # noqa: E402
from workflow_r1.sampler.sampler import Sampler  # noqa: E402

# device_kind substring -> (dense bf16 TFLOP/s, HBM TB/s), vendor datasheet figures (SXM where both).
PEAKS = [
    ("H200", 989.0, 4.8), ("H100 PCIe", 756.0, 2.0), ("H100", 989.0, 3.35), ("GH200", 989.0, 4.0),
    ("B200", 2250.0, 8.0), ("A100-SXM4-40GB", 312.0, 1.555), ("A100-PCIE-40GB", 312.0, 1.555),
    ("A100", 312.0, 2.039), ("L40S", 362.0, 0.864), ("L4", 121.0, 0.3), ("A10", 125.0, 0.6),
    ("RTX 4090", 165.0, 1.008), ("TPU v5 lite", 197.0, 0.819), ("TPU v5", 459.0, 2.765), ("TPU v4", 275.0, 1.2),
    ("TPU v6", 918.0, 1.64),
]


def device_peaks(kind: str, tflops: float | None, tbps: float | None) -> tuple[float | None, float | None]:
    for name, f, b in PEAKS:
        if name.lower() in kind.lower():
            return tflops or f, tbps or b
    return tflops, tbps


def timed(fn, reps: int) -> float:
    """Best wall time of `reps` calls of fn() (each blocks until its results are ready)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def train_step_bench(preset: str, rows: int, length: int, reps: int) -> dict:
    cfg_m = get_preset(preset)
    cfg = ts.TrainConfig(num_mini_batches=1, kl_coef=0.0, remat=True)
    state = ts.create_train_state(qwen2.create(cfg_m, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.float32), cfg)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg_m.vocab_size, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.int32)
    mask[:, length // 2:] = 1
    batch = batch_lib.make_batch(tokens, mask, rng.randn(rows).astype(np.float32))
    batch = batch.replace(old_logprobs=np.where(mask == 1, -2.0, 0.0).astype(np.float32))
    batch = batch_lib.shard_batch(batch, None)
    step = ts.make_train_step(cfg)
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0

    def one():
        nonlocal state
        state, _ = step(state, batch)
        jax.block_until_ready(state)

    t = timed(one, reps)
    return dict(preset=preset, params=n_params, rows=rows, length=length, step_s=t, compile_s=compile_s,
                model_tflops=6 * n_params * rows * length / t / 1e12)


def decode_bench(preset: str, batches: list[int], prompt: int, new: int) -> list[dict]:
    cfg_m = get_preset(preset)
    model = qwen2.create(cfg_m, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    # Every weight is read once per decode step (a tied embedding once, as the output head).
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.split(model)[1]))
    # The model path on accelerators; on a CPU (--smoke) the sampler's own CPU path.
    sampler = Sampler(model, cache_size=prompt + new + 64, impl="model" if jax.default_backend() != "cpu" else "auto")
    rng = np.random.RandomState(0)
    out = []
    for b in batches:
        prompts = [list(rng.randint(0, cfg_m.vocab_size, prompt)) for _ in range(b)]
        for n in (1, 1 + new):  # compile both lengths first
            sampler.generate(prompts, n, eos_ids=())
        t1 = timed(lambda: sampler.generate(prompts, 1, eos_ids=()), 2)
        tn = timed(lambda: sampler.generate(prompts, 1 + new, eos_ids=()), 2)
        decode = max(tn - t1, 1e-9)
        # KV bytes read per step: every layer's K and V for the average context during decoding.
        ctx = prompt + new / 2
        kv_bytes = 2 * cfg_m.num_layers * cfg_m.num_kv_heads * cfg_m.head_dim * 2 * ctx * b
        out.append(dict(preset=preset, batch=b, prefill_s=t1, decode_s=decode, tok_s=b * new / decode,
                        step_ms=1e3 * decode / new, tbps=(weight_bytes + kv_bytes) * new / decode / 1e12))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--train_shape", default="8x1024", help="B x T tokens of the train step")
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 64, 256], help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peak_tflops", type=float, help="dense bf16 peak of the device (default: table)")
    ap.add_argument("--peak_tbps", type=float, help="HBM bandwidth of the device in TB/s (default: table)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny shapes, any backend")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    dev = jax.devices()[0]
    if args.smoke:
        args.presets, args.train_shape, args.batches, args.prompt, args.new, args.reps = \
            ["tiny"], "2x64", [2], 16, 8, 1
    elif dev.platform == "cpu":
        sys.exit("benchmarks/gpu.py: no accelerator found (jax sees only the CPU); install jax[cuda12] "
                 "(bash benchmarks/gpu.sh does) or pass --smoke")
    peak_f, peak_b = device_peaks(dev.device_kind, args.peak_tflops, args.peak_tbps)
    print(f"device: {dev.device_kind} ({dev.platform}, {jax.device_count()} visible), jax {jax.__version__}; "
          f"peaks: {peak_f or '?'} TFLOP/s bf16, {peak_b or '?'} TB/s", flush=True)
    rows, length = (int(x) for x in args.train_shape.split("x"))
    results: dict = {"device": dev.device_kind, "peak_tflops": peak_f, "peak_tbps": peak_b, "train": [], "decode": []}
    t_start = time.perf_counter()
    print("\n| model | params | B x T | step (s) | TFLOP/s | MFU | compile (s) |\n|---|---|---|---|---|---|---|")
    for p in args.presets:
        r = train_step_bench(p, rows, length, args.reps)
        results["train"].append(r)
        mfu = f"{100 * r['model_tflops'] / peak_f:.1f}%" if peak_f else "?"
        print(f"| {p} | {r['params'] / 1e6:.0f}M | {rows} x {length} | {r['step_s']:.3f} | {r['model_tflops']:.1f} | "
              f"{mfu} | {r['compile_s']:.0f} |", flush=True)
    print(f"\n| model | batch | prefill {args.prompt} (s) | decode ms/step | tok/s | TB/s | % HBM peak |\n"
          "|---|---|---|---|---|---|---|")
    for p in args.presets:
        for r in decode_bench(p, args.batches, args.prompt, args.new):
            results["decode"].append(r)
            pct = f"{100 * r['tbps'] / peak_b:.0f}%" if peak_b else "?"
            print(f"| {p} | {r['batch']} | {r['prefill_s']:.3f} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | "
                  f"{r['tbps']:.2f} | {pct} |", flush=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
