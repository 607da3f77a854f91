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

Peer, measured in the same run (when torch sees a GPU; `--no_peers` skips it): the same step in
PyTorch on HF `Qwen2ForCausalLM` from the same random-init config (sdpa attention, autocast bf16 over
fp32 master weights, full-vocabulary logits, the GSsPO loss of benchmarks/train_step.py, grad clip,
fused AdamW; gradient checkpointing when ours remats), and HF `generate` (greedy, bf16, its default
cache) on the same prompts. Each peer runs in its own process (JAX is told not to preallocate the
GPU, so both fit). Ratios are peer time / our time.

Peaks come from a table of common devices (`--peak_tflops`, `--peak_tbps` override it). `--budget_s`
(default 360) bounds the whole run: a measurement that would start too late is skipped and says so,
and the JSON (`--out`) is rewritten after every row, so a run cut short keeps what it measured; a
measurement that fails prints one line and the rest still run. `--smoke` runs a tiny model on any
backend (the test suite uses it to keep the script working on CPU-only CI).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
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
from workflow_r1 import trajectory  # noqa: E402
from workflow_r1.rl import train_state, train_step as ts  # noqa: E402
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


def train_batch(vocab: int, rows: int, length: int) -> trajectory.TrainBatch:
    """Random tokens; the second half of every row is one policy turn; old log-probs -2."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, vocab, (rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), np.int32)
    mask[:, length // 2:] = 1
    batch = trajectory.make_batch(tokens, mask, rng.randn(rows).astype(np.float32))
    return batch.replace(old_logprobs=np.where(mask == 1, -2.0, 0.0).astype(np.float32))


def train_step_bench(preset: str, rows: int, length: int, reps: int, remat: bool) -> dict:
    cfg_m = get_preset(preset)
    cfg = train_state.TrainConfig(num_mini_batches=1, kl_coef=0.0)
    state = train_state.create_train_state(qwen2.create(cfg_m, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                                        remat=remat), cfg)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))
    batch = trajectory.shard_batch(train_batch(cfg_m.vocab_size, rows, length), None)
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
    return dict(preset=preset, impl="ours", params=n_params, rows=rows, length=length, step_s=t,
                compile_s=compile_s, model_tflops=6 * n_params * rows * length / t / 1e12)


def decode_prompts(vocab: int, batch: int, prompt: int) -> list[list[int]]:
    rng = np.random.RandomState(batch)
    return [[int(t) for t in rng.randint(0, vocab, prompt)] for _ in range(batch)]


def decode_row(preset: str, impl: str, batch: int, prompt: int, new: int, t1: float, tn: float,
               weight_bytes: int) -> dict:
    """Decode time = time(1 + new tokens) - time(1 token); bytes = weights + the KV cache read per step."""
    cfg_m = get_preset(preset)
    decode = max(tn - t1, 1e-9)
    ctx = prompt + new / 2  # every layer's K and V over the average context during decoding
    kv_bytes = 2 * cfg_m.num_layers * cfg_m.num_kv_heads * cfg_m.head_dim * 2 * ctx * batch
    return dict(preset=preset, impl=impl, batch=batch, prefill_s=t1, decode_s=decode, tok_s=batch * new / decode,
                step_ms=1e3 * decode / new, tbps=(weight_bytes + kv_bytes) * new / decode / 1e12)


def decode_bench(preset: str, batch: int, prompt: int, new: int) -> dict:
    cfg_m = get_preset(preset)
    model = qwen2.create(cfg_m, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    # Every weight is read once per decode step (a tied embedding once, as the output head).
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.split(model)[1]))
    # The model path on accelerators; on a CPU (--smoke) the sampler's own CPU path.
    sampler = Sampler(model, cache_size=prompt + new + 64, impl="model" if jax.default_backend() != "cpu" else "auto")
    prompts = decode_prompts(cfg_m.vocab_size, batch, prompt)
    for n in (1, 1 + new):  # compile both lengths first
        sampler.generate(prompts, n, eos_ids=())
    t1 = timed(lambda: sampler.generate(prompts, 1, eos_ids=()), 2)
    tn = timed(lambda: sampler.generate(prompts, 1 + new, eos_ids=()), 2)
    return decode_row(preset, "ours", batch, prompt, new, t1, tn, weight_bytes)


# ---------------------------------------------------------------- the PyTorch peer (own process)

def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_model(preset: str, dtype):
    import torch
    import transformers
    cfg_m = get_preset(preset)
    config = transformers.Qwen2Config(
        vocab_size=cfg_m.vocab_size, hidden_size=cfg_m.hidden_size, intermediate_size=cfg_m.intermediate_size,
        num_hidden_layers=cfg_m.num_layers, num_attention_heads=cfg_m.num_heads,
        num_key_value_heads=cfg_m.num_kv_heads, rope_theta=cfg_m.rope_theta, rms_norm_eps=cfg_m.rms_norm_eps,
        tie_word_embeddings=cfg_m.tie_word_embeddings, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(torch_device()):
        return transformers.Qwen2ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")


def torch_train(preset: str, rows: int, length: int, reps: int, remat: bool) -> dict:
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    from train_step import CLIP, torch_gsspo_loss
    model = hf_model(preset, torch.float32)
    model.train()
    model.config.use_cache = False
    if remat:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=True)  # fp32 master weights
    b = train_batch(get_preset(preset).vocab_size, rows, length)
    t = {k: torch.from_numpy(np.array(getattr(b, k))).to(torch_device()) for k in
         ("tokens", "input_mask", "positions", "loss_mask", "segment_ids", "old_logprobs", "advantages")}
    tokens = t["tokens"].long()

    def one():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch_device(), dtype=torch.bfloat16):
            logits = model(input_ids=tokens, attention_mask=t["input_mask"].long(),
                           position_ids=t["positions"].long()).logits
        loss = torch_gsspo_loss(logits.float(), tokens, t["loss_mask"], t["segment_ids"].long(),
                                t["old_logprobs"], t["advantages"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        torch_sync()

    t0 = time.perf_counter()
    one()
    warm = time.perf_counter() - t0
    step_s = timed(one, reps)
    n_params = sum(p.numel() for p in model.parameters())
    return dict(preset=preset, impl="torch", params=n_params, rows=rows, length=length, step_s=step_s,
                compile_s=warm, model_tflops=6 * n_params * rows * length / step_s / 1e12,
                peak_gb=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)


def hf_decode(preset: str, batch: int, prompt: int, new: int) -> dict:
    import torch
    model = hf_model(preset, torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor(decode_prompts(get_preset(preset).vocab_size, batch, prompt), device=torch_device())

    def gen(n: int):
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        torch_sync()

    for n in (1, 1 + new):
        gen(n)
    t1 = timed(lambda: gen(1), 2)
    tn = timed(lambda: gen(1 + new), 2)
    return decode_row(preset, "hf", batch, prompt, new, t1, tn, weight_bytes)


# The peer worker's result: the last stdout line that starts with this (no file to leave behind if it is killed).
PEER_RESULT = "peer result: "


def peer(args: argparse.Namespace, what: str, preset: str, batch: int = 0) -> dict:
    """Runs one peer measurement in a fresh process (its own CUDA context; freed when it exits)."""
    cmd = [sys.executable, __file__, f"--peer_worker={what}:{preset}:{batch}", f"--train_shape={args.train_shape}",
           f"--prompt={args.prompt}", f"--new={args.new}", f"--reps={args.reps}",
           "--remat" if args.remat else "--no-remat"]
    # The peer's own JAX use (building the batch) stays on the host: the GPU is torch's there.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(args.deadline - time.time(), 1),
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    results = [line[len(PEER_RESULT):] for line in proc.stdout.splitlines() if line.startswith(PEER_RESULT)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}")
    return json.loads(results[-1])


def run_peer_worker(args: argparse.Namespace) -> None:
    what, preset, batch = args.peer_worker.split(":")
    rows, length = (int(x) for x in args.train_shape.split("x"))
    r = (torch_train(preset, rows, length, args.reps, args.remat) if what == "train"
         else hf_decode(preset, int(batch), args.prompt, args.new))
    print(PEER_RESULT + json.dumps(r), flush=True)


# ---------------------------------------------------------------- the run

def torch_here(gpu: bool) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() or not gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--train_shape", default="8x1024", help="B x T tokens of the train step")
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 64, 256], help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                    help="recompute activations in the backward (ours: model.remat; the peer: HF "
                         "gradient checkpointing)")
    ap.add_argument("--no_peers", action="store_true", help="skip the PyTorch peer")
    ap.add_argument("--budget_s", type=float, default=360.0, help="skip what would start after this many seconds")
    ap.add_argument("--peak_tflops", type=float, help="dense bf16 peak of the device (default: table)")
    ap.add_argument("--peak_tbps", type=float, help="HBM bandwidth of the device in TB/s (default: table)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny shapes, any backend")
    ap.add_argument("--out", help="also write the results as JSON here (after every row)")
    ap.add_argument("--peer_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        return run_peer_worker(args)
    t_start = time.time()
    args.deadline = t_start + args.budget_s
    dev = jax.devices()[0]
    if args.smoke:
        args.presets, args.train_shape, args.batches, args.prompt, args.new, args.reps = \
            ["tiny"], "2x64", [2], 16, 8, 1
    elif dev.platform == "cpu":
        sys.exit("benchmarks/gpu.py: no accelerator found (jax sees only the CPU); install jax[cuda12] "
                 "(bash benchmarks/gpu.sh does) or pass --smoke")
    # The peer needs torch on the same kind of device (--smoke: the CPU is enough).
    peers = not args.no_peers and torch_here(gpu=not args.smoke)
    peak_f, peak_b = device_peaks(dev.device_kind, args.peak_tflops, args.peak_tbps)
    print(f"device: {dev.device_kind} ({dev.platform}, {jax.device_count()} visible), jax {jax.__version__}; "
          f"peaks: {peak_f or '?'} TFLOP/s bf16, {peak_b or '?'} TB/s; peer: "
          f"{'torch' if peers else 'none'}; remat {args.remat}; budget {args.budget_s:.0f} s", flush=True)
    rows, length = (int(x) for x in args.train_shape.split("x"))
    results: dict = {"device": dev.device_kind, "jax": jax.__version__, "peak_tflops": peak_f, "peak_tbps": peak_b,
                     "remat": args.remat, "train": [], "decode": [], "skipped": [], "failed": []}

    def save() -> None:
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(results, indent=1))

    def attempt(name: str, fn, need_s: float):
        """fn() unless fewer than need_s seconds of the budget are left; one line on failure."""
        if time.time() + need_s > args.deadline:
            print(f"  skipped {name}: under {need_s:.0f} s of the budget left", flush=True)
            results["skipped"].append(name)
            save()
            return None
        try:
            return fn()
        except Exception as e:  # a failed measurement must not lose the others
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
            print(f"  FAILED {name}: {msg}", flush=True)
            results["failed"].append(f"{name}: {msg}")
            save()
            return None

    def pair(name: str, kind: str, ours_fn, peer_fn, need_s: float, time_key: str, row) -> None:
        """Ours, then the peer (when there is one); one table row each, the peer's with its ratio."""
        ours = attempt(f"{name} ours", ours_fn, need_s)
        theirs = attempt(f"{name} {'torch' if kind == 'train' else 'hf'}", peer_fn, need_s) if peers else None
        for r in (ours, theirs):
            if r:
                results[kind].append(r)
                ratio = f"{r[time_key] / ours[time_key]:.2f}x" if ours and r is theirs else "-"
                print(f"{row(r)} {ratio} |", flush=True)
        save()

    mfu = lambda r: f"{100 * r['model_tflops'] / peak_f:.1f}%" if peak_f else "?"  # noqa: E731
    pct = lambda r: f"{100 * r['tbps'] / peak_b:.0f}%" if peak_b else "?"  # noqa: E731
    for p in args.presets:
        print(f"\n{p} train step, {rows} x {length}, bf16 compute, fp32 master weights\n"
              "| impl | params | step (s) | TFLOP/s | MFU | first step (s) | peer / ours |\n|---|---|---|---|---|---|---|",
              flush=True)
        pair(f"{p} train", "train", lambda: train_step_bench(p, rows, length, args.reps, args.remat),
             lambda: peer(args, "train", p), 45, "step_s",
             lambda r: f"| {r['impl']} | {r['params'] / 1e6:.0f}M | {r['step_s']:.3f} | {r['model_tflops']:.1f} | "
                       f"{mfu(r)} | {r['compile_s']:.0f} |")
        print(f"\n{p} decode, prompt {args.prompt}, {args.new} new tokens, bf16 weights and cache\n"
              "| impl | batch | prefill (s) | decode ms/step | tok/s | TB/s | % HBM peak | peer / ours |\n"
              "|---|---|---|---|---|---|---|---|", flush=True)
        for b in args.batches:
            pair(f"{p} decode {b}", "decode", lambda: decode_bench(p, b, args.prompt, args.new),
                 lambda: peer(args, "decode", p, b), 40, "decode_s",
                 lambda r: f"| {r['impl']} | {r['batch']} | {r['prefill_s']:.3f} | {r['step_ms']:.2f} | "
                           f"{r['tok_s']:.0f} | {r['tbps']:.2f} | {pct(r)} |")
    print(f"\ntotal {time.time() - t_start:.0f} s", flush=True)
    save()
    if results["failed"]:
        sys.exit(f"benchmarks/gpu.py: {len(results['failed'])} measurement(s) failed: " + "; ".join(results["failed"]))


if __name__ == "__main__":
    main()
