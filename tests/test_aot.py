"""workflow_r1.aot: topology names, the fit rule, and a real ahead-of-time compilation of the 0.5B's
programs for a v5e:2x2 slice, with a config that does not fit failing in one line.

The compilations need libtpu. The test environment does not install it (with libtpu importable,
every CPU-only JAX process probes for a TPU at start-up): the `libtpu_env` fixture unpacks the wheel
that jax[tpu] pins, once, from PyPI into the workflow_r1 cache, and only the AOT subprocesses see it."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from workflow_r1 import aot
from workflow_r1.model.config import get_preset

REPO = pathlib.Path(__file__).resolve().parents[1]


def _libtpu_requirement() -> str:
    """The libtpu that this JAX's `tpu` extra pins (e.g. 'libtpu==0.0.42.*'), from jax's metadata."""
    for req in importlib.metadata.requires("jax") or []:
        name, _, marker = req.partition(";")
        if name.strip().startswith("libtpu") and "tpu" in marker:
            return name.strip().replace(" ", "")
    raise AssertionError("jax's metadata names no libtpu for its tpu extra")


@pytest.fixture(scope="module")
def libtpu_env() -> dict[str, str]:
    """os.environ for an AOT subprocess, with libtpu importable (installed, or the cached wheel)."""
    env = dict(os.environ)
    if importlib.util.find_spec("libtpu") is not None:
        return env
    from workflow_r1.assets import cache_root

    req = _libtpu_requirement()
    target = cache_root() / "libtpu" / re.sub(r"[^\w.]+", "-", req).strip("-.")  # libtpu-0.0.42
    if not (target / "libtpu").is_dir():
        tmp = target.with_name(target.name + ".partial")  # a killed install leaves only this behind
        shutil.rmtree(tmp, ignore_errors=True)
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), req],
                           capture_output=True, text=True, timeout=1200)
        assert p.returncode == 0, f"pip could not fetch {req} from PyPI for the AOT tests: {p.stderr[-1500:]}"
        tmp.rename(target)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.parametrize("name, want", [
    ("v5p-16", "v5p:2x2x2"),   # v5p names count TensorCores, 2 per chip: 8 chips
    ("v5p-8", "v5p:2x2x1"),   # one host's chips: libtpu refuses 1x2x2
    ("v5p-128", "v5p:4x4x4"),
    ("v5e-16", "v5e:4x4"),     # v5e / v6e names count chips
    ("v5e-4", "v5e:2x2"),
    ("v6e-8", "v6e:2x4"),
    ("v5litepod-16", "v5e:4x4"),
    ("v5p:2x2x4", "v5p:2x2x4"),
])
def test_topology_names(name, want):
    assert aot.topology_string(name)[1] == want


@pytest.mark.parametrize("name", ["v9-16", "v5p-6", "v5e-12", "tpu"])
def test_bad_topology_is_one_line_naming_the_form(name):
    with pytest.raises(aot.AotError, match="topology") as e:
        aot.topology_string(name)
    assert "\n" not in str(e.value)


def test_fit_rule_counts_every_live_buffer():
    chip = aot.CHIPS["v5e"]
    gib = 1 << 30
    ok = aot.Report("update", 6 * gib, 6 * gib, 6 * gib, 3 * gib, 5 * gib, 0, 0, 0, "train.micro_batch_size")
    assert ok.total == 14 * gib and aot.check_fit([ok], chip, 0.95) is None
    over = aot.Report("decode", 6 * gib, 6 * gib, 5 * gib, 4 * gib, 5 * gib, 0, 0, 0, "rollout.n")  # 16 GiB
    msg = aot.check_fit([ok, over], chip, 0.95)
    assert msg.startswith("error: decode needs 16.00 GiB") and "rollout.n" in msg and "\n" not in msg


def test_roofline_is_the_slower_of_compute_and_memory():
    chip = aot.CHIPS["v5p"]
    p = aot.Report("decode", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=459e9, min_bytes=2.765e12 * 3)
    assert aot.roofline_s(p, chip) == pytest.approx(3.0)  # 1 ms of compute, 3 s of HBM reads
    p = aot.Report("update", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=459e12 * 2, min_bytes=2.765e12)
    assert aot.roofline_s(p, chip) == pytest.approx(2.0)
    p = aot.Report("decode", 0, 0, 0, 0, 0, 0, 0, 0, "", executed_flops=459e9, min_bytes=2.765e12, ici_bytes=600e9 * 4)
    assert aot.roofline_s(p, chip) == pytest.approx(4.0)  # 4 s gathering weight shards over the ICI


def test_received_bytes_reads_each_collective_of_the_hlo():
    """Lines as the TPU compiler prints them (the 7B's sync for v5p-8 and v5p-16): a device holds 1/g of
    an all-to-all's or all-gather's result already and receives the rest; an async op counts at its
    -done (the -start's tuple holds the operand too); other ops move nothing."""
    from workflow_r1.aot.collectives import received_bytes

    hlo = "\n".join([
        "%all-to-all.6 = bf16[28,896,4,4736]{3,1,0,2:T(8,128)(2,1)} all-to-all(%copy.30), channel_id=7, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=4] {'axis_2'}, dimensions={2}",
        "%all-gather = bf16[152064,3584]{0,1:T(8,128)(2,1)} all-gather(%convert.5), channel_id=1, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, dimensions={1}, use_global_device_ids=true",
        "%ag-start = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%p), replica_groups={{0,1,2,3},{4,5,6,7}}",
        "%ag-done = f32[32,16]{1,0} all-gather-done(%ag-start)",
        "%ar = f32[1024]{0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add",
        "%cp = s32[10]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}",
        "%fusion = bf16[4096]{0} fusion(%all-gather), kind=kLoop, calls=%fused",
    ])
    want = (28 * 896 * 4 * 4736 * 2 * 3 / 4 + 152064 * 3584 * 2 * 7 / 8 + 32 * 16 * 4 * 3 / 4
            + 1024 * 4 * 2 * 3 / 4 + 10 * 4)
    assert received_bytes(hlo, 8) == pytest.approx(want)


def _aot(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = dict(env)
    env.pop("XLA_FLAGS", None)  # the tests' 8 simulated CPU devices are not the slice
    env.pop("JAX_PLATFORMS", None)
    return subprocess.run([sys.executable, "-m", "workflow_r1.aot", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)


def _row(out: str, name: str) -> list[float]:
    """The memory columns of program `name`'s row (args .. total, then the % of HBM), before the first '|'."""
    line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
    return [float(x.rstrip("%")) for x in line.split("|")[0].split()[1:]]


def test_05b_compiles_for_v5e_2x2_and_reports_memory(libtpu_env):
    """The local preset's 0.5B with a short budget, FSDP over the 4 chips, layers scanned, fully
    fine-tuned (fp32 master weights; the LoRA accounting is checked on CPU devices below)."""
    p = _aot(libtpu_env, "--config=configs/gsspo.py:local", "--topology=v5e:2x2", "--config.model.scan_layers=True",
             "--config.model.lora_rank=0", "--config.model.param_dtype=float32",
             "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.rollout.prompts_per_step=1",
             "--config.rollout.n=4", "--config.rollout.stop_at_action=False",
             "--config.rollout.max_prompt_tokens=256", "--config.rollout.max_response_tokens=256",
             "--config.rollout.max_turn_tokens=64", "--config.rollout.pad_multiple=256",
             "--config.rollout.max_tokens_per_step=0")  # the engine's calls: prefill and decode compiled
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "v5e:2x2: 4 chips, 16.00 GiB HBM" in out and "'fsdp': 4" in out
    # Closed form: fp32 params + two AdamW moments of Qwen2.5-0.5B's 494,032,768 parameters, split
    # 4 ways (the only undivided arrays are the small norm scales and biases).
    n = get_preset("qwen2.5-0.5b").num_params
    assert n == 494_032_768
    state_gib = 3 * 4 * n / 4 / 2**30
    update = _row(out, "update")
    args, outputs, aliased, temps, resident, total = update[:6]
    assert state_gib <= args <= state_gib * 1.02 + 0.05  # + the batch, a few MiB
    assert aliased >= state_gib * 0.98  # the state is donated: written in place
    assert temps > 0 and total == pytest.approx(args + outputs - aliased + temps + resident, abs=0.02)
    # The local preset's sampler weights are bf16 (rollout.weights_dtype) on the training mesh
    # (rollout.tensor_parallel=0): the sync, a cast of each chip's own shards, moves nothing over the
    # ICI; it reads the fp32 weights (a third of the state) beside the rest of the state.
    sync = _row(out, "sync")
    assert sync[0] == pytest.approx(state_gib / 3, abs=0.02) and sync[1] == pytest.approx(state_gib / 6, abs=0.02)
    assert sync[4] == pytest.approx(state_gib * 2 / 3, abs=0.02) and "0.00 GiB received per chip" in out
    for prog in ("prefill", "decode"):
        row = _row(out, prog)
        # The whole train state lives through rollout beside the sampler's copy (an argument).
        assert row[4] == pytest.approx(state_gib, rel=0.02, abs=0.02) and row[0] >= state_gib / 6
        assert 0 < row[5] < 16 * 0.95
    # The whole-step bound: every part, the 4 rows of the one host, the budget's 256 response tokens.
    # On TPU the engine's calls attend over the page pool in place (jax's ragged_paged_attention,
    # compiled into prefill and decode above): no view of the rows, no copy.
    parts = [ln.split()[0] for ln in out.split("step time >=")[0].splitlines()[-4:]]
    assert parts == ["sync", "prefill", "decode", "update"] and "4 rows per host" in out
    assert "view " not in out.split("step time >=")[0].split("part ")[-1]
    assert "paged attention kernel" in out
    assert "response 256 tokens per row" in out


def python_with_libtpu(libtpu_env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    """`python -c code` on CPU with libtpu importable (its compile-only TPU topologies)."""
    env = {**libtpu_env, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_kernel_runs_in_shard_map_and_a_ragged_step_compiles_for_tpu(libtpu_env):
    """A sampler over a host's 4 chips whose 0.5B heads (14, 2 KV) do not split 4 ways: XLA cannot
    partition jax's Mosaic kernel, so the calls' prefill and a ragged step (rollout.
    max_tokens_per_step, the kernel over the flat run) run it in shard_map, replicated; both
    compile (without the shard_map the prefill fails: "Mosaic kernels cannot be automatically
    partitioned")."""
    p = _aot(libtpu_env, "--config=configs/gsspo.py:local", "--topology=v5e-4", "--programs=prefill,step",
             "--config.rollout.tensor_parallel=-1", "--config.rollout.max_tokens_per_step=256")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "'tensor': 4" in p.stdout and "paged attention kernel" in p.stdout
    for prog in ("prefill", "step"):
        assert 0 < _row(p.stdout, prog)[5] < 16 * 0.95
    # The whole-step bound prices the rollout as the ragged steps the engine runs, not as calls.
    parts = [ln.split()[0] for ln in p.stdout.split("step time >=")[0].split("part ")[-1].splitlines()[1:]]
    assert parts == ["step"] and "ragged steps of <= 256 tokens" in p.stdout


def test_the_sampler_compiles_for_one_hosts_chips_as_a_slice_of_their_own(libtpu_env):
    """A v5e-16 host holds chips 0, 1, 4, 5 (a 2x2 block of the 4x4 torus): the TPU compiler refuses a
    program over them within the 16-chip slice, so the sampler's programs compile for v5e:2x2; a
    v5p-16 host holds chips 0-3 and compiles as it is."""
    code = ("from workflow_r1 import aot\n"
            "for name in ('v5e-16', 'v5p-16'):\n"
            "    chip, topology = aot.topology_string(name)\n"
            "    devices = aot.tpu_devices(topology)\n"
            "    host = aot.host_devices(chip, devices)\n"
            "    print(name, sorted(d.id for d in devices if d.process_index == 0), sorted(d.id for d in host),\n"
            "          len({d.process_index for d in host}), host[0] in devices)\n")
    p = python_with_libtpu(libtpu_env, code)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("v5")]
    assert lines == ["v5e-16 [0, 1, 4, 5] [0, 1, 2, 3] 1 False", "v5p-16 [0, 1, 2, 3] [0, 1, 2, 3] 1 True"], p.stdout


def test_a_config_that_does_not_fit_fails_in_one_line(libtpu_env):
    # 4,096 rows in flight of 1,344 cache slots: the 0.5B's KV cache alone is ~17 GiB per v5e chip.
    p = _aot(libtpu_env, "--config=configs/gsspo.py:local", "--topology=v5e-4", "--programs=prefill",
             "--config.rollout.prompts_per_step=512", "--config.rollout.n=8")
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    # Over HBM either by XLA's memory analysis or, earlier, by the TPU compiler's own refusal.
    assert re.match(r"error: prefill (needs [\d.]+ GiB per device, over 95% of the 16.00 GiB HBM|does not fit: "
                    r"the TPU compiler needs .+ HBM); change rollout.prompts_per_step / rollout.n \(rows in flight\)",
                    last), last


def _cpu_run(overrides: list[str]) -> aot.Sections:
    """The tiny model's sections: 8 rows of 512 + 64 tokens, FSDP over this process's 8 CPU devices."""
    from workflow_r1 import configlib

    cfg = configlib.load(f"{REPO}/configs/gsspo.py:tiny", ["model.preset=tiny", "rollout.prompts_per_step=4",
                                                           "rollout.n=2", "train.micro_batch_size=8",
                                                           "rollout.max_prompt_tokens=512",
                                                           "rollout.max_response_tokens=64", "rollout.pad_multiple=64",
                                                           "mesh.data=1", "mesh.fsdp=-1", *overrides])
    return aot.Sections.from_config(cfg)


def _compile_on_cpu(overrides: list[str], programs: tuple[str, ...] = ("update", "score", "prefill", "decode")
                    ) -> tuple[list, dict]:
    """compile_all's programs for this process's 8 simulated CPU devices (no libtpu): the same code
    path as a slice check (abstract state, shardings, the programs), on another backend."""
    import jax

    run = _cpu_run(overrides)
    return aot.compile_all(run, aot.architecture(run), jax.devices(), list(programs))


def test_compile_all_accounts_for_lora_on_cpu_devices():
    """Per-device bytes in closed form. Full fine-tuning: the state is fp32 weights + two AdamW
    moments, the KL reference a copy of the weights, and the sampler reads the train state's own
    weights. LoRA (bf16 base): the state is the base + adapters + their moments, the reference copies
    only the adapters, and the sampler decodes a merged bf16 copy of the weights."""
    full, info_full = _compile_on_cpu(["model.lora_rank=0", "train.kl_coef=0.001"])
    lora, info_lora = _compile_on_cpu(["model.lora_rank=4", "model.param_dtype=bfloat16", "train.kl_coef=0.001"])
    assert [p.name for p in full] == [p.name for p in lora] == ["update", "score", "prefill", "decode"]
    assert info_full["mesh"] == info_lora["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    f, lo = {p.name: p for p in full}, {p.name: p for p in lora}
    w = info_full["params_bytes"]  # fp32 weights, sharded 8 ways
    assert info_full["state_bytes"] == pytest.approx(3 * w, abs=16)  # + the step counter
    assert f["update"].resident == w  # the reference
    adapters = lo["update"].resident  # the reference: the initial adapters
    base = info_lora["params_bytes"] - adapters
    assert base == w // 2  # the same shapes and shardings in bf16: the frozen base is sharded too
    assert 0 < adapters < base and info_lora["state_bytes"] == pytest.approx(base + 3 * adapters, abs=16)
    # state - its weights (the argument) + reference, and the rollout's page pool
    assert info_full["page_pool_bytes"] == info_lora["page_pool_bytes"] > 0
    assert f["prefill"].resident == info_full["state_bytes"] + info_full["page_pool_bytes"]
    # the whole state + reference + the page pool
    assert lo["prefill"].resident == info_lora["state_bytes"] + adapters + info_lora["page_pool_bytes"]
    assert f["prefill"].arguments - lo["prefill"].arguments == w - w // 2  # fp32 weights vs a merged bf16 copy


def test_compile_all_builds_the_tensor_parallel_bf16_sampler_as_the_trainer_does():
    """rollout.tensor_parallel=2, weights_dtype=bfloat16 on 8 CPU devices (the trainer's
    make_meshes(..., sampler_tensor=2) and Sampler(weights_dtype=...)): the sampler's mesh is
    (data 4, tensor 2) apart from the FSDP training mesh; the sync is a compiled program whose
    outputs are each device's bf16 shards; the prefill and decode read that copy beside the whole
    train state; the in-place pages ("gather", the kernel's layout) are split over the 2 KV heads."""
    from workflow_r1.aot import bound

    keys = ["model.lora_rank=0", "rollout.tensor_parallel=2", "rollout.weights_dtype=bfloat16",
            "rollout.paged_attention=gather", "rollout.page_size=16"]
    reports, info = _compile_on_cpu(keys, programs=("sync", "prefill", "decode"))
    r = {p.name: p for p in reports}
    assert list(r) == ["sync", "prefill", "decode"]
    assert info["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert info["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 2} and info["sampler_copy"]
    assert info["sampler_weights_dtype"] == "bfloat16"
    w, state, ref = info["params_bytes"], info["state_bytes"], info["ref_bytes"]
    out = info["sampler_weight_bytes"]
    # The fp32 shards (FSDP 8) in; out: bf16 halves split by heads / MLP / vocabulary over 2 (norms whole).
    assert r["sync"].arguments == w and out <= r["sync"].outputs <= out + 8 * 64  # + the outputs' pointer table
    assert w < out < 4 * w  # half the bytes, 4x fewer ways split
    assert r["sync"].resident == state - w + ref and r["sync"].ici_bytes > 0  # XLA:CPU moves its bytes
    assert info["sync_bytes"] == r["sync"].ici_bytes
    # The rollout: the whole train state lives beside the sampler's copy (its argument).
    c = get_preset("tiny")
    page = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 16 * 4 // 2  # fp32, half the KV heads per device
    assert info["paged_attention"] == "gather" and info["kv_bytes_per_token"] * 16 == page
    assert info["page_pool_bytes"] == (8 * 36 + 1) * page  # 8 rows x (512 + 64) / 16 pages, + the scratch page
    for name in ("prefill", "decode"):
        assert r[name].resident == state + ref  # the pool is the call's argument, not resident
        assert r[name].arguments >= out + info["page_pool_bytes"] and r[name].ici_bytes == 0
    # The step bound takes the compiled sync.
    parts = bound.step_bound(r, aot.CHIPS["v5p"], bound.workload(_cpu_run(keys), info, 1))
    assert [p.name for p in parts] == ["sync", "prefill", "decode"]
    assert parts[0].seconds == aot.roofline_s(r["sync"], aot.CHIPS["v5p"]) > 0


def test_asynchronous_training_counts_its_versions_and_the_overlapping_rollout():
    """train.max_staleness = 1: two policy versions (copies of the fp32 weights) beside every
    program, and the rollout's page pool and sampler weights beside the update it overlaps."""
    keys = ["model.lora_rank=0"]
    sync, info0 = _compile_on_cpu(keys, programs=("update", "prefill"))
    async_, info1 = _compile_on_cpu(keys + ["train.max_staleness=1"], programs=("update", "prefill"))
    s, a = {p.name: p for p in sync}, {p.name: p for p in async_}
    w = info0["params_bytes"]
    assert info0["versions_bytes"] == 0 and info1["versions_bytes"] == 2 * w
    rollout = info1["page_pool_bytes"] + (info1["sampler_weight_bytes"] if info1["sampler_copy"] else 0)
    assert info1["rollout_resident_bytes"] == rollout > 0 and "rollout_resident_bytes" not in info0
    assert a["update"].resident == s["update"].resident + 2 * w + rollout
    assert a["prefill"].resident == s["prefill"].resident + 2 * w


def _worst_case_batch(rows: int, hosts: int, n: int, prompt: int, response: int, length: int, m: int,
                      micro: int | None) -> tuple:
    """A [rows, length] batch at the budgets (every prompt `prompt` tokens, every response region
    `response`): each of the `hosts` hosts' rows (a block of rows / hosts, as `shard_batch` stacks
    them) its own groups of n adjacent rows, reordered as `Learner.prepare` does with
    train.share_prompts (`shared_prompt.micro_batch_order`)."""
    import numpy as np

    from workflow_r1.rl import scoring, shared_prompt

    k = scoring.num_micro(rows // m, micro)
    per_host = rows // hosts
    group = np.arange(rows) // n
    for h in range(hosts):
        mine = np.arange(h * per_host, (h + 1) * per_host)
        group[mine] = group[mine][shared_prompt.micro_batch_order(mine, m, k)]
    tokens = np.full((rows, length), 7, np.int32)
    tokens[:, 0] = group + 1  # a group's prompt: its own first token
    col = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    real, loss = col < prompt + response, (col >= prompt) & (col < prompt + response)
    return tokens * real, col, real.astype(np.int32), loss.astype(np.int32)


@pytest.mark.parametrize("prompts, n, m, micro, hosts", [
    (16, 4, 2, 8, 1),   # a group's 4 rows split 2 a mini-batch: b = 8 holds 2 rows of 4 groups
    (8, 8, 2, 4, 1),    # b = 4: a group's 4 rows of a mini-batch fill one micro-batch
    (8, 4, 1, None, 1),  # k = 1: the mini-batch's 8 groups
    (8, 4, 2, 4, 2),    # 2 hosts, 2 rows of each a micro-batch, one group's: 2 slots
    (16, 8, 2, 8, 2),   # b = n = 8 over 2 hosts, 4 rows of a group a mini-batch: 2 slots
    (8, 4, 1, 8, 1),    # 32 rows, b = 8, k = 4
    (12, 4, 2, 6, 1),   # b = 6 of groups of 4: a micro-batch straddles a group boundary
])
def test_share_shapes_bound_the_plan_of_a_worst_case_batch(prompts, n, m, micro, hosts):
    """aot.share_shapes against the plan make_plan builds of a batch at the budgets (prompt 200 ->
    Pp 256, response 100 -> R 128, T 384 after padding to 64), rows in the learner's order: the
    same M, k, b, Pp, R and U."""
    import jax
    import numpy as np

    from workflow_r1.rl import shared_prompt
    from workflow_r1.rl.train_state import TrainConfig
    from workflow_r1.rollout import RolloutConfig

    t = TrainConfig(num_mini_batches=m, micro_batch_size=micro, share_prompts=True)
    r = RolloutConfig(prompts_per_step=prompts, n=n, max_prompt_tokens=200, max_response_tokens=100)
    length = 384
    s = aot.share_shapes(t, r, length, hosts=hosts)
    plan = shared_prompt.make_plan(*_worst_case_batch(prompts * n, hosts, n, 200, 100, length, m, micro),
                                   num_mini_batches=m, micro_batch_size=micro)
    u, pp = np.asarray(plan.prompt_mask).shape[-2:]
    mm, k, b, rr = np.asarray(plan.resp_segment).shape
    assert (s.m, s.k, s.b, s.pp, s.r) == (mm, k, b, pp, rr) == (m, k, b, 256, 128)
    assert s.u == u
    abstract = aot.abstract_share_plan(s, _cpu_mesh())
    # The plan's leaves, U as the rule says.
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == [
        ((m, k, s.u), np.int32), ((m, k, s.u), np.int32), ((m, k, s.u, pp), np.int32), ((m, k, b, 1), np.int32),
    ] + [((m, k, b, rr), np.int32)] * 4 == [(np.shape(x), np.int32) for x in jax.tree.leaves(plan)]
    assert {np.asarray(x).dtype for x in jax.tree.leaves(plan)} == {np.dtype(np.int32)}


def test_compile_all_refuses_shared_prompts_with_packing_in_one_line():
    """share_shapes sizes the unpacked shared plan; packed responses would be another program."""
    with pytest.raises(aot.AotError, match="^aot sizes the shared-prompt update unpacked; set train.pack_tokens=0"):
        _compile_on_cpu(["rollout.prompts_per_step=8", "rollout.n=4", "train.num_mini_batches=2",
                         "train.share_prompts=True", "train.pack_tokens=1024"], programs=("update",))


def _cpu_mesh():
    """This process's CPU devices as a one-axis mesh."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()), ("data",))


def test_compile_all_compiles_the_shared_update_with_share_prompts():
    """train.share_prompts: the update is the shared-prompt program, its plan (replicated on every
    device) among the compiled arguments, and its roofline counts U x Pp + b x R positions a
    micro-batch (here 4 x 512 + 8 x 64 = 2,560 against 8 x 576 = 4,608 unshared)."""
    from workflow_r1.aot.compiled import device_bytes

    keys = ["model.lora_rank=0", "rollout.prompts_per_step=8", "rollout.n=4", "train.num_mini_batches=2"]
    (plain,), info_plain = _compile_on_cpu(keys, programs=("update",))
    (shared,), info = _compile_on_cpu(keys + ["train.share_prompts=True"], programs=("update",))
    s = info["share"]
    assert "share" not in info_plain
    assert (s.m, s.k, s.b, s.u, s.pp, s.r) == (2, 2, 8, 4, 512, 64) and s.positions == 2560
    # The shared forward reads the plan and not input_mask (jit drops an unread argument): [32, 576]
    # int32 rows split 8 ways.
    plan_b = device_bytes(aot.abstract_share_plan(s, _cpu_mesh()))
    assert shared.arguments == plain.arguments - 32 * 576 * 4 // 8 + plan_b
    assert shared.flops != plain.flops and shared.temporaries != plain.temporaries  # another program
    # The counted work goes with the positions (2,560 / 4,608 = 0.56), attention's share aside.
    assert 0.5 < shared.executed_flops / plain.executed_flops < 0.65 and shared.min_bytes == plain.min_bytes
