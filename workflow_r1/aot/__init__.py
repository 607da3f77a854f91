"""Will a config fit a TPU slice? Compile a run's programs for that slice on this machine and see.

    python -m workflow_r1.aot --config=configs/gsspo.py:paper --topology=v5p-16
    python -m workflow_r1.aot --config=configs/gsspo.py:local --topology=v5e:2x2 --config.mesh.fsdp=-1

Needs libtpu (`pip install -r requirements-tpu.txt`, a separate environment is best: see
docs/replicate.md), but no TPU: libtpu describes the slice's chips
(`jax.experimental.topologies`) and XLA compiles for them ahead of time. Every program a training
step executes is lowered from abstract inputs (ShapeDtypeStructs carrying their shardings; no
weight is ever materialised) and compiled for the config's mesh over the slice:

  update   `train_step.update`: the old log-probs, M mini-batches of micro-batches, remat,
           the compute dtype, AdamW; on the rollout batch at its longest (prompt + response budget,
           rounded up to rollout.pad_multiple). With train.share_prompts, the shared-prompt update
           on an abstract plan of the largest shapes the config allows (`share_shapes`).
  score    the reference log-probs (`scoring.score_program`, what `scoring.compute_logprobs` jits; only with KL;
           with train.share_prompts the shared scoring, what `scoring.compute_logprobs_shared` jits).
  sync     the sampler's per-step weight copy from the train state (`sampler.weights`: LoRA merged,
           cast to rollout.weights_dtype, moved to the sampler's layout; only when it reads a copy).
  prefill  the sampler's `loop.extend`: a prefill chunk for all of a host's rows in flight.
  decode   the sampler's `loop.decode`: the whole response budget at the full cache length.
  step     a ragged engine step (`ragged.step_impl`) of rollout.max_tokens_per_step tokens over the
           pages in place; compiled by default instead of prefill and decode when that is set,
           since the engine then runs only steps.

The sampler's programs (aot/sampler.py) are built as the trainer builds its sampler: its mesh from
`sharding.make_meshes(..., sampler_tensor=rollout.tensor_parallel)` (each host's own chips, or the
training mesh), its weights the copy the sync makes (`weights.for_aot`) or the train state's own,
and its KV pages as `rollout.paged_attention` reads them on TPU: in place through jax's
`ragged_paged_attention` ("auto", "kernel": the pool is the programs' argument, split over the KV
heads on a tensor-parallel mesh), or through the engine's dense working cache of a call ("view":
rows a power of two, at most a longest row's pages long, beside the resident pool). They run on
the host's rows in flight (`rollout.max_rows_in_flight`, or every row of the host).

For each it prints the per-device bytes XLA reports (arguments, outputs, temporaries) plus the
buffers that live on the device while it runs without being its arguments (the train state during
rollout, the reference weights during the update; with `train.max_staleness` = k > 0, the k + 1
policy versions beside every program and the rollout's pages and sampler weights beside the
update, which the rollout of later steps overlaps), against the chip's HBM; the HLO's flops and
bytes as XLA's cost analysis gives them (which counts a scan's body once, so they undercount a
model with scanned layers); and a roofline time per call, the larger of the flops it executes over
the chip's peak (counted from the model: 6 N per trained token, 2 N per scored or generated one,
attention, remat's recomputation), the weight and cache bytes it must read over the HBM
bandwidth and, over the ICI, the weight shards a sampler on an FSDP mesh gathers or what the
sync's compiled collectives deliver (`collectives.received_bytes`). `aot.bound` sums them over
every call of a step: the rollout of all of a host's rows (after prefix caching, for a response
length the user sets), the sampler's weight sync, the scoring and the update, printed beside its
assumptions. It exits 1 with a one-line error naming the config keys to change when a program
does not fit. Topology names: `v5p-16` style (the Cloud TPU name: TensorCores for v4 / v5p, chips
for v5e / v6e) or libtpu's own `v5p:2x2x2`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

# One compiled program (its Report, the errors, the roofline): the package's names too.
from workflow_r1.aot.compiled import (AotError, DoesNotFit, Report, _attention_flops, _compile, _gib,  # noqa: F401
                                      _matmul_params, device_bytes, roofline_s)


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures (Cloud TPU system architecture pages): HBM bytes, dense bf16
    FLOP/s, HBM bytes/s, inter-chip interconnect bytes/s (all links); `cores_per_chip`: how many
    TensorCores the slice name counts per chip."""

    libtpu_name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    cores_per_chip: int
    dims: int  # torus dimensions of the topology string
    ici_bandwidth: float


