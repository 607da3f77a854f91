"""Train-step throughput: our jitted GSsPO step (JAX) vs the same step in PyTorch on HF Qwen2.

    .venv/bin/python benchmarks/train_step.py [--shapes 2x256 4x256 2x512] [--steps 2] [--random]

One step = forward + backward of the GSsPO (sub-sequence) loss + grad-norm clip 1.0 + AdamW
(lr 1e-6, wd 0.01), fp32, on the real Qwen2.5-Coder-0.5B-Instruct (`workflow_r1.assets.ensure`;
`--random` uses random weights of the same shape, which cost the same). Both frameworks load the
same parameters and the same synthetic multi-turn batch: a prompt (T/4 tokens), then 3 policy
turns with observations between them (56% of the positions are policy tokens), old log-probs = the
policy's own plus noise (ratios spread around 1). Every shape starts from the loaded weights and a fresh optimizer in both
frameworks, so the first step's loss and gradient norm, printed side by side, must agree.

PyTorch: HF `Qwen2ForCausalLM` (sdpa attention) -> full [B, T, V] logits -> log_softmax -> gather;
the loss with scatter_add over turns; `clip_grad_norm_`; `torch.optim.AdamW(fused=True)`.
JAX: `train_step.make_train_step` with its defaults (policy tokens only through the output head,
no logit recomputation at these sizes, oneDNN matmuls on CPU); `--score-all` adds a run that
scores every position like the torch version, to show what that part is worth.

Timing. The machine may be shared: every timed step also records how much CPU the *other*
processes used meanwhile (from /proc/stat), and the step time reported is the fastest step run
with under 10% of the cores busy elsewhere (else the fastest, marked '*'). Tokens/s counts every
position of the B x T batch. GFLOP/s = 6 x params x tokens / time, against the fp32 matmul rate
measured in the same run (2048^3). Target (issue): JAX >= 1.3x PyTorch on this CPU.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from workflow_r1.model import checkpoint, qwen2  # noqa: E402
from workflow_r1.model.config import Qwen2Config, get_preset  # noqa: E402
from workflow_r1.rl import batch as batch_lib  # noqa: E402
from workflow_r1.rl import train_step as ts  # noqa: E402

LR, WD, CLIP, EPS_LOW, EPS_HIGH = 1e-6, 0.01, 1.0, 0.2, 0.2
BUSY_LIMIT = 0.10  # other processes' share of the cores above which a timed step counts as disturbed


def synthetic_batch(b: int, t: int, vocab: int, seed: int = 0) -> batch_lib.TrainBatch:
    """Prompt (T/4), then 3 policy turns of (3T/16) tokens with T/16-token observations between."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, min(vocab, 151643), (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.int32)
    prompt, turn = t // 4, 3 * t // 16
    for k in range(3):
        start = prompt + k * (turn + t // 16)
        mask[:, start:start + turn] = 1
    adv = rng.randn(b).astype(np.float32)
    return batch_lib.make_batch(tokens, mask, adv)


def with_old_logprobs(batch: batch_lib.TrainBatch, logp: np.ndarray, seed: int = 1) -> batch_lib.TrainBatch:
    """old = logp + N(0, 0.05) on policy tokens: ratios near 1, a few clipped, as after an update."""
    noise = 0.05 * np.random.RandomState(seed).randn(*logp.shape).astype(np.float32)
    old = np.where(batch.loss_mask == 1, logp + noise, 0.0).astype(np.float32)
    return batch.replace(old_logprobs=old, sampler_logprobs=old)


class CpuMeter:
    """Core-seconds used by other processes while a block runs (Linux /proc), as a fraction."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")
        self.cores = os.cpu_count() or 1

    def _read(self) -> tuple[float, float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return busy / self.tick, (int(own[11]) + int(own[12])) / self.tick, time.perf_counter()

    def start(self) -> None:
        self.t0 = self._read()

    def stop(self) -> tuple[float, float, float]:
        """(wall seconds, others' busy fraction of all cores, this process's CPU seconds)."""
        b1, o1, w1 = self._read()
        b0, o0, w0 = self.t0
        wall = w1 - w0
        return wall, max(0.0, ((b1 - b0) - (o1 - o0)) / (wall * self.cores)), o1 - o0


def pick(samples: list[tuple[float, float, float]]) -> tuple[float, bool]:
    """Fastest undisturbed step time (else the fastest overall, flagged)."""
    clean = [w for w, busy, _ in samples if busy < BUSY_LIMIT]
    return (min(clean), True) if clean else (min(w for w, _, _ in samples), False)


def describe(samples: list[tuple[float, float, float]]) -> str:
    return ", ".join(f"{w:.1f}s/{100 * o:.0f}%/{c:.0f}cpu-s" for w, o, c in samples)


def matmul_gflops(n: int = 2048, reps: int = 5) -> dict[str, float]:
    """Measured fp32 [n, n] x [n, n] rate of each framework on this machine (best of reps)."""
    import torch
    out = {}
    a = jnp.asarray(np.random.randn(n, n).astype(np.float32))
    f = jax.jit(lambda x, y: x @ y, compiler_options=ts.compiler_options())
    f(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    out["jax"] = 2 * n ** 3 / min(times) / 1e9
    ta = torch.randn(n, n)
    ta @ ta
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ta @ ta
        times.append(time.perf_counter() - t0)
    out["torch"] = 2 * n ** 3 / min(times) / 1e9
    return out


def bench_jax(model_dir: Path, cfg_m: Qwen2Config, shapes, steps: int,
              score_all: bool) -> tuple[dict, dict, int]:
    """Times the JAX step per shape; every shape starts from the loaded weights and fresh AdamW."""
    cfg = ts.TrainConfig(learning_rate=LR, weight_decay=WD, max_grad_norm=CLIP, granularity="subsequence",
                         clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, num_mini_batches=1, kl_coef=0.0)

    def fresh_state() -> ts.TrainState:
        # Reloaded rather than copied: a second copy of the weights would not fit beside torch's
        # on a small shared machine.
        return ts.create_train_state(checkpoint.load(model_dir), cfg)

    state = fresh_state()
    batches = {}
    for b, t in shapes:
        batch = synthetic_batch(b, t, cfg_m.vocab_size)
        logp = np.asarray(ts.compute_logprobs(state, batch, chunk_size=cfg.logprob_chunk_size))
        batches[(b, t)] = with_old_logprobs(batch, logp)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))
    meter = CpuMeter()
    variants = [("jax", cfg)] + ([("jax score-all", cfg.replace(logprob_policy_only=False))] if score_all else [])
    results: dict = {}
    for name, vcfg in variants:
        step = ts.make_train_step(vcfg)
        for shape in (shapes if name == "jax" else shapes[:1]):
            if results:  # every shape starts from the loaded weights (the first one already does)
                del state
                gc.collect()
                state = fresh_state()
            batch = batch_lib.shard_batch(batches[shape], None)
            t0 = time.perf_counter()
            state, metrics = step(state, batch)  # compile + first step
            jax.block_until_ready(state)
            first = {k: float(metrics[k][0]) for k in ("loss", "grad_norm", "clipfrac")}
            compile_s = time.perf_counter() - t0
            samples = []
            for _ in range(steps):
                meter.start()
                state, metrics = step(state, batch)
                jax.block_until_ready(state)
                samples.append(meter.stop())
            best, clean = pick(samples)
            results[(name, shape)] = dict(time=best, clean=clean, first=first, samples=samples)
            print(f"  {name:13s} {shape[0]}x{shape[1]}: best {best:.2f} s/step{'' if clean else '*'} "
                  f"(steps {describe(samples)} = time/others' share of the cores/own CPU; "
                  f"first call incl. compile {compile_s:.0f} s) loss {first['loss']:+.6f} "
                  f"grad_norm {first['grad_norm']:.5f} clipfrac {first['clipfrac']:.3f}", flush=True)
    return results, batches, n_params


def torch_gsspo_loss(logits, tokens, loss_mask, seg, old, adv):
    """The GSsPO loss (docs/paper.md, Objectives) on full logits, written directly in torch."""
    import torch
    b, t = tokens.shape
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    valid = loss_mask.bool() & (seg >= 0)
    vf = valid.float()
    segc = seg.clamp(min=0)
    seg_sum = torch.zeros(b, t).scatter_add_(1, segc, (logp - old) * vf)
    seg_len = torch.zeros(b, t).scatter_add_(1, segc, vf)
    tok_len = seg_len.gather(1, segc).clamp(min=1)
    unit_log_ratio = seg_sum.gather(1, segc) / tok_len * vf
    log_rho = (unit_log_ratio.detach() + logp - logp.detach()).clamp(-20, 10)
    rho = torch.exp(log_rho)
    a = adv[:, None]
    per_token = torch.maximum(-a * rho, -a * rho.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    inv_len = vf / tok_len
    weight = inv_len / inv_len.sum(1, keepdim=True).clamp(min=1e-30)
    per_row = (per_token * weight).sum(1)
    n_resp = (vf.sum(1) > 0).float().sum().clamp(min=1)
    return per_row.sum() / n_resp


def load_torch(model_dir: Path):
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    model.config.use_cache = False
    return model


def bench_torch(model_dir: Path, shapes, steps: int, batches: dict) -> dict:
    import torch
    meter = CpuMeter()
    results = {}
    model = opt = None
    for b, t in shapes:
        # Every shape starts from the loaded weights and a fresh AdamW, as on the JAX side.
        del model, opt
        gc.collect()
        model = load_torch(model_dir)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
        gc.collect()
        batch = batches[(b, t)]
        tt = {k: torch.from_numpy(np.array(getattr(batch, k))) for k in
              ("tokens", "input_mask", "positions", "loss_mask", "segment_ids", "old_logprobs", "advantages")}
        tokens = tt["tokens"].long()

        def one_step():
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=tokens, attention_mask=tt["input_mask"].long(),
                           position_ids=tt["positions"].long()).logits
            loss = torch_gsspo_loss(logits, tokens, tt["loss_mask"], tt["segment_ids"].long(),
                                    tt["old_logprobs"], tt["advantages"])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            return float(loss.detach()), float(norm)

        t0 = time.perf_counter()
        loss, norm = one_step()
        warm = time.perf_counter() - t0
        samples = []
        for _ in range(steps):
            meter.start()
            one_step()
            samples.append(meter.stop())
        best, clean = pick(samples)
        results[("torch", (b, t))] = dict(time=best, clean=clean, first=dict(loss=loss, grad_norm=norm),
                                          samples=samples)
        print(f"  {'torch':13s} {b}x{t}: best {best:.2f} s/step{'' if clean else '*'} "
              f"(steps {describe(samples)}; first {warm:.0f} s) "
              f"loss {loss:+.6f} grad_norm {norm:.5f}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2x256", "4x256", "2x512"], help="B x T batch shapes")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per shape (after one warm-up step)")
    ap.add_argument("--random", action="store_true", help="random weights instead of the real checkpoint")
    ap.add_argument("--score-all", action="store_true", help="also time JAX scoring every position (first shape)")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]

    if args.random:
        # Random weights, written once as an HF checkpoint so that both frameworks load the same ones.
        # The bundled Qwen2.5-Coder-0.5B-Instruct's shape: Qwen2.5-0.5B with an untied LM head (630M).
        cfg_m = get_preset("qwen2.5-0.5b").replace(tie_word_embeddings=False)
        model_dir = Path(tempfile.mkdtemp(prefix="bench_train_step_"))
        checkpoint.save(qwen2.create(cfg_m, seed=0), model_dir)
        gc.collect()
    else:
        from workflow_r1 import assets
        model_dir = Path(assets.ensure())
        cfg_m = Qwen2Config.from_hf(model_dir)
    print(f"model: {'random ' if args.random else ''}{model_dir}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
          f"shapes {args.shapes}, {args.steps} timed steps each", flush=True)
    t_start = time.perf_counter()
    peak = matmul_gflops()
    print(f"fp32 matmul 2048^3: jax {peak['jax']:.0f} GFLOP/s, torch {peak['torch']:.0f} GFLOP/s", flush=True)

    jres, batches, n_params = bench_jax(model_dir, cfg_m, shapes, args.steps, args.score_all)
    jax.clear_caches()
    gc.collect()
    tres = {} if args.skip_torch else bench_torch(model_dir, shapes, args.steps, batches)
    res = {**jres, **tres}

    peak_best = max(peak.values())
    print(f"\nparams {n_params / 1e6:.0f}M; GFLOP/s = 6 x params x tokens / time; fp32 matmul peak "
          f"{peak_best:.0f} GFLOP/s; '*' = every timed step was disturbed by other processes")
    print(f"{'run':>13} {'B x T':>8} {'s/step':>7} {'tok/s':>7} {'vs torch':>8} {'GFLOP/s':>8} {'% peak':>7} "
          f"{'first loss':>11} {'grad norm':>10}")
    for name, shape in sorted(res, key=lambda k: (k[1][0] * k[1][1], k[1], k[0])):
        r = res[(name, shape)]
        tokens = shape[0] * shape[1]
        gflops = 6 * n_params * tokens / r["time"] / 1e9
        ref = res.get(("torch", shape))
        ratio = f"{ref['time'] / r['time']:.2f}x" if ref else "-"
        print(f"{name:>13} {shape[0]:>3} x {shape[1]:<4} {r['time']:>6.2f}{'' if r['clean'] else '*'} "
              f"{tokens / r['time']:>7.1f} {ratio:>8} {gflops:>8.1f} {100 * gflops / peak_best:>6.1f}% "
              f"{r['first']['loss']:>+11.6f} {r['first']['grad_norm']:>10.5f}")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.random:
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
