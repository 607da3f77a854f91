"""Flax Qwen2 vs Hugging Face torch: whole model, each submodule, KV cache, sharding, checkpoint I/O."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers.models.qwen2 import modeling_qwen2 as hfq

from tests.hf_reference import hf_logits, left_padded, save_random_hf
from workflow_r1 import sharding
from workflow_r1.model import checkpoint, ops, qwen2
from workflow_r1.model.config import Qwen2Config, get_preset

CFG = get_preset("tiny")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF torch model, our model loaded from the HF checkpoint, checkpoint dir)."""
    d = tmp_path_factory.mktemp("tiny_hf")
    hf = save_random_hf(CFG, d)
    return hf, checkpoint.load(d), d


def _t(x):
    return torch.as_tensor(np.asarray(x))


# The model's forward compiled once per input shape: called op by op, each shape compiles every
# primitive again, about three times the CPU time of one jitted program on these shapes.
_forward = nnx.jit(lambda m, t, p, k, c: m(t, p, input_mask=k, cache=c))


def forward(model, tokens, pos, mask=None, cache=None):
    """(logits, cache) of `model` on [B, T] tokens, positions and padding mask (jitted)."""
    return _forward(model, jnp.asarray(tokens), jnp.asarray(pos), None if mask is None else jnp.asarray(mask), cache)


def _rows(seed=0, lengths=(9, 5, 7)):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(2, CFG.vocab_size, n)) for n in lengths]


def test_logits_match_hf_with_left_padding(tiny):
    hf, model, _ = tiny
    tokens, mask, pos = left_padded(_rows(), CFG.pad_token_id)
    ref = hf_logits(hf, tokens, mask, pos)
    ours, _ = forward(model, tokens, pos, mask)
    diff = np.abs(np.asarray(ours) - ref)[mask.astype(bool)]
    assert diff.max() < 1e-4, diff.max()


def test_tied_embeddings_match_hf(tmp_path):
    cfg = get_preset("tiny-tied")
    hf = save_random_hf(cfg, tmp_path, seed=3)
    model = checkpoint.load(tmp_path)
    assert not hasattr(model, "lm_head")
    tokens, mask, pos = left_padded(_rows(1), cfg.pad_token_id)
    ours, _ = forward(model, tokens, pos, mask)
    diff = np.abs(np.asarray(ours) - hf_logits(hf, tokens, mask, pos))[mask.astype(bool)]
    assert diff.max() < 1e-4


def test_rmsnorm_matches_hf(tiny):
    hf, model, _ = tiny
    x = np.random.RandomState(0).randn(2, 5, CFG.hidden_size).astype(np.float32) * 3
    ref = hf.model.layers[0].input_layernorm(_t(x)).detach().numpy()
    ours = model.layers[0].input_norm(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5, rtol=1e-5)


def test_rope_matches_hf(tiny):
    hf, _, _ = tiny
    rng = np.random.RandomState(1)
    q = rng.randn(2, 6, CFG.num_heads, CFG.head_dim).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 0, 0, 7, 100, 30000]])
    cos, sin = hf.model.rotary_emb(_t(q), _t(pos))
    ref, _ = hfq.apply_rotary_pos_emb(_t(q).transpose(1, 2), _t(q).transpose(1, 2), cos, sin)
    ours = ops.rope(jnp.asarray(q), jnp.asarray(pos), CFG.rope_theta)
    np.testing.assert_allclose(np.asarray(ours), ref.transpose(1, 2).numpy(), atol=2e-5, rtol=1e-5)


def test_rope_gradient_matches_torch_autograd(tiny):
    """rope's backward (the rotation by the opposite angle, model/qwen2.py) against torch autograd
    through HF's apply_rotary_pos_emb, fp32."""
    hf, _, _ = tiny
    rng = np.random.RandomState(4)
    q = rng.randn(2, 6, CFG.num_heads, CFG.head_dim).astype(np.float32)
    g = rng.randn(*q.shape).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 5], [0, 0, 0, 7, 100, 30000]])
    qt = _t(q).transpose(1, 2).requires_grad_(True)
    cos, sin = hf.model.rotary_emb(qt, _t(pos))
    ref, _ = hfq.apply_rotary_pos_emb(qt, qt.detach(), cos, sin)
    ref.backward(_t(g).transpose(1, 2))
    _, vjp = jax.vjp(lambda x: ops.rope(x, jnp.asarray(pos), CFG.rope_theta), jnp.asarray(q))
    (ours,) = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(ours), qt.grad.transpose(1, 2).numpy(), atol=2e-5, rtol=1e-5)


