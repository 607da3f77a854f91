"""Train-step throughput: our jitted GSsPO step (JAX) vs the same step in PyTorch on HF Qwen2.

    .venv/bin/python benchmarks/train_step.py [--shapes 2x256 4x256 2x512] [--dtypes float32 bfloat16]
        [--steps 3] [--random] [--hugepages on|off] [--out r.json]

One step = forward + backward of the GSsPO (sub-sequence) loss + grad-norm clip 1.0 + AdamW
(lr 1e-6, wd 0.01) on the real Qwen2.5-Coder-0.5B-Instruct (`workflow_r1.assets.ensure`; `--random`
uses random weights of the same shape, which cost the same), in two recipes:
- float32: fp32 everything, both frameworks.
- bfloat16 (mixed precision): fp32 master weights, optimizer state, norms, softmax, log-probs and
  loss; bf16 matmuls. Ours: `model.dtype=bfloat16` (model/mixed.py: bf16 GEMMs with fp32
  accumulation in the forward and both backward products); PyTorch: `torch.autocast("cpu",
  torch.bfloat16)` around the forward, the loss on fp32 logits.
Both frameworks load the same parameters and the same synthetic multi-turn batch: a prompt (T/4
tokens), then 3 policy turns with observations between them (56% of the positions are policy
tokens), old log-probs = the policy's own plus noise (ratios spread around 1). The first step's loss
and gradient norm, printed side by side, must agree (to bf16 rounding in the mixed recipe).

PyTorch: HF `Qwen2ForCausalLM` (sdpa attention) -> full [B, T, V] logits -> log_softmax -> gather;
the loss with scatter_add over turns; `clip_grad_norm_`; `torch.optim.AdamW(fused=True)`.
JAX: `train_step.make_train_step` with its defaults (policy tokens only through the output head,
no logit recomputation at these sizes).

Processes. Every (framework, recipe, shape) runs in its own process, one after the other, the two
frameworks adjacent for each shape, so each starts from the loaded weights and a fresh optimizer
and reports its own peak memory (max RSS). `--hugepages on` (default) starts every worker with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1, the same malloc setting for both frameworks (launch/local.sh
sets it for training; see benchmarks/README.md for what it is worth).

Timing. The machine may be shared: every timed step also records how much CPU the *other*
processes used meanwhile (from /proc/stat), and the step time reported is the fastest step run
with under 10% of the cores busy elsewhere (else the fastest, marked '*'). GFLOP/s = 6 x params x
B x T / time (the usual training count; our head skips non-policy positions, so part of it is
work we do not do), against the matmul rate of the same dtype measured in the same run (the
faster framework's 2048^3 product; bf16 as bf16 x bf16 -> fp32).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from workflow_r1.host_memory import peak_rss_gb  # noqa: E402
from workflow_r1.model import checkpoint, qwen2  # noqa: E402
from workflow_r1.model.config import Qwen2Config, get_preset  # noqa: E402
from workflow_r1 import trajectory  # noqa: E402
from workflow_r1.rl import scoring, train_state, train_step as ts  # noqa: E402

LR, WD, CLIP, EPS_LOW, EPS_HIGH = 1e-6, 0.01, 1.0, 0.2, 0.2
BUSY_LIMIT = 0.10  # other processes' share of the cores above which a timed step counts as disturbed


def synthetic_batch(b: int, t: int, vocab: int, seed: int = 0) -> trajectory.TrainBatch:
    """Prompt (T/4), then 3 policy turns of (3T/16) tokens with T/16-token observations between."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, min(vocab, 151643), (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.int32)
    prompt, turn = t // 4, 3 * t // 16
    for k in range(3):
        start = prompt + k * (turn + t // 16)
        mask[:, start:start + turn] = 1
    adv = rng.randn(b).astype(np.float32)
    return trajectory.make_batch(tokens, mask, adv)


def with_old_logprobs(batch: trajectory.TrainBatch, logp: np.ndarray, seed: int = 1) -> trajectory.TrainBatch:
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


def matmul_gflops(dtype: str, n: int = 2048, reps: int = 5) -> dict[str, float]:
    """Measured [n, n] x [n, n] rate of each framework in `dtype` (bf16 accumulates in fp32)."""
    import torch
    out = {}
    jd = jnp.float32 if dtype == "float32" else jnp.bfloat16
    a = jnp.asarray(np.random.randn(n, n), jd)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32),
                compiler_options=train_state.compiler_options())
    ta = torch.randn(n, n).to(getattr(torch, dtype))
    for name, product in (("jax", lambda: f(a, a).block_until_ready()), ("torch", lambda: ta @ ta)):
        product()  # compile / warm up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            product()
            times.append(time.perf_counter() - t0)
        out[name] = 2 * n ** 3 / min(times) / 1e9
    return out


