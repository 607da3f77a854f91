"""Batched KV-cache generation for the NNX Qwen2: jitted prefill + `lax.while_loop` decode.

Modules, one idea each:
  sampler.py       the public `Sampler` API: multi-turn bookkeeping, paged calls (`new_pages`, `generate_paged`).
  device_cache.py  a session's KV cache on the devices: placement over the mesh, allocation and growth,
                   resets, the chunked writes of pending tokens (`write`).
  session.py       what it hands out and keeps: `Session`, `SampleOutput`, `SamplerError`, argument checks,
                   length buckets, the plan of a cache write (`write_plan`: rows and chunk of each extend).
  text.py          text in and out: chat-templated prompts, decoded generations (`generate_text`).
  loop.py          the jitted programs: prefill a chunk in all rows or a few (`extend`), decode
                   (`lax.while_loop`), grow the cache.
  sampling.py      per-step sampling rules: greedy, temperature, top-k, top-p, the picked log-prob.
  stop_strings.py  stop strings as token-level KMP automata (`vocab_bytes`, `stop_tables`).
  paged.py         a paged KV cache on device: the dense view of a call's rows, the pages written copied back.
  fused_cpu.py     the fast single-device XLA:CPU forward (impl "fused_cpu"): the model's math on fused,
                   [out, in] weights with a head-major fp32 KV cache (keys transposed).

Loading a checkpoint into a sampler for the executor: `workflow_r1.executor.local_backend.load_sampler`.
"""

from workflow_r1.sampler.sampler import FINISH_REASONS, SampleOutput, Sampler, SamplerError, Session
from workflow_r1.sampler.stop_strings import stop_tables, vocab_bytes

__all__ = ["FINISH_REASONS", "SampleOutput", "Sampler", "SamplerError", "Session", "stop_tables", "vocab_bytes"]