def _hf_mask(mask):
    """[B, T] padding mask -> HF eager 4-D additive causal mask."""
    b, t = mask.shape
    allowed = np.tril(np.ones((t, t), bool))[None] & mask.astype(bool)[:, None, :]
    return _t(np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None])


def test_attention_mlp_and_layer_match_hf(tiny):
    hf, model, _ = tiny
    tokens, mask, pos = left_padded(_rows(2), CFG.pad_token_id)
    x = np.random.RandomState(2).randn(*tokens.shape, CFG.hidden_size).astype(np.float32)
    valid = mask.astype(bool)
    pe = hf.model.rotary_emb(_t(x), _t(pos))
    hl, ol = hf.model.layers[1], model.layers[1]
    slots = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    ref_attn = hl.self_attn(_t(x), pe, _hf_mask(mask))[0].detach().numpy()
    ours_attn, _ = ol.attn(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(valid), slots, None, None)
    assert np.abs(np.asarray(ours_attn) - ref_attn)[valid].max() < 1e-5
    ref_mlp = hl.mlp(_t(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(ol.mlp(jnp.asarray(x))), ref_mlp, atol=1e-5)
    ref_layer = hl(_t(x), attention_mask=_hf_mask(mask), position_ids=_t(pos), position_embeddings=pe)
    ref_layer = (ref_layer[0] if isinstance(ref_layer, tuple) else ref_layer).detach().numpy()
    ours_layer, _ = ol(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(valid), slots, None, None)
    assert np.abs(np.asarray(ours_layer) - ref_layer)[valid].max() < 1e-5


def test_kv_cache_decode_equals_full_forward(tiny):
    _, model, _ = tiny
    tokens, mask, pos = left_padded(_rows(3, (10, 6, 8)), CFG.pad_token_id)
    full, _ = forward(model, tokens, pos, mask)
    prefill = 4
    cache = model.init_cache(tokens.shape[0], 16)
    logits, cache = forward(model, tokens[:, :prefill], pos[:, :prefill], mask[:, :prefill], cache)
    got = [np.asarray(logits)]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = forward(model, tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    diff = np.abs(got - np.asarray(full))[mask.astype(bool)]
    assert diff.max() < 1e-5, diff.max()
    assert np.asarray(cache.end).tolist() == [tokens.shape[1]] * 3


def test_cache_rows_continue_independently(tiny):
    """Rows extended by different amounts (left-padded chunks) give the same logits as one forward."""
    _, model, _ = tiny
    rng = np.random.RandomState(4)
    first = [list(rng.randint(2, 256, n)) for n in (5, 3)]
    second = [list(rng.randint(2, 256, n)) for n in (2, 6)]
    cache = model.init_cache(2, 32)
    t1, m1, p1 = left_padded(first, 0)
    _, cache = forward(model, t1, p1, m1, cache)
    t2, m2, _ = left_padded(second, 0)
    p2 = np.asarray([[len(first[i]) + max(0, j - (t2.shape[1] - len(second[i]))) for j in range(t2.shape[1])]
                     for i in range(2)])
    out, _ = forward(model, t2, p2, m2, cache)
    for i in range(2):
        whole = first[i] + second[i]
        ref, _ = forward(model, [whole], np.arange(len(whole))[None])
        n = len(second[i])
        np.testing.assert_allclose(np.asarray(out)[i, -n:], np.asarray(ref)[0, -n:], atol=1e-5)


def test_sharded_forward_equals_unsharded(tiny):
    _, model, d = tiny
    assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = checkpoint.load(d, mesh=mesh)
    q = sharded.layers[0].attn.q_kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    tokens, mask, pos = left_padded(_rows(5, (9, 5, 7, 8)), CFG.pad_token_id)
    ref, _ = forward(model, tokens, pos, mask)
    bs = sharding.batch_sharding(mesh)
    with sharding.use_mesh(mesh):
        fwd = nnx.jit(lambda m, t, p, k: m(t, p, input_mask=k)[0])
        out = fwd(sharded, *(jax.device_put(jnp.asarray(a), bs) for a in (tokens, pos, mask)))
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_export_reload_bit_exact(tiny, tmp_path):
    _, model, src = tiny
    checkpoint.save(model, tmp_path / "out", extra_files_from=src)
    back = checkpoint.load(tmp_path / "out")
    a, b = nnx.state(model, nnx.Param), nnx.state(back, nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    orig, new = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(orig) == set(new)
    for k in orig:
        assert orig[k].dtype == new[k].dtype and np.array_equal(orig[k], new[k]), k


def test_sharded_export_with_index(tiny, tmp_path):
    _, model, _ = tiny
    checkpoint.save(model, tmp_path, max_shard_bytes=100_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    back = checkpoint.load(tmp_path)
    for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- bad input: one-line errors naming the thing

def _copy_ckpt(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tiny, tmp_path):
    _, _, src = tiny
    d = _copy_ckpt(src, tmp_path / "c", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        checkpoint.load(d)


def test_wrong_shape_is_named(tiny, tmp_path):
    _, _, src = tiny

    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    d = _copy_ckpt(src, tmp_path / "c", edit)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(d)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "[31, 64]" in msg and "[32, 64]" in msg
    assert "\n" not in msg


def test_unexpected_tensor_is_named(tiny, tmp_path):
    _, _, src = tiny
    d = _copy_ckpt(src, tmp_path / "c", lambda t: t.update({"model.layers.9.extra": np.zeros(3, np.float32)}))
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.layers\.9\.extra"):
        checkpoint.load(d)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="does not exist.*workflow_r1.assets"):
        checkpoint.load(tmp_path / "nope")


def test_unknown_config_key_suggests():
    with pytest.raises(ValueError, match=r"unknown Qwen2Config key 'num_layer'; did you mean 'num_layers'\?"):
        Qwen2Config.from_dict({**CFG.__dict__, "num_layer": 3})


def test_hf_config_roundtrip_and_presets():
    assert Qwen2Config.from_hf(CFG.to_hf()) == CFG
    assert get_preset("qwen2.5-7b").vocab_size == 152064 and not get_preset("qwen2.5-7b").tie_word_embeddings
    assert get_preset("qwen2.5-0.5b").tie_word_embeddings
    # The published parameter counts (tied 0.5B: 494M; 7B: 7.62B).
    assert abs(get_preset("qwen2.5-0.5b").num_params / 1e6 - 494.0) < 1.0
    assert abs(get_preset("qwen2.5-7b").num_params / 1e9 - 7.62) < 0.01
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("qwen9")


def _hf_config_dict(rope_form: str, theta: float, tie: bool) -> dict:
    """A Qwen2.5-style config.json with every field we read off its default; RoPE's base frequency
    given the transformers 4 way (top-level rope_theta) or the transformers 5 way (rope_parameters)."""
    d = {k: v for k, v in CFG.to_hf().items() if k not in ("rope_theta", "rope_parameters")}
    d.update(rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=tie)
    if rope_form == "top_level":
        d.update(rope_theta=theta, rope_scaling=None)
    else:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return d


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rope_form", ["top_level", "rope_parameters"])
def test_hf_config_fields_are_read(tmp_path, rope_form, tie):
    # 250000 is neither our dataclass default (1e6) nor the HF fallback (1e4): it must come from the file.
    for theta in (250_000.0, 1_000_000.0):
        d = _hf_config_dict(rope_form, theta, tie)
        (tmp_path / "config.json").write_text(json.dumps(d))
        for source in (d, tmp_path, tmp_path / "config.json"):
            cfg = Qwen2Config.from_hf(source)
            assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
                theta, 1e-5, 131072, tie), source
            assert cfg == CFG.replace(rope_theta=theta, rms_norm_eps=1e-5, max_position_embeddings=131072,
                                      tie_word_embeddings=tie)
    # Absent fields take HF's defaults (rope_theta 1e4 as transformers' Qwen2Config, not ours).
    bare = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
                                                    "max_position_embeddings", "tie_word_embeddings")}
    cfg = Qwen2Config.from_hf(bare)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
        10000.0, 1e-6, 32768, False)


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
def test_long_positions_at_rope_theta_1e6_match_hf(tmp_path, preset):
    """Qwen2.5's rope_theta = 1e6 read from HF's own config.json, checked where it matters: at
    positions above 1000 a base of 1e4 rotates the low frequencies by entirely different angles."""
    cfg = get_preset(preset).replace(rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=4096)
    hf = save_random_hf(cfg, tmp_path, seed=5)
    model = checkpoint.load(tmp_path)
    assert model.cfg == cfg
    tokens, mask, pos = left_padded(_rows(2), cfg.pad_token_id)
    pos = pos + np.array([[1500], [1001], [3000]], np.int32)
    ours, _ = forward(model, tokens, pos, mask)
    diff = np.abs(np.asarray(ours) - hf_logits(hf, tokens, mask, pos))[mask.astype(bool)]
    assert diff.max() < 1e-4, diff.max()