def model_dir_and_config(random_dir: str | None) -> tuple[Path, Qwen2Config]:
    if random_dir:
        return Path(random_dir), Qwen2Config.from_hf(random_dir)
    from workflow_r1 import assets
    model_dir = Path(assets.ensure())
    return model_dir, Qwen2Config.from_hf(model_dir)


def torch_gsspo_loss(logits, tokens, loss_mask, seg, old, adv):
    """The GSsPO loss (docs/paper.md, Objectives) on full logits, written directly in torch."""
    import torch
    b, t = tokens.shape
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    logp = torch.nn.functional.pad(logp, (1, 0))
    valid = loss_mask.bool() & (seg >= 0)
    vf = valid.float()
    segc = seg.clamp(min=0)
    seg_sum = logp.new_zeros(b, t).scatter_add_(1, segc, (logp - old) * vf)
    seg_len = logp.new_zeros(b, t).scatter_add_(1, segc, vf)
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


def jax_worker(model_dir: Path, cfg_m: Qwen2Config, shape: tuple[int, int], dtype: str, steps: int,
               old_file: Path) -> dict:
    """Times our step on one shape from the loaded weights and a fresh AdamW; writes the batch's old
    log-probs to `old_file` for the torch worker."""
    cfg = train_state.TrainConfig(learning_rate=LR, weight_decay=WD, max_grad_norm=CLIP, granularity="subsequence",
                         clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, num_mini_batches=1, kl_coef=0.0)
    # fp32 parameters either way; `dtype` is the compute dtype (model/mixed.py).
    state = train_state.create_train_state(checkpoint.load(model_dir, dtype=getattr(jnp, dtype)), cfg)
    batch = synthetic_batch(*shape, cfg_m.vocab_size)
    logp = np.asarray(scoring.compute_logprobs(state, batch, chunk_size=cfg.logprob_chunk_size))
    np.save(old_file, logp)
    batch = trajectory.shard_batch(with_old_logprobs(batch, logp), None)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(state.params)))
    step = ts.make_train_step(cfg)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)  # compile + first step
    jax.block_until_ready(state)
    first = {k: float(metrics[k][0]) for k in ("loss", "grad_norm")}
    warm = time.perf_counter() - t0
    meter, samples = CpuMeter(), []
    for _ in range(steps):
        meter.start()
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
        samples.append(meter.stop())
    return dict(samples=samples, first=first, warm=warm, n_params=n_params, peak_rss_gb=peak_rss_gb())


def torch_worker(model_dir: Path, cfg_m: Qwen2Config, shape: tuple[int, int], dtype: str, steps: int,
                 old_file: Path) -> dict:
    """Times the same step in PyTorch (autocast bf16 for the mixed recipe) on the same batch, with
    the old log-probs the JAX worker wrote (so the first losses and gradient norms compare)."""
    import torch
    batch = with_old_logprobs(synthetic_batch(*shape, cfg_m.vocab_size), np.load(old_file))
    model = load_torch(model_dir)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    tt = {k: torch.from_numpy(np.array(getattr(batch, k))) for k in
          ("tokens", "input_mask", "positions", "loss_mask", "segment_ids", "old_logprobs", "advantages")}
    tokens = tt["tokens"].long()
    mixed = dtype == "bfloat16"

    def one_step() -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            logits = model(input_ids=tokens, attention_mask=tt["input_mask"].long(),
                           position_ids=tt["positions"].long()).logits
        loss = torch_gsspo_loss(logits.float(), tokens, tt["loss_mask"], tt["segment_ids"].long(),
                                tt["old_logprobs"], tt["advantages"])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return float(loss.detach()), float(norm)

    t0 = time.perf_counter()
    loss, norm = one_step()
    warm = time.perf_counter() - t0
    meter, samples = CpuMeter(), []
    for _ in range(steps):
        meter.start()
        one_step()
        samples.append(meter.stop())
    n_params = sum(p.numel() for p in model.parameters())
    return dict(samples=samples, first=dict(loss=loss, grad_norm=norm), warm=warm, n_params=n_params,
                peak_rss_gb=peak_rss_gb())


def run_worker(args: argparse.Namespace) -> None:
    framework, dtype, shape = args.worker.split(":")
    b, t = (int(x) for x in shape.split("x"))
    model_dir, cfg_m = model_dir_and_config(args.model_dir)
    fn = jax_worker if framework == "jax" else torch_worker
    out = fn(model_dir, cfg_m, (b, t), dtype, args.steps, Path(args.old_file))
    print("RESULT " + json.dumps(out), flush=True)


