"""LoRA (model/lora.py) through the model, the update, checkpoints, the HF export and the trainer.

What is checked against what:
- fresh adapters (B = 0) give the base model's logits exactly (fp32 and bf16, unrolled and scanned);
- the merged kernel equals W + (alpha / r) A B computed in float64 NumPy, and the merged model's
  logits equal the adapted model's (fp32 to 1e-5; bf16 to its rounding);
- the update differentiates only the adapters: the train state's params, gradients and AdamW
  moments hold LoRA leaves only, the base is bitwise unchanged by a step, and the gradient of B
  at B = 0 equals the chain rule through the full model's kernel gradient, scale · A^T dL/dW
  (with remat and with scanned layers, so the custom-VJP layer passes the adapters' cotangents on);
- a checkpoint holds the adapters, their moments and the step, none of the base, and restores exactly;
  the HF export holds the merged weights;
- the trainer with model.lora_rank learns the synthetic operator task (env.kind=operators).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workflow_r1 import checkpoint_tree, checkpointing
from workflow_r1.model import checkpoint as hf_checkpoint
from workflow_r1.model import lora, qwen2
from workflow_r1.model.config import get_preset
from workflow_r1 import trajectory
from workflow_r1.rl import train_state, train_step as ts

CFG = get_preset("tiny")
TARGETS = tuple(lora.TARGETS)


def _model(seed: int = 0, *, rank: int = 4, alpha: float = 8.0, dtype=jnp.float32, scan: bool = False,
           remat: bool = False, random_b: bool = False) -> qwen2.Qwen2:
    model = qwen2.create(CFG, seed=seed, dtype=dtype, scan_layers=scan, remat=remat)
    if rank:
        lora.attach(model, rank, alpha, TARGETS, seed=seed + 1)
    if random_b:
        for i, (_, _, ad) in enumerate(lora.adapters(model)):
            ad.b.set_value(0.05 * jax.random.normal(jax.random.key(100 + i), ad.b.get_value().shape))
    return model


def _inputs(b: int = 3, t: int = 11, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
    mask = np.ones((b, t), bool)
    mask[0, :3] = False  # a left-padded row
    mask = jnp.asarray(mask)
    return tokens, trajectory.positions_from_mask(mask), mask


def _logits(model, inputs):
    tokens, positions, mask = inputs
    return np.asarray(model(tokens, positions, input_mask=mask)[0], np.float64)


def _batch(b: int = 8, t: int = 16, seed: int = 0) -> trajectory.TrainBatch:
    rng = np.random.RandomState(seed)
    tokens = rng.randint(2, CFG.vocab_size, (b, t)).astype(np.int32)
    loss_mask = np.zeros((b, t), np.int32)
    loss_mask[:, 4:] = 1
    return trajectory.make_batch(tokens, loss_mask, rng.randn(b).astype(np.float32))


def _paths(state) -> list[str]:
    return ["/".join(str(k) for k in path) for path, _ in nnx.to_flat_state(state)]


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fresh_adapters_give_the_base_logits_exactly(scan, dtype):
    inputs = _inputs()
    base = _logits(_model(rank=0, dtype=dtype, scan=scan), inputs)
    adapted = _model(dtype=dtype, scan=scan)
    assert lora.has_adapters(adapted)
    assert np.max(np.abs(_logits(adapted, inputs) - base)) == 0.0


def test_merged_kernel_is_w_plus_scaled_a_b_in_float64():
    model = _model(random_b=True, rank=3, alpha=5.0)
    merged = lora.merge(model)
    assert not lora.has_adapters(merged) and lora.has_adapters(model)  # the original keeps its adapters
    for li, (layer, out) in enumerate(zip(model.layers, merged.layers)):
        for name, sub in (("q", "attn"), ("o", "attn"), ("down", "mlp")):
            ad = getattr(getattr(layer, sub), f"{name}_lora")
            w = np.asarray(getattr(getattr(layer, sub), f"{name}_kernel")[...], np.float64)
            a, b = np.asarray(ad.a[...], np.float64), np.asarray(ad.b[...], np.float64)
            r = a.shape[-1]
            want = w + 5.0 / 3 * (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(w.shape)
            got = np.asarray(getattr(getattr(out, sub), f"{name}_kernel")[...], np.float64)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"layer {li} {name}")


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 0.05)])
def test_merged_forward_equals_unmerged(scan, dtype, tol):
    inputs = _inputs()
    model = _model(random_b=True, dtype=dtype, scan=scan)
    unmerged = _logits(model, inputs)
    assert np.max(np.abs(unmerged - _logits(_model(rank=0, dtype=dtype, scan=scan), inputs))) > 0.1  # B moved it
    assert np.max(np.abs(_logits(lora.merge(model), inputs) - unmerged)) < tol


def test_the_state_trains_only_the_adapters_and_leaves_the_base_unchanged():
    cfg = train_state.TrainConfig(learning_rate=1e-2, num_mini_batches=2, kl_coef=0.0)
    state = train_state.create_train_state(_model(), cfg)
    adapter_paths = _paths(state.params)
    assert adapter_paths and all("_lora/" in p for p in adapter_paths)
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state.params))
    assert not any("_lora/" in p for p in _paths(state.frozen))
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    # AdamW moments: two per adapter value, none for the base.
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_adapter
    _, grads, _ = ts.make_loss_and_grads(cfg)(state, _batch())
    assert _paths(grads) == adapter_paths
    base = jax.tree.map(np.asarray, state.frozen)
    before = jax.tree.map(np.asarray, state.params)
    new, _ = ts.make_train_step(cfg)(state, _batch())
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(new.frozen)):
        assert np.array_equal(x, np.asarray(y))
    moved = [float(np.max(np.abs(np.asarray(y) - x))) for x, y in zip(jax.tree.leaves(before),
                                                                      jax.tree.leaves(new.params))]
    assert min(moved) > 0, "every adapter factor moves after two updates (B first, then A)"


@pytest.mark.parametrize("scan,remat", [(False, False), (False, True), (True, True)])
def test_the_gradient_of_b_is_the_chain_rule_through_the_kernel(scan, remat):
    """At B = 0, dL/dB = scale · A^T dL/dW for every adapted kernel W: the adapter's cotangent is the
    full model's, projected (and dL/dA = 0)."""
    cfg = train_state.TrainConfig(kl_coef=0.0, num_mini_batches=1)
    batch = _batch()
    full = train_state.create_train_state(_model(rank=0, scan=scan), cfg)  # the reference: no remat
    _, dw, _ = ts.make_loss_and_grads(cfg)(full, batch)
    adapted = train_state.create_train_state(_model(scan=scan, remat=remat), cfg)
    _, dab, _ = ts.make_loss_and_grads(cfg)(adapted, batch)
    dw, dab = nnx.to_pure_dict(dw), nnx.to_pure_dict(dab)

    def layer(tree, li):  # layer li's subtree, sliced out of the stacked arrays when scanned
        return jax.tree.map(lambda x: np.asarray(x, np.float64)[li], tree["layers"]) if scan else \
            jax.tree.map(lambda x: np.asarray(x, np.float64), tree["layers"][li])

    checked = 0
    for li in range(CFG.num_layers):
        g_w, g_ab, p_ab = layer(dw, li), layer(dab, li), layer(nnx.to_pure_dict(adapted.params), li)
        for target, (sub, _) in lora.TARGETS.items():
            a = p_ab[sub][f"{target}_lora"]["a"]
            r = a.shape[-1]
            kernel_grad = g_w[sub][f"{target}_kernel"]
            want = 2.0 * a.reshape(-1, r).T @ kernel_grad.reshape(a.size // r, -1)  # scale = alpha / r = 8 / 4
            got = g_ab[sub][f"{target}_lora"]
            np.testing.assert_allclose(got["b"].reshape(r, -1), want, rtol=2e-4, atol=1e-7,
                                       err_msg=f"layer {li} {target}")
            assert np.max(np.abs(got["a"])) == 0.0
            checked += 1
    assert checked == CFG.num_layers * len(lora.TARGETS)


def test_a_checkpoint_holds_only_what_trains_and_restores_exactly(tmp_path):
    cfg = train_state.TrainConfig(learning_rate=1e-2, num_mini_batches=1, kl_coef=0.0)
    state, _ = ts.make_train_step(cfg)(train_state.create_train_state(_model(), cfg), _batch())
    with checkpointing.Checkpointer(tmp_path / "ckpt", checkpointing.CheckpointConfig(async_save=False)) as ck:
        ck.save(1, state, {"step": 1}, force=True)
        meta = ck._manager.item_metadata(1)["state"]
        saved = ["/".join(p) for p, _ in checkpoint_tree.named_leaves(meta.tree if hasattr(meta, "tree") else meta)]
        params = [p for p in saved if p.startswith("params/")]
        assert params and all("_lora/" in p for p in params), params
        assert not any("kernel" in p or "embed" in p or "norm" in p for p in saved)
        n_saved = checkpointing.bytes_written(checkpoint_tree.nest(checkpoint_tree.state_items(state)))
        # The adapters, their two AdamW moments and the step: nothing of the base's size.
        assert n_saved == 3 * sum(x.nbytes for x in jax.tree.leaves(state.params)) + state.step.nbytes + 4, n_saved
        # A fresh run (other adapter init, same base) resumes to exactly the saved state.
        target = train_state.create_train_state(_model(), cfg)
        back, extra = ck.restore(target)
    assert extra == {"step": 1}
    for x, y in zip(jax.tree.leaves((state.params, state.opt_state, state.step, state.frozen)),
                    jax.tree.leaves((back.params, back.opt_state, back.step, back.frozen))):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_the_hf_export_holds_the_merged_weights(tmp_path):
    model = _model(random_b=True)
    state = train_state.create_train_state(model, train_state.TrainConfig(kl_coef=0.0))
    out = checkpointing.export_hf(state, tmp_path / "hf")
    back = hf_checkpoint.load(out)
    inputs = _inputs()
    assert np.max(np.abs(_logits(back, inputs) - _logits(state.model(), inputs))) < 1e-5


def test_the_sampler_decodes_with_the_merged_weights():
    from workflow_r1.sampler import Sampler

    model = _model(random_b=True)
    prompt = [[3, 5, 7, 9, 11]]
    got = Sampler(model, impl="model", cache_size=64).generate(prompt, 8).tokens
    want = Sampler(lora.merge(model), impl="model", cache_size=64).generate(prompt, 8).tokens
    base = Sampler(_model(rank=0), impl="model", cache_size=64).generate(prompt, 8).tokens
    assert got == want and got != base
    # The fused CPU path merges inside its re-layout program (fused_cpu.merged_weights): the same
    # weights as the re-layout of the model merged on its own, bit for bit; an update re-syncs them.
    from workflow_r1.sampler import fused_cpu

    fused = Sampler(model, impl="fused_cpu", cache_size=64)
    fused.update_params(model)
    expect = fused_cpu.weights(nnx.split(lora.merge(model))[1], model.cfg, fused._impl.dtype)
    for a, b in zip(jax.tree.leaves(fused._weights), jax.tree.leaves(expect)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fused.generate(prompt, 8).tokens == Sampler(lora.merge(model), impl="fused_cpu",
                                                       cache_size=64).generate(prompt, 8).tokens


def test_lora_learns_the_operator_task(tmp_path, monkeypatch):
    """The trainer (rollouts, rewards, update, sampler on merged weights) with rank-8 adapters on a
    frozen random tiny model lifts the reward of the synthetic task from chance (about -1.3) above 0
    and learns the format, in 15 steps.

    The base's output head is scaled up 10x: at the random init's 0.02 std, every logit of the tiny
    model is within about +-1.3 of the others whatever the hidden state (RMS-normed, width 64), so no
    policy over that frozen head can be confident; a pre-trained head (what LoRA is for) is not so.
    """
    from workflow_r1.ablation import runs
    from workflow_r1.envs import operators as operator_task

    real = operator_task.policy

    def policy(model, remat=False):
        m = real(model, remat)
        m.lm_head.set_value(m.lm_head[...] * 10)
        return m

    monkeypatch.setattr(operator_task, "policy", policy)

    workdir = tmp_path / "lora"
    fast = ["checkpoint.every_steps=0", "log_trajectories=0", "tensorboard=False", "eval.max_questions=64",
            "eval.batch_size=64", "model.lora_rank=8", "model.lora_alpha=16"]
    runs.train_in_process(runs.spec("gsspo", "operators"), runs.operator_overrides(0, STEPS, fast), workdir)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    curve = [r["rollout/reward"] for r in rows if "rollout/reward" in r]
    start, end = curve[0], np.mean(curve[-3:])
    fmt = [r["rollout/format_ok"] for r in rows if "rollout/format_ok" in r]
    print(f"lora: reward {start:.3f} -> {end:.3f}, format {fmt[0]:.2f} -> {fmt[-1]:.2f} in {len(curve)} steps")
    assert start < -1.0, f"a random policy should score about -1.3, got {start:.3f}"
    assert end > 0.0, f"LoRA reward only went {start:.3f} -> {end:.3f} (curve {np.round(curve, 2)})"
    assert fmt[-1] > 0.9, f"LoRA format rate only went {fmt[0]:.2f} -> {fmt[-1]:.2f}"


STEPS = 15  # the operator task's optimiser (the `operators` preset, configs/base.py): about 0.5 reward by then