# ------------------------------------------------- the real Qwen2.5-Coder-0.5B-Instruct checkpoint

CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
    [{"role": "user", "content": "2+2="}],
]


@pytest.mark.real_model
def test_real_qwen05b_matches_hf(qwen05b_dir):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(qwen05b_dir)
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CHAT]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    tokens, mask, pos = left_padded(rows, 151643)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(qwen05b_dir, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    ref = hf_logits(hf, tokens, mask, pos)
    del hf
    model = checkpoint.load(qwen05b_dir)
    assert model.cfg.num_params == sum(np.asarray(x).size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    ours = np.asarray(nnx.jit(lambda m, t, p, k: m(t, p, input_mask=k)[0])(
        model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(mask)))
    valid = mask.astype(bool)
    diff = np.abs(ours - ref)[valid]
    print(f"real 0.5B parity: max abs logit diff {diff.max():.2e} over {valid.sum()} positions")
    assert diff.max() < 2e-3
    assert np.array_equal(ours.argmax(-1)[valid], ref.argmax(-1)[valid])


@pytest.mark.real_model
def test_real_qwen05b_export_roundtrip(qwen05b_dir, tmp_path):
    model = checkpoint.load(qwen05b_dir, param_dtype=jnp.bfloat16)
    checkpoint.save(model, tmp_path, extra_files_from=qwen05b_dir)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    orig = load_file(str(pathlib.Path(qwen05b_dir) / "model.safetensors"))
    new = load_file(str(tmp_path / "model.safetensors"))
    assert set(orig) == set(new)
    for k in orig:
        assert orig[k].dtype == new[k].dtype and np.array_equal(orig[k], new[k]), k


@pytest.mark.real_model
def test_chat_ids_follow_the_qwen_template(qwen05b_dir):
    from workflow_r1.model import tokenizer as tokenizer_lib
    tok = tokenizer_lib.load(qwen05b_dir)
    ids = tokenizer_lib.chat_ids(tok, "Hi there")
    # Qwen2.5 template: default system block, then the user turn, then the assistant header.
    assert tok.decode(ids) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                               "assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(151645) == 2
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_lib.load(pathlib.Path(qwen05b_dir).parent)


# ops.attend compiled (dtype and the block sizes static): op by op, a gradient through its
# blocks took seconds per call.
_attend = jax.jit(ops.attend, static_argnums=(5, 6, 7, 8))


def _attention_inputs(seed: int, b: int = 2, t: int = 37):
    """Tiny-preset (qg, k, v, key_valid, query_slots) of a sequence attending to itself; row 1 is
    left-padded by 5."""
    cfg = get_preset("tiny")
    rng = np.random.RandomState(seed)
    qg = jnp.asarray(rng.randn(b, t, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    k = jnp.asarray(rng.randn(b, t, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    v = jnp.asarray(rng.randn(b, t, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    valid = jnp.asarray(np.arange(t)[None, :] >= np.array([[0], [5]]))
    return qg, k, v, valid, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def test_query_blocked_attention_equals_full_attention():
    """Blocks of queries (with padding of the last block, left-padded rows and gradients through the
    rematerialised blocks) give exactly the full-attention outputs and gradients."""
    qg, k, v, valid, slots = _attention_inputs(0)

    def loss(q, block):
        return (_attend(q, k, v, valid, slots, jnp.float32, block, None) ** 2).sum()

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    full, g_full = grad(qg, None)
    for block in (8, 16, 36):
        out = _attend(qg, k, v, valid, slots, jnp.float32, block, None)
        np.testing.assert_allclose(out, _attend(qg, k, v, valid, slots, jnp.float32, None, None), atol=1e-6)
        val, g = grad(qg, block)
        np.testing.assert_allclose(val, full, rtol=1e-6)
        np.testing.assert_allclose(g, g_full, atol=1e-5)


# (causal_block, query_block, max_causal_blocks, the block size that gives at T = 37): blocks of
# causal_block; grown to keep 3 or 4 blocks; capped by a query_block below T (rematerialised).
@pytest.mark.parametrize("causal_block, query_block, max_blocks, size", [
    (8, None, 16, 8), (16, None, 16, 16), (36, None, 16, 36), (4, 16, 16, 4), (8, 12, 16, 8),
    (4, None, 3, 16), (2, 16, 4, 10), (4, 12, 3, 12)])
def test_causal_blocked_attention_equals_full_attention(causal_block, query_block, max_blocks, size):
    """Query blocks that skip their future keys (a ragged last block, left-padded rows, gradients
    to q, k and v) give the full-attention outputs and gradients at every real query (a padding
    query has no key to attend to; its output, never used, is a mean over another set of keys); and
    the skipped keys really are skipped (NaNs planted from the last block's first query on change no
    earlier query, and planted one key earlier they do); and the blocks are as many as their size
    gives."""
    qg, k, v, valid, slots = _attention_inputs(1)
    t = qg.shape[1]

    def loss(q, k, v, block):
        out = _attend(q, k, v, valid, slots, jnp.float32, query_block, block, max_blocks)
        return ((out ** 2).sum((2, 3, 4)) * valid).sum()

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=3)
    full, g_full = grad(qg, k, v, None)
    val, g = grad(qg, k, v, causal_block)
    np.testing.assert_allclose(val, full, rtol=1e-6)
    for a, ref in zip(g, g_full):
        np.testing.assert_allclose(a, ref, atol=1e-5)
    # One product of scores and one weighted sum per block of `size` queries.
    jaxpr = jax.make_jaxpr(lambda q, k, v: ops.attend(q, k, v, valid, slots, jnp.float32, query_block, causal_block,
                                                      max_blocks))(qg, k, v)
    assert str(jaxpr).count("dot_general") == 2 * -(-t // size)
    last = (t - 1) // size * size  # the first query of the last block
    out_full = _attend(qg, k, v, valid, slots, jnp.float32, None, None)
    real = np.asarray(valid)[:, :last, None, None, None]
    for first_nan, unchanged in ((last, True), (last - 1, False)):
        out = _attend(qg, k.at[:, first_nan:].set(jnp.nan), v.at[:, first_nan:].set(jnp.nan), valid, slots,
                      jnp.float32, query_block, causal_block, max_blocks)
        assert np.allclose(np.where(real, out[:, :last], 0), np.where(real, out_full[:, :last], 0),
                           atol=1e-6) == unchanged
    with pytest.raises(ValueError, match="S = T"):
        ops.attend(qg, k[:, :-1], v[:, :-1], valid[:, :-1], slots, jnp.float32, None, causal_block)


def test_remat_keeps_only_layer_inputs_on_this_backend():
    """Rematerialised layers must shrink the backward pass's live activations on every backend,
    XLA:CPU included (which drops jax.checkpoint's barriers and would merge the recomputation back)."""
    cfg = get_preset("tiny").replace(num_layers=8)
    tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)

    def temp_bytes(remat):
        graphdef, params = nnx.split(qwen2.abstract(cfg, remat=remat))

        def loss(p, tok):
            h, _ = nnx.merge(graphdef, p).hidden_states(tok, jnp.broadcast_to(jnp.arange(256), tok.shape))
            return (h ** 2).mean()

        return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(True) < 0.5 * temp_bytes(False)