CHIPS = {
    "v4": Chip("v4", 32 << 30, 275e12, 1.2e12, 2, 3, 300e9),
    "v5p": Chip("v5p", 95 << 30, 459e12, 2.765e12, 2, 3, 600e9),
    "v5e": Chip("v5e", 16 << 30, 197e12, 0.819e12, 1, 2, 200e9),
    "v6e": Chip("v6e", 32 << 30, 918e12, 1.64e12, 1, 2, 448e9),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}


def topology_string(name: str) -> tuple[Chip, str]:
    """`v5p-16` / `v5e-16` / `v5p:2x2x2` -> (chip, libtpu topology string such as "v5p:2x2x2")."""
    m = re.fullmatch(r"(v\d+[a-z]*)(?:[-:])(.+)", name.strip().lower())
    kind = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if kind not in CHIPS:
        raise AotError(f"--topology={name!r}: use a Cloud TPU name like v5p-16 or v5e-16, or a libtpu topology "
                       f"like v5p:2x2x2 (chips: {', '.join(CHIPS)})")
    chip, rest = CHIPS[kind], m.group(2)
    if "x" in rest:
        return chip, f"{chip.libtpu_name}:{rest}"
    if not rest.isdigit() or int(rest) % chip.cores_per_chip:
        raise AotError(f"--topology={name!r}: the number after the dash counts "
                       f"{'TensorCores (2 per chip)' if chip.cores_per_chip == 2 else 'chips'}")
    chips = int(rest) // chip.cores_per_chip
    if chips & (chips - 1):
        raise AotError(f"--topology={name!r}: {chips} chips is not a power of two; give the shape, e.g. v5p:2x2x4")
    # The most cubic (square) torus of that many chips, smallest dimensions first, as Cloud TPU does,
    # except that a slice smaller than a host's 2x2x1 chips keeps the host's layout (v5p-8 is
    # 2x2x1: libtpu refuses 1x2x2).
    shape = [1] * chip.dims
    for i in range(int(math.log2(chips))):
        shape[-1 - i % chip.dims] *= 2
    shape.sort(key=lambda d: (d == 1, d))
    return chip, f"{chip.libtpu_name}:{'x'.join(map(str, shape))}"


def tpu_devices(topology: str) -> list[Any]:
    """The compile-only TPU devices of a libtpu topology (one error line when libtpu is absent)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise AotError("libtpu is not installed: pip install -r requirements-tpu.txt (best in its own venv, "
                       "see docs/replicate.md)")
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # libtpu's own message names what it knows
        raise AotError(f"libtpu does not know topology {topology!r}: {str(e).splitlines()[0][:200]}") from None


def host_devices(chip: Chip, devices: list[Any]) -> list[Any]:
    """The devices the sampler's programs compile for: the first host's of `devices`, as a slice of
    their own. The sampler runs on each host's own chips, and the TPU compiler builds a program over
    a subset of a larger slice only when the subset's device ids are 0..k-1: a v5e-16 host holds
    chips 0, 1, 4 and 5, so there its programs compile for a one-host topology of the same chips
    and shape (v5e:2x2), which is what that host runs."""
    host = min(d.process_index for d in devices)
    local = [d for d in devices if d.process_index == host]
    if sorted(d.id for d in local) == list(range(len(local))) or not hasattr(local[0], "coords"):
        return local
    coords = [tuple(d.coords)[:chip.dims] for d in local]
    shape = [max(c) - min(c) + 1 for c in zip(*coords)]
    return tpu_devices(f"{chip.libtpu_name}:{'x'.join(map(str, shape))}")


# --------------------------------------------------------------------------------------------------
# Abstract inputs
# --------------------------------------------------------------------------------------------------

def abstract_batch(rows: int, length: int, mesh: Any, *, ref: bool) -> Any:
    """The rollout's TrainBatch [rows, length] as sharded ShapeDtypeStructs (old_logprobs None: the
    update recomputes them, as the trainer leaves them; ref_logprobs when the KL term is on)."""
    import jax
    import jax.numpy as jnp

    from workflow_r1 import sharding
    from workflow_r1.trajectory import TrainBatch

    def arr(dtype: Any, ndim: int = 2) -> Any:
        return jax.ShapeDtypeStruct((rows, length)[:ndim], dtype, sharding=sharding.batch_sharding(mesh, ndim))

    i32, f32 = jnp.int32, jnp.float32
    return TrainBatch(tokens=arr(i32), input_mask=arr(i32), positions=arr(i32), loss_mask=arr(i32),
                      segment_ids=arr(i32), sampler_logprobs=arr(f32), advantages=arr(f32, 1),
                      old_logprobs=None, ref_logprobs=arr(f32) if ref else None)


@dataclasses.dataclass(frozen=True)
class ShareShapes:
    """The shapes of a batch's shared-prompt plan (`shared_prompt.make_plan`): M mini-batches of k
    micro-batches of b rows; per micro-batch U prompt slots of Pp positions and b responses of R."""

    m: int
    k: int
    b: int
    u: int
    pp: int
    r: int

    @property
    def positions(self) -> int:
        """Token positions one micro-batch's forward runs on: U x Pp + b x R (unshared: b x T)."""
        return self.u * self.pp + self.b * self.r


