"""The sampler's programs of a step, compiled as the trainer builds its sampler (`trainer.Trainer`:
the mesh from `sharding.make_meshes(run.mesh, sampler_tensor=rollout.tensor_parallel)`, then
`Sampler(weights_dtype=rollout.weights_dtype, paged_attention=rollout.paged_attention)`):

  sync     `weights.program` (built by `weights.for_aot`): the train state's weights (FSDP, their
           dtype, LoRA adapters beside the base) to the sampler's copy (LoRA merged, in
           `rollout.weights_dtype`, on the sampler mesh's layout), once per step after the update.
           Compiled over the whole slice, only when the sampler reads a copy (`weights.needed`, or
           LoRA); without one the sampler reads the train state's own arrays and nothing moves.
  prefill  `loop.extend_impl`: a prefill chunk for all of a host's rows in flight.
  decode   `loop.decode_impl`: the whole response budget at the full cache length.
  step     `ragged.step_impl`: one full ragged engine step (`rollout.max_tokens_per_step` tokens
           of the rows in flight in one flat run, the pages read in place), when asked for.

The sampler's mesh is each host's own chips (`rollout.tensor_parallel` != 0: (data, 1, tensor)
groups of them; 0 on several hosts: the host's chips at `mesh.tensor`) or, with 0 on one host, the
training mesh. Its KV pages lie as `paged.new_pages` places them (`paged.abstract_cache`): read in
place ("kernel", "gather"), split over the KV heads on a tensor axis that divides them
(`paged_kv.page_spec`), else replicated; a dense working view ("view") beside the resident pool.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from workflow_r1.aot.compiled import AotError, Report, _attention_flops, _matmul_params, device_bytes

# A prefill call's chunk: Sampler(prefill_chunk=...)'s default, what the trainer uses.
PREFILL_CHUNK = 512


def _sampler_mesh(run: Any, devices: list[Any], host: list[Any]) -> Any:
    from workflow_r1 import sharding

    try:
        return sharding.make_meshes(run.mesh, devices=devices, host_devices=host,
                                    sampler_tensor=run.rollout.tensor_parallel)[1]
    except ValueError as e:
        raise AotError(f"{e}; set rollout.tensor_parallel or mesh.tensor") from None


def compile_programs(run: Any, arch: Any, devices: list[Any], host: list[Any] | None, state: Any, create: Any,
                     programs: list[str], info: dict[str, Any], compile_one: Callable[..., Report]) -> list[Report]:
    """The `Report`s of the requested sampler programs (sync, prefill, decode, step) of `run` on the
    slice `devices`, and their figures added to `info` (which holds the train state's per-device
    bytes: params_bytes, state_bytes, ref_bytes, versions_bytes). `state`: the abstract train state
    on the training mesh; `create`: builds the policy without adapters (the merged model's
    structure); `host`: the devices the prefill and decode compile for (`aot.host_devices`; default
    the first host's);
    `compile_one`: compiles one program (`compiled._compile`, as `aot.compile_all` holds it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from workflow_r1 import policy, sharding
    from workflow_r1.sampler import loop, paged, weights

    r, m = run.rollout, run.model
    hosts = sorted({d.process_index for d in devices})
    first = [d for d in devices if d.process_index == hosts[0]]
    rmesh = _sampler_mesh(run, devices, host or first)
    # The sync is one program over the slice: its outputs on the first host's own chips (the
    # prefill and decode of a v5e-16 host compile for a slice of their own, which it cannot name).
    smesh = rmesh if set(rmesh.devices.flat) <= set(devices) else _sampler_mesh(run, devices, first)
    params_b, state_b = info["params_bytes"], info["state_bytes"]
    # Beside the train state: the KL reference and asynchronous training's policy versions.
    beside_b = info["ref_bytes"] + info.get("versions_bytes", 0)
    # What Sampler.update_params gets: the train state's model, LoRA adapters included.
    graphdef, trained = nnx.split(state.model())
    copy = bool(m.lora_rank) or weights.needed(trained, r.weights_dtype, smesh)
    # The sampler's model: with LoRA the merged weights (W + scale A B) in the base's structure.
    sampler_graphdef = nnx.split(nnx.eval_shape(create))[0] if m.lora_rank else graphdef
    sampled = weights.abstract_params(graphdef, trained, r.weights_dtype, rmesh) if copy else trained
    dtype = policy.DTYPES[m.dtype]
    reports = []
    info.update(rollout_mesh=dict(rmesh.shape), sampler_weight_bytes=device_bytes(sampled), sampler_copy=copy,
                sampler_weights_dtype=str(jax.tree.leaves(sampled)[0].dtype))
    if "sync" in programs and copy:
        sync, out = weights.for_aot(graphdef, trained, r.weights_dtype, smesh)
        reports.append(compile_one(
            "sync", sync, (trained,), {}, None, collectives=True,
            # after the update: the rest of the train state and the reference live beside it; the
            # sampler's old copy is released before the update (Sampler.release_params)
            resident=state_b - params_b + beside_b,
            min_bytes=params_b + device_bytes(out),  # its weight shards read, its copy written
            fix="rollout.weights_dtype, rollout.tensor_parallel, mesh.fsdp"))
        info["sync_bytes"] = reports[-1].ici_bytes
    if not {"prefill", "decode", "step"} & set(programs):
        return reports
    # The train state lives through the rollout (the sampler reads its own weights, or a copy of them).
    resident = state_b + beside_b if copy else state_b - params_b + beside_b
    host_rows = r.prompts_per_step * r.n // len(hosts)
    if r.max_rows_in_flight:  # the engine's rows in flight, not the batch
        host_rows = min(host_rows, r.max_rows_in_flight)
    mult = rmesh.shape["data"] * rmesh.shape["fsdp"]
    # A call's rows: a power of two; its cache (paged.abstract_cache, as rollout.paged_attention
    # reads the pages on TPU): a dense view of the rows beside the page pool, resident for the whole
    # rollout, or the pool itself, read in place.
    b = -(-(1 << (host_rows - 1).bit_length()) // mult) * mult
    size = r.page_size * paged.working_pages(r.pages_per_row, r.cache_size, r.page_size)
    pages = r.page_budget(host_rows)
    attention = paged.attention_mode(r.paged_attention, "model", backend=devices[0].platform)
    cache, live_b, page_b = paged.abstract_cache(arch, attention, b, size, pages, r.page_size, dtype, rmesh,
                                                 m.scan_layers)
    info["page_pool_bytes"] = (pages + 1) * page_b  # + the scratch page
    info.update(hosts=len(hosts), host_rows=r.prompts_per_step * r.n // len(hosts),
                kv_bytes_per_token=page_b // r.page_size, paged_attention=attention)
    if attention == "view":
        resident += info["page_pool_bytes"]
    chunk = PREFILL_CHUNK
    rep = NamedSharding(rmesh, P())
    vec = lambda dt, *shape: jax.ShapeDtypeStruct((b,) + shape, dt,  # noqa: E731
                                                  sharding=sharding.batch_sharding(rmesh, 1 + len(shape)))
    logits = vec(jnp.float32, arch.vocab_size)
    impl = loop.Impl("model", sampler_graphdef, arch, jnp.dtype(dtype))
    per = max(len(rmesh.devices.flat), 1)
    n_mm = _matmul_params(arch)
    # Weights sharded over `fsdp` (one host with rollout.tensor_parallel=0: the sampler runs on the
    # training mesh) are all-gathered by every call (XLA's partitioner gathers a weight whose
    # sharded axis is contracted with batch-sharded rows): each chip receives the shards it lacks,
    # then reads the whole (tensor-split) weights from HBM.
    held = device_bytes(sampled)
    read = max(held, sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(sampled))
               // rmesh.shape["tensor"]) if rmesh.shape["fsdp"] > 1 else held
    if "prefill" in programs:
        flops = (2 * n_mm * b * chunk + _attention_flops(arch, b, chunk, size)) / per
        reports.append(compile_one(
            "prefill", functools.partial(loop.extend_impl, impl),
            (sampled, cache, logits, vec(jnp.int32, chunk), vec(jnp.int32)), {}, rmesh, donate=(1, 2),
            resident=resident,  # per call: a chunk of every row's tokens
            model_flops=flops, executed_flops=flops, min_bytes=read + live_b, ici_bytes=read - held,
            attention_flops=_attention_flops(arch, b, chunk, size) / per, cache_bytes=live_b,
            fix="rollout.prompts_per_step / rollout.n (rows in flight), rollout.max_prompt_tokens + "
                "rollout.max_response_tokens (cache length: each chunk's attention scores are rows x "
                "heads x 512 x cache slots), rollout.tensor_parallel / mesh.tensor"))
    if "decode" in programs:
        buf = max(16, 1 << (max(r.max_turn_tokens or r.max_response_tokens, 1) - 1).bit_length())
        scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=rep)  # noqa: E731
        args = (sampled, cache, logits, vec(jnp.int32), vec(jnp.int32),
                jax.ShapeDtypeStruct((len(arch.eos_token_ids),), jnp.int32, sharding=rep), None,
                scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32),
                # per-row sampling keys (seeds, row ids, step offsets), then stop_after
                vec(jnp.int32), vec(jnp.int32), vec(jnp.int32), scalar(jnp.int32))
        # Per generated token of every row of the call (one pass of the loop body).
        flops = (2 * n_mm * b + _attention_flops(arch, b, 1, size)) / per
        reports.append(compile_one(
            "decode", functools.partial(loop.decode_impl, impl, buf_len=buf, greedy=False, top_k_bucket=0,
                                        use_top_p=r.top_p < 1.0),
            args, {}, rmesh, donate=(1,), resident=resident,
            model_flops=flops, executed_flops=flops, min_bytes=read + live_b, ici_bytes=read - held,
            attention_flops=_attention_flops(arch, b, 1, size) / per, cache_bytes=live_b,
            fix="rollout.prompts_per_step / rollout.n (rows in flight), rollout.max_response_tokens "
                "(cache length), rollout.tensor_parallel / mesh.tensor"))
        info["decode_steps"] = min(buf, r.max_response_tokens)
    if "step" in programs:
        reports.append(_ragged_step(r, arch, impl, sampled, cache, rmesh, attention, b, size, per, n_mm, read, held,
                                    resident, compile_one))
        info["step_tokens"] = _step_tokens(r)
    info.update(rollout_rows=b, cache_length=size, prefill_chunk=chunk,
                working_cache_bytes=device_bytes(cache) if attention == "view" else 0)
    return reports


def _step_tokens(r: Any) -> int:
    """A full ragged step's flat run: `max_tokens_per_step` rounded up to a power of two."""
    return 1 << (max(r.max_tokens_per_step, 1) - 1).bit_length()


def _ragged_step(r: Any, arch: Any, impl: Any, sampled: Any, cache: Any, rmesh: Any, attention: str, rows: int,
                 size: int, per: int, n_mm: int, read: int, held: int, resident: int,
                 compile_one: Callable[..., Report]) -> Report:
    """`ragged.step_impl` at a full step (`rollout.max_tokens_per_step` tokens of the host's rows in
    flight, sampler/ragged.py) on the page pool in place: the program every engine step runs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from workflow_r1.model import paged_kv
    from workflow_r1.sampler import ragged

    if not r.max_tokens_per_step:
        raise AotError("--programs=step compiles a ragged engine step: set rollout.max_tokens_per_step")
    if attention == "view" or rmesh.shape["data"] * rmesh.shape["fsdp"] > 1:
        raise AotError("a ragged step runs one flat run on pages read in place: set rollout.paged_attention=kernel "
                       "(or auto on TPU) and rollout.tensor_parallel=-1 (a host's chips split the heads)")
    n = _step_tokens(r)
    s = min(n, rows)
    rep = NamedSharding(rmesh, P())
    arr = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    i32 = jnp.int32
    run = (arr(i32, rows, size // r.page_size), arr(i32, n), arr(i32, n), arr(i32, n), arr(jnp.bool_, n),
           arr(i32, rows), arr(i32, rows + 1), arr(i32, 1))
    args = (sampled, cache.kv, run, arr(i32, s), arr(jnp.float32), arr(jnp.float32), arr(i32), arr(i32, s),
            arr(i32, s), arr(i32, s))
    # Every token of the run attends to at most a longest row's slots.
    attn = _attention_flops(arch, 1, n, size) / per
    flops = 2 * n_mm * n / per + attn
    pages_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.kv)) // per
    return compile_one(
        "step", functools.partial(ragged.step_impl, impl, attention=attention, block=min(n, paged_kv.TOKEN_BLOCK), greedy=False,
                                  top_k_bucket=0, use_top_p=r.top_p < 1.0),
        args, {}, rmesh, donate=(1,), resident=resident, model_flops=flops, executed_flops=flops,
        min_bytes=read, ici_bytes=read - held, attention_flops=attn, cache_bytes=pages_b,
        fix="rollout.max_tokens_per_step, rollout.max_rows_in_flight, rollout.tensor_parallel / mesh.tensor")