def spawn(worker: str, args: argparse.Namespace, model_dir: str | None, env: dict, old_file: str) -> dict | None:
    cmd = [sys.executable, __file__, f"--worker={worker}", f"--steps={args.steps}", f"--old_file={old_file}"]
    if model_dir:
        cmd.append(f"--model_dir={model_dir}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {worker} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2x256", "4x256", "2x512"], help="B x T batch shapes")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                    help="recipes: fp32, or bf16 compute with fp32 master weights")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--random", action="store_true", help="random weights instead of the real checkpoint")
    ap.add_argument("--hugepages", choices=["on", "off"], default="on",
                    help="start the workers with glibc.malloc.hugetlb=1 (transparent huge pages for malloc)")
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model_dir", help=argparse.SUPPRESS)
    ap.add_argument("--old_file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    env = dict(os.environ)
    if args.hugepages == "on":
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    else:
        env.pop("GLIBC_TUNABLES", None)

    random_dir = None
    if args.random:
        # Random weights, written once as an HF checkpoint so that both frameworks load the same ones.
        # The bundled Qwen2.5-Coder-0.5B-Instruct's shape: Qwen2.5-0.5B with an untied LM head (630M).
        cfg_m = get_preset("qwen2.5-0.5b").replace(tie_word_embeddings=False)
        random_dir = tempfile.mkdtemp(prefix="bench_train_step_")
        checkpoint.save(qwen2.create(cfg_m, seed=0), random_dir)
        gc.collect()
    import torch
    print(f"model: {'random weights' if args.random else 'bundled Qwen2.5-Coder-0.5B-Instruct'}; jax {jax.__version__}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs; GLIBC_TUNABLES={env.get('GLIBC_TUNABLES', '')!r}; "
          f"{args.steps} timed steps per run; load {os.getloadavg()[0]:.1f}", flush=True)
    t_start = time.perf_counter()
    rates = {d: matmul_gflops(d) for d in args.dtypes}
    for d, r in rates.items():
        print(f"{d} matmul 2048^3: jax {r['jax']:.0f} GFLOP/s, torch {r['torch']:.0f} GFLOP/s", flush=True)

    res: dict = {}
    work_dir = tempfile.mkdtemp(prefix="bench_train_step_old_")
    for shape in shapes:
        for dtype in args.dtypes:
            old_file = os.path.join(work_dir, f"old_{dtype}_{shape[0]}x{shape[1]}.npy")
            for fw in ("jax", "torch"):  # the JAX worker writes the old log-probs both use
                worker = f"{fw}:{dtype}:{shape[0]}x{shape[1]}"
                r = spawn(worker, args, random_dir, env, old_file)
                if r is None:
                    continue
                r["time"], r["clean"] = pick([tuple(x) for x in r["samples"]])
                res[(fw, dtype, shape)] = r
                print(f"  {fw:5s} {dtype:8s} {shape[0]}x{shape[1]}: best {r['time']:.2f} s/step"
                      f"{'' if r['clean'] else '*'} (steps {describe(r['samples'])} = time/others' share of the "
                      f"cores/own CPU; first {r['warm']:.0f} s) loss {r['first']['loss']:+.6f} grad_norm "
                      f"{r['first']['grad_norm']:.4f} peak RSS {r['peak_rss_gb']:.1f} GB", flush=True)

    print("\nGFLOP/s = 6 x params x B x T / time; % = of the same dtype's best measured matmul rate; "
          "'*' = every timed step was disturbed by other processes")
    print("| recipe | B x T | ours s/step | torch s/step | ours / torch | ours GFLOP/s (% matmul) | "
          "torch GFLOP/s (% matmul) | first loss ours / torch | grad norm ours / torch | peak GB ours / torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for dtype in args.dtypes:
        peak = max(rates[dtype].values())
        for shape in shapes:
            j, t = res.get(("jax", dtype, shape)), res.get(("torch", dtype, shape))
            if not j:
                continue
            tokens = shape[0] * shape[1]
            gj = 6 * j["n_params"] * tokens / j["time"] / 1e9
            cell_t = ["-"] * 6
            if t:
                gt = 6 * t["n_params"] * tokens / t["time"] / 1e9
                cell_t = [f"{t['time']:.2f}{'' if t['clean'] else '*'}", f"{t['time'] / j['time']:.2f}x",
                          f"{gt:.0f} ({100 * gt / peak:.0f}%)", f"{t['first']['loss']:+.5f}",
                          f"{t['first']['grad_norm']:.3f}", f"{t['peak_rss_gb']:.1f}"]
            print(f"| {dtype} | {shape[0]} x {shape[1]} | {j['time']:.2f}{'' if j['clean'] else '*'} | {cell_t[0]} | "
                  f"{cell_t[1]} | {gj:.0f} ({100 * gj / peak:.0f}%) | {cell_t[2]} | {j['first']['loss']:+.5f} / "
                  f"{cell_t[3]} | {j['first']['grad_norm']:.3f} / {cell_t[4]} | {j['peak_rss_gb']:.1f} / {cell_t[5]} |")
            rows.append(dict(dtype=dtype, shape=list(shape), jax=j, torch=t))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rates=rates, rows=rows, env=env.get("GLIBC_TUNABLES", "")),
                                             indent=1))
    shutil.rmtree(work_dir, ignore_errors=True)
    if random_dir:
        shutil.rmtree(random_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