def share_shapes(train: Any, rollout: Any, length: int, hosts: int = 1) -> ShareShapes:
    """The worst case the config allows for the plan `make_share_plan` builds of a batch of
    rollout.prompts_per_step x rollout.n rows of `length` (T) positions on `hosts` hosts.

    M, k and b split the rows as `make_plan` does. Pp: a prompt of rollout.max_prompt_tokens; R: a
    response region (every token after the prompt: turns and observations) of the whole
    rollout.max_response_tokens; both rounded up as a plan rounds them (`shared_prompt.plan_width`).

    U: the most distinct groups any micro-batch holds when the learner orders the rows: each host
    places its own rows (a block of the batch, `trajectory.shard_batch`), groups of n = rollout.n
    adjacent rows, reordered by `shared_prompt.micro_batch_order` and split strided, as
    `Learner.prepare` and `make_plan` do. Rows the group filter empties take no slot, and equal
    prompts share one, so a batch's plan has at most these shapes.
    """
    import numpy as np

    from workflow_r1.rl import scoring
    from workflow_r1.rl.shared_prompt import micro_batch_order, plan_width, split_index

    rows, m, n = rollout.prompts_per_step * rollout.n, train.num_mini_batches, rollout.n
    k = scoring.num_micro(rows // m, train.micro_batch_size)
    b = rows // m // k
    group = np.arange(rows) // n
    per_host = rows // hosts
    for h in range(hosts):
        mine = np.arange(h * per_host, (h + 1) * per_host)
        group[mine] = group[mine][micro_batch_order(mine, m, k)]
    u = max(len(set(group[part])) for part in split_index(rows, m, k).reshape(m * k, -1))
    up = lambda x: plan_width(x, length)  # noqa: E731
    return ShareShapes(m=m, k=k, b=b, u=u, pp=up(rollout.max_prompt_tokens), r=up(rollout.max_response_tokens))


def abstract_share_plan(s: ShareShapes, mesh: Any) -> Any:
    """A `SharePlan` of shapes `s` as ShapeDtypeStructs, leaves [M, k, ...] int32, replicated: the
    trainer passes the plan as host arrays, which the jitted update places whole on every device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from workflow_r1.rl.shared_prompt import SharePlan

    def arr(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((s.m, s.k) + shape, jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

    # Unpacked: a response row per row (Rr = b), each continuing one prompt slot (V = 1).
    return SharePlan(prompt_row=arr(s.u), prompt_start=arr(s.u), prompt_mask=arr(s.u, s.pp), row_prompt=arr(s.b, 1),
                     resp_row=arr(s.b, s.r), resp_col=arr(s.b, s.r), resp_segment=arr(s.b, s.r),
                     resp_prompt=arr(s.b, s.r))


# --------------------------------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------------------------------

def compile_all(run: Any, arch: Any, devices: list[Any], programs: list[str],
                host: list[Any] | None = None) -> tuple[list[Report], dict[str, Any]]:
    """Compiles the requested programs of `run` (`Sections`: model, train, rollout) for `devices`; returns the reports and
    the figures they were built from (mesh, rows, lengths; "share": the plan's `ShareShapes` with
    train.share_prompts). `host`: the devices the sampler's
    programs compile for when `devices` span several hosts (`host_devices`; default: the first
    host's own)."""
    from flax import nnx

    from workflow_r1 import checkpoint_tree, policy, sharding
    from workflow_r1.model import qwen2
    from workflow_r1.rl import scoring, train_step as ts

    t, r, m = run.train, run.rollout, run.model
    if t.share_prompts and t.pack_tokens:  # share_shapes sizes one response row per row, not packed rows
        raise AotError("aot sizes the shared-prompt update unpacked; set train.pack_tokens=0 to compile "
                       "train.share_prompts")
    try:  # the training mesh over the slice (the sampler's: aot/sampler.py)
        mesh = sharding.make_meshes(run.mesh, devices=devices, host_devices=devices)[0]
    except ValueError as e:
        raise AotError(f"{e}; set mesh.data / mesh.fsdp / mesh.tensor") from None
    rows = r.prompts_per_step * r.n
    micro = t.micro_batch_size or rows // t.num_mini_batches
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if micro % split:  # Run.check's rule, for the slice's device count rather than this machine's
        raise AotError(f"a micro-batch of {micro} rows does not split over the {split} devices of mesh "
                       f"{dict(mesh.shape)}; set train.micro_batch_size to a multiple of {split}, or "
                       "mesh.tensor")
    dtype, param_dtype = policy.DTYPES[m.dtype], policy.DTYPES[m.param_dtype]
    # The policy as the trainer builds it, LoRA adapters included (model.lora_rank): the train state
    # then holds the frozen base apart from the adapters and their optimizer state.
    def create() -> Any:
        return qwen2.use_attention(qwen2.create(arch, dtype=dtype, param_dtype=param_dtype, remat=m.remat,
                                                scan_layers=m.scan_layers), m.attention)

    model = nnx.eval_shape(lambda: policy.with_lora(create(), m))
    state = checkpoint_tree.abstract_train_state(model, t, mesh)
    weights = state.weights()  # every weight the forward reads (LoRA: base + adapters)
    params_b = device_bytes(weights)
    state_b = device_bytes(state)
    frozen_b = device_bytes(state.frozen) if state.frozen is not None else 0
    # The KL reference is a copy of what trains (LoRA: the initial adapters; the base is shared).
    ref_b = device_bytes(state.params) if t.kl_coef else 0
    # Asynchronous training (train.max_staleness = k > 0) keeps the k + 1 newest policy versions, each
    # a copy of what trains laid out like it, beside every program (workflow_r1/pipeline.py, Versions).
    versions_b = (t.max_staleness + 1) * device_bytes(state.params) if t.max_staleness else 0
    length = -(-(r.max_prompt_tokens + r.max_response_tokens) // r.pad_multiple) * r.pad_multiple
    batch = abstract_batch(rows, length, mesh, ref=bool(t.kl_coef))
    n = mesh.devices.size
    n_mm = _matmul_params(arch)
    info = {"mesh": dict(mesh.shape), "rows": rows, "length": length, "params_bytes": params_b,
            "state_bytes": state_b, "ref_bytes": ref_b, "versions_bytes": versions_b}
    reports = []
    share = None
    if t.share_prompts:
        # The shared programs, on the plan's worst case (make_share_plan needs the batch itself).
        s = share_shapes(t, r, length, hosts=len({d.process_index for d in devices}))
        share = abstract_share_plan(s, mesh)
        info["share"] = s
        # One forward over the batch: per micro-batch the prompts' causal attention, and each
        # response over its prompt's Pp keys and, causally, its own R.
        micro_batches = s.m * s.k
        forward = micro_batches * (2 * n_mm * s.positions + _attention_flops(arch, s.u, s.pp, s.pp) / 2
                                   + _attention_flops(arch, s.b, s.r, s.pp) + _attention_flops(arch, s.b, s.r, s.r) / 2)
    else:
        # One forward over the batch (causal attention: half the query-key pairs).
        forward = 2 * n_mm * rows * length + _attention_flops(arch, rows, length, length) / 2
    micro_per_mini = max(rows // t.num_mini_batches // micro, 1)
    if "update" in programs:
        old = forward if t.num_mini_batches > 1 else 0
        reports.append(_compile(
            "update", functools.partial(ts.update, cfg=t), (state, batch), {} if share is None else {"share": share},
            mesh, donate=(0,),
            resident=ref_b + versions_b, model_flops=(3 * forward + old) / n,
            executed_flops=((4 if m.remat else 3) * forward + old) / n,
            # the weights are read by the forward, the recomputation and the backward of every micro-batch
            min_bytes=params_b * (3 if m.remat else 2) * t.num_mini_batches * micro_per_mini,
            fix="train.micro_batch_size, mesh.fsdp (shard the state), model.remat, model.scan_layers, "
                "train.max_staleness"))
    if "score" in programs and t.kl_coef and share is not None:
        # The reference log-probs as the learner scores them with a plan (`compute_logprobs_shared`).
        reports.append(_compile(
            "score", scoring.shared_score_program, (weights, batch, share), dict(graphdef=state.graphdef, cfg=t), mesh,
            resident=state_b - frozen_b + versions_b, model_flops=forward / n, executed_flops=forward / n,
            min_bytes=params_b * max(rows // (t.micro_batch_size or rows), 1),
            fix="train.micro_batch_size, train.logprob_chunk_size, mesh.fsdp"))
    elif "score" in programs and t.kl_coef:
        b = batch
        reports.append(_compile(
            "score", scoring.score_program, (weights, b.tokens, b.positions, b.input_mask, b.loss_mask),
            dict(graphdef=state.graphdef, micro_batch_size=t.micro_batch_size, chunk_size=t.logprob_chunk_size,
                 with_entropy=False, temperature=float(t.temperature), mesh=mesh), mesh,
            static=("graphdef", "micro_batch_size", "chunk_size", "with_entropy", "temperature", "mesh"),
            # The train state lives beside the reference's weights (LoRA: less the base they share).
            resident=state_b - frozen_b + versions_b + device_bytes(batch)
            - device_bytes((b.tokens, b.positions, b.input_mask, b.loss_mask)),
            model_flops=forward / n, executed_flops=forward / n,
            min_bytes=params_b * max(rows // (t.micro_batch_size or rows), 1),
            fix="train.micro_batch_size, train.logprob_chunk_size, mesh.fsdp"))
    if {"sync", "prefill", "decode", "step"} & set(programs):
        from workflow_r1.aot import sampler

        reports += sampler.compile_programs(run, arch, devices, host, state, create, programs, info, _compile)
    copy_b = info["sampler_weight_bytes"] if info.get("sampler_copy") else 0
    if t.max_staleness and copy_b and len({d.process_index for d in devices}) > 1:
        # On several hosts every version's sampler copy is made when it is published (trainer._publish:
        # the gather runs in the trainer's thread), so k + 1 copies live beside every program; the
        # sampler programs count the one they read as their argument.
        info["version_weights_bytes"] = (t.max_staleness + 1) * copy_b
        reports = [dataclasses.replace(p, resident=p.resident + info["version_weights_bytes"]
                                       - (copy_b if p.name in ("sync", "prefill", "decode", "step") else 0))
                   for p in reports]
    if t.max_staleness and "page_pool_bytes" in info:
        # Asynchronous training rolls later steps out while the update runs: the rollout's page pool
        # and the sampler's weight copy (one of the versions' on several hosts) are live through it too.
        rollout_b = info["page_pool_bytes"] + (0 if "version_weights_bytes" in info else copy_b)
        info["rollout_resident_bytes"] = rollout_b
        reports = [dataclasses.replace(p, resident=p.resident + rollout_b) if p.name in ("update", "score") else p
                   for p in reports]
    return reports, info


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------

def format_reports(reports: list[Report], chip: Chip, topology: str, ndev: int, info: dict[str, Any]) -> str:
    lines = [f"{topology}: {ndev} chips, {_gib(chip.hbm_bytes)} GiB HBM, {chip.peak_flops / 1e12:.0f} TFLOP/s bf16, "
             f"{chip.hbm_bandwidth / 1e9:.0f} GB/s per chip; mesh {info['mesh']}; batch {info['rows']} x "
             f"{info['length']} tokens; train state {_gib(info['state_bytes'])} GiB/device"]
    if "share" in info:
        s = info["share"]
        lines.append(f"shared prompts (train.share_prompts): per micro-batch {s.u} prompt slots x {s.pp} + {s.b} "
                     f"responses x {s.r} = {s.positions:,} positions against {s.b} x {info['length']} = "
                     f"{s.b * info['length']:,} unshared (the budgets' worst case: aot.share_shapes)")
    if "sampler_weight_bytes" in info:
        lines.append(f"sampler weights: {info['sampler_weights_dtype']} on mesh {info['rollout_mesh']}, "
                     f"{_gib(info['sampler_weight_bytes'])} GiB per device, "
                     + ("a copy the sync makes every step" + (f" ({_gib(info['sync_bytes'])} GiB received per device "
                                                             "through its collectives)" if "sync_bytes" in info else "")
                        if info["sampler_copy"] else "the train state's own arrays (no sync)"))
    if "cache_length" in info:
        lines.append(f"sampler: mesh {info['rollout_mesh']}, {info['rollout_rows']} rows in flight per host, "
                     f"cache {info['cache_length']} slots, prefill chunk {info['prefill_chunk']}"
                     + (f", page pool {_gib(info['page_pool_bytes'])} GiB per device"
                        + (" (resident)" if info.get("paged_attention", "view") == "view" else
                           f" (the calls' argument: paged attention {info['paged_attention']})")
                        if "page_pool_bytes" in info else ""))
    lines.append(f"{'program':8} {'args':>7} {'outputs':>7} {'aliased':>7} {'temps':>7} {'resident':>8} "
                 f"{'total':>7} {'of HBM':>6} | {'HLO TFLOP':>9} {'HLO GB':>7} | {'est. s':>8} {'MFU':>4}"
                 f" | {'compile s':>9}")
    for p in reports:
        est = roofline_s(p, chip)
        mfu = p.model_flops / chip.peak_flops / est if est else 0.0
        lines.append(f"{p.name:8} {_gib(p.arguments):>7} {_gib(p.outputs):>7} {_gib(p.aliased):>7} "
                     f"{_gib(p.temporaries):>7} {_gib(p.resident):>8} {_gib(p.total):>7} "
                     f"{100 * p.total / chip.hbm_bytes:>5.0f}% | {p.flops / 1e12:>9.2f} {p.bytes_accessed / 1e9:>7.2f} | "
                     f"{est:>8.3f} {100 * mfu:>3.0f}% | {p.compile_s:>9.0f}")
    lines.append("GiB per device. HLO flops / bytes: XLA's cost analysis of one call, a scan or while body counted "
                 "once. est. s: max(executed flops / peak, weight + cache bytes / bandwidth) per call (decode: "
                 "per token), flops counted from the model (6 N per trained token, 2 N per scored or generated one, "
                 "attention, remat's recomputation), and the sampler's weight gathers or the sync's compiled "
                 "collectives / ICI bandwidth; other ICI traffic and executor time not included.")
    return "\n".join(lines)


def check_fit(reports: list[Report], chip: Chip, headroom: float) -> str | None:
    """The one-line error for the first program over `headroom` x HBM, or None when all fit."""
    for p in reports:
        if p.total > headroom * chip.hbm_bytes:
            return (f"error: {p.name} needs {_gib(p.total)} GiB per device, over {headroom:.0%} of the "
                    f"{_gib(chip.hbm_bytes)} GiB HBM; change {p.fix}, or use a larger slice")
    return None


def architecture(run: Any) -> Any:
    """The policy's shapes without its weights: the preset's, the checkpoint's config.json, or
    (neither: the bundled model) Qwen2.5-0.5B's, which the bundled Coder-0.5B shares."""
    from workflow_r1.model.config import PRESETS, Qwen2Config

    if run.model.preset:
        return PRESETS[run.model.preset]
    if run.model.checkpoint:
        return Qwen2Config.from_hf(run.model.checkpoint)
    return PRESETS["qwen2.5-0.5b"]


@dataclasses.dataclass(frozen=True)
class Sections:
    """The config sections that shape the compiled programs (the executor, data and the rest do not)."""

    model: Any
    mesh: Any
    train: Any
    rollout: Any

    @classmethod
    def from_config(cls, cfg: Any) -> "Sections":
        from workflow_r1 import configlib
        from workflow_r1.policy import ModelConfig
        from workflow_r1.rl.train_state import TrainConfig
        from workflow_r1.rollout import RolloutConfig
        from workflow_r1.sharding import MeshConfig

        out = cls(model=configlib.to_dataclass(ModelConfig, cfg.model, "model"),
                  mesh=configlib.to_dataclass(MeshConfig, cfg.mesh, "mesh"),
                  train=configlib.to_dataclass(TrainConfig, cfg.train, "train"),
                  rollout=configlib.to_dataclass(RolloutConfig, cfg.rollout, "rollout"))
        rows, t = out.rollout.prompts_per_step * out.rollout.n, out.train
        micro = t.micro_batch_size or rows // t.num_mini_batches
        if rows % t.num_mini_batches or (rows // t.num_mini_batches) % micro:
            raise AotError(f"rollout.prompts_per_step x rollout.n = {rows} rows must split into "
                           f"train.num_mini_batches={t.num_mini_batches} mini-batches of whole "
                           f"train.micro_batch_size={t.micro_batch_size} micro-batches")
        return out
